"""Progress display for long loops (calibration, GPTQ, reports): tqdm if installed, else stderr."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any


def track(items: Iterable[Any], desc: str, enabled: bool, total: int | None = None) -> Iterator:
    """Iterates ``items`` with a progress display (tqdm if installed, else stderr)."""
    if not enabled:
        yield from items
        return
    if total is None:
        total = len(items) if hasattr(items, "__len__") else None  # type: ignore[arg-type]
    try:
        from tqdm.auto import tqdm  # noqa: PLC0415 - optional
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(items, desc=desc, total=total)
        return
    start, n = time.monotonic(), 0
    of = f"/{total}" if total is not None else ""
    try:
        for n, item in enumerate(items, 1):  # noqa: B007 - n is reported below
            yield item
            sys.stderr.write(f"\r{desc}: {n}{of} ({time.monotonic() - start:.1f} s)")
            sys.stderr.flush()
    finally:
        if n:
            sys.stderr.write("\n")

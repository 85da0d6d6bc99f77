"""Atomic file writes: a file is either its old self or completely new, never half written.

The packages built on qcore (checkpoints, ``.tflite`` models, reports) and the
examples and benchmarks write through :func:`write_atomic`: it writes a temporary
sibling of the target, flushes it to disk, then renames it over the target in one
step. A failure at any point (a full disk, an exception while producing the bytes,
an interrupted process) leaves the target as it was and removes the temporary.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from qcore.files import write_atomic
    >>> target = Path(tempfile.mkdtemp()) / "results.json"
    >>> write_atomic(target, b'{"ok": true}')
    PosixPath('.../results.json')
    >>> target.read_bytes()
    b'{"ok": true}'
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["write_atomic"]


def write_atomic(
    path: str | os.PathLike,
    data: bytes | Callable[[BinaryIO], object],
    *,
    replace: Callable[[Path], bool] | None = None,
) -> Path:
    """Writes ``data`` to ``path`` atomically; returns the path written.

    Args:
        path: The file to write. Its directory must exist.
        data: The bytes to write, or a function that writes them into the binary
            file object it is given (e.g. ``lambda f: fig.savefig(f, format="png")``);
            anything it raises aborts the write.
        replace: Decides whether an existing file at ``path`` may be replaced (it is
            given the path). ``None`` replaces any regular file. A directory or other
            non-file at ``path`` is never replaced.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        FileExistsError: If ``path`` is a directory or another non-file, or an existing
            file that ``replace`` refuses; nothing is written then.
        FileNotFoundError: If the directory of ``path`` does not exist.
    """
    target = Path(path)
    if target.exists() or target.is_symlink():
        if not target.is_file():
            raise FileExistsError(f"path={str(target)!r} exists and is not a file; not replaced")
        if replace is not None and not replace(target):
            raise FileExistsError(f"path={str(target)!r} exists and may not be replaced")
    directory = target.parent
    if not directory.is_dir():
        raise FileNotFoundError(f"path={str(target)!r}: its directory does not exist")
    fd, tmp = _create_temporary(target)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, bytes | bytearray | memoryview):
                f.write(data)
            else:
                data(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_directory(directory)
    return target


def _create_temporary(target: Path) -> tuple[int, Path]:
    """Creates a new hidden sibling of ``target`` with the permissions a new file gets."""
    while True:
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:  # 0o666 less the umask, like open(); mkstemp would make it 0o600
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:  # pragma: no cover - a 32-bit name collision
            continue


def _sync_directory(directory: Path) -> None:
    """Flushes a directory entry (the rename) to disk where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)

"""How long a fast model runs slow after a slow one, on this machine.

The benchmarks interleave configurations whose calls take 3 to 200 ms. This script
measures what one configuration leaves behind for the next: the Flax stack of
``flax_ptq.py`` (four ``nn.Dense(4096)`` layers) quantized ``w8`` by qflax, called
at batch 1 ``--calls`` times in a row right after one call of something else, in
``--reps`` (≥ 21) interleaved rounds:

* ``after bf16``: one call of the bfloat16 stack (about 100 ms on both cores here);
* ``after fp32``: one call of the float32 stack (about 10 ms);
* ``steady``: right after the previous w8 call.

Each column is the median time of the i-th call; "elapsed ms" is the median time
from the end of the other call to the start of the i-th. The benchmarks' untimed
calls (``ops.settled_call``) last at least ``ops.SETTLE_MS`` because of this table.

Run: ``nox -s bench`` (or ``python benchmarks/settle.py --help``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax_ptq import WIDTH, Stack, ours
from ops import HERE, SETTLE_MS, measured_on, publish, qkernels_version, replace_section, run_info

import qflax

SHOWN = (1, 2, 3, 4, 6, 8, 12, 16, 24)  # the calls the table shows


def run(calls: int, reps: int) -> dict[str, Any]:
    """{condition: {"ms": [median of call i], "elapsed_ms": [median start of call i]}}."""
    x = jax.random.normal(jax.random.key(1), (1, WIDTH))
    params = Stack().init(jax.random.key(0), x)["params"]
    w8, qparams = ours("w8", params, x)
    bf16 = jax.jit(lambda x, p: Stack(jnp.bfloat16).apply({"params": p}, x))
    bf16_params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    fp32 = jax.jit(lambda x, p: Stack().apply({"params": p}, x))
    before = {
        "after bf16": lambda: bf16(x, bf16_params).block_until_ready(),
        "after fp32": lambda: fp32(x, params).block_until_ready(),
        "steady": lambda: w8(x, qparams).block_until_ready(),
    }
    for call in before.values():  # compile and warm everything
        for _ in range(3):
            call()
    ms = {k: [[] for _ in range(calls)] for k in before}
    elapsed = {k: [[] for _ in range(calls)] for k in before}
    for _ in range(reps):
        for name, call in before.items():
            call()
            start = time.perf_counter()
            for i in range(calls):
                t0 = time.perf_counter()
                w8(x, qparams).block_until_ready()
                ms[name][i].append((time.perf_counter() - t0) * 1e3)
                elapsed[name][i].append((t0 - start) * 1e3)
    return {
        k: {
            "ms": [statistics.median(v) for v in ms[k]],
            "elapsed_ms": [statistics.median(v) for v in elapsed[k]],
        }
        for k in before
    }


def table(data: dict[str, Any]) -> str:
    """Markdown: one row per condition, the median time of calls 1, 2, 3, … after it."""
    shown = [i for i in SHOWN if i <= len(data["rows"]["steady"]["ms"])]
    head = " | ".join(f"call {i}" for i in shown)
    lines = [f"| w8 calls | {head} |", "| --- |" + " ---: |" * len(shown)]
    for name, r in data["rows"].items():
        cells = " | ".join(f"{r['ms'][i - 1]:.2f}" for i in shown)
        lines.append(f"| {name}: ms | {cells} |")
        cells = " | ".join(f"{r['elapsed_ms'][i - 1]:.0f}" for i in shown)
        lines.append(f"| {name}: elapsed ms | {cells} |")
    return "\n".join(lines)


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the settle section of benchmarks/README.md."""
    m = data["machine"]
    body = (
        measured_on(m, f"qflax {m['qflax']}, qkernels {m['qkernels']}")
        + f" Medians of {m['reps']} interleaved rounds; the benchmarks now settle for"
        f" {SETTLE_MS:.0f} ms.\n\n" + table(data)
    )
    replace_section(path, "settle", body)


def main(argv: list[str] | None = None) -> int:
    """Runs the measurement; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="rounds (>= 21)")
    parser.add_argument("--calls", type=int, default=24, help="w8 calls after each (>= 4)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "settle.json")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args(argv)
    if args.reps < 21:
        parser.error(f"--reps must be >= 21, got {args.reps}")
    if args.calls < 4:
        parser.error(f"--calls must be >= 4, got {args.calls}")
    info = run_info(
        args.reps, calls=args.calls, qflax=qflax.__version__, qkernels=qkernels_version()
    )
    data = {"machine": info, "rows": run(args.calls, args.reps)}
    print(table(data))
    publish("settle", data, args.out, args.readme, update_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())

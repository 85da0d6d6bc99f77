"""w8a8 with a (K, N) weight on XLA:CPU: one int8 GEMM, or K blocks converted to float.

qcore's w8a8 kernel (``qcore.ops.kernels.w8a8``) multiplies int8 activation codes by
int8 weight codes. With the weight stored (K, N), Flax's layout, an int8 GEMM takes
the weight as its right operand, which XLA:CPU re-packs on every call; the
alternative converts blocks of 512 weight rows to float (f32 at batch 1, bf16 above:
codes are exact in bf16) and accumulates f32 dots. Both give the same exact integer
sums (checked here). This script times both, and the float32 product of the same
shapes, on the weight sizes of the zoo's models and larger:

* ``int8 GEMM``: ``lax.dot`` of the codes with int32 accumulation, batch 1 padded to
  2 rows;
* ``blocks``: ``w8a8(..., layout="kn", block=512)``;
* ``float32``: ``x @ w`` on float32 operands (the model before quantization).

Rounds visit every configuration once (interleaved); each call is timed alone after
an untimed call; medians and p10–p90 over ``--reps`` (>= 21) rounds. "limit ms" is the
weight's bytes (int8, or float32 for the float product) over the memory read
bandwidth measured in the same run (a jitted sum of 256 MiB of float32), the time
no product that reads the weight once can beat.

Run: ``nox -s bench`` or ``python benchmarks/w8a8_layout.py [--readme]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ops import measured_on, replace_section, run_info

from qcore.files import write_atomic
from qcore.ops import kernels

HERE = Path(__file__).resolve().parent
SHAPES = [(512, 2048), (2048, 512), (1024, 4096), (2048, 8192), (4096, 4096)]
BATCHES = [1, 8, 64]
CONFIGS = ("int8 GEMM", "blocks", "float32")


def _functions(k: int, n: int, m: int) -> dict[str, tuple[Any, tuple]]:
    rng = np.random.default_rng(k * n + m)
    w = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    x = jnp.asarray(rng.integers(-127, 128, (m, k)), jnp.int8)
    xs, ws = jnp.full((m, 1), 0.01, jnp.float32), jnp.full((1, n), 0.02, jnp.float32)
    xf, wf = x.astype(jnp.float32) * xs, w.astype(jnp.float32) * ws
    return {
        "int8 GEMM": (lambda x, w: _int8_gemm(x, w) * xs * ws, (x, w)),
        "blocks": (lambda x, w: kernels.w8a8(x, xs, w, ws, layout="kn", block=512), (x, w)),
        "float32": (lambda x, w: x @ w, (xf, wf)),
    }


def _int8_gemm(x: jax.Array, w: jax.Array) -> jax.Array:
    m = x.shape[0]
    xp = jnp.concatenate([x, jnp.zeros_like(x)], 0) if m == 1 else x
    return jax.lax.dot(xp, w, preferred_element_type=jnp.int32)[:m].astype(jnp.float32)


def _time(fn: Any, args: tuple) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) * 1e3


def _stats(v: list[float]) -> dict[str, float]:
    p10, p90 = np.percentile(v, [10, 90])
    return {"median": statistics.median(v), "p10": float(p10), "p90": float(p90)}


def bandwidth_gbs(reps: int) -> float:
    """Memory read bandwidth (GB/s): a jitted sum of 256 MiB of float32."""
    x = jnp.ones((64, 2**20), jnp.float32)
    f = jax.jit(jnp.sum)
    ms = statistics.median(_time(f, (x,)) for _ in range(reps))
    return x.nbytes / (ms * 1e-3) / 1e9


def run(reps: int) -> list[dict[str, Any]]:
    """One row per (shape, batch, config), interleaved rounds within each case."""
    rows = []
    for k, n in SHAPES:
        for m in BATCHES:
            fns = _functions(k, n, m)
            compiled = {c: jax.jit(f).lower(*a).compile() for c, (f, a) in fns.items()}
            exact = np.asarray(compiled["int8 GEMM"](*fns["int8 GEMM"][1]))
            np.testing.assert_array_equal(np.asarray(compiled["blocks"](*fns["blocks"][1])), exact)
            times: dict[str, list[float]] = {c: [] for c in CONFIGS}
            for _ in range(reps):
                for c in CONFIGS:
                    times[c].append(_time(compiled[c], fns[c][1]))
            for c in CONFIGS:
                ratio = [t / b for t, b in zip(times[c], times["blocks"], strict=True)]
                rows.append(
                    {
                        "k": k,
                        "n": n,
                        "m": m,
                        "config": c,
                        "ms": _stats(times[c]),
                        "vs_blocks": _stats(ratio),
                    }
                )
                r = rows[-1]
                print(
                    f"  ({m}, {k}) x ({k}, {n}) {c:10s} {r['ms']['median']:8.3f} ms"
                    f"  x{r['vs_blocks']['median']:.2f} of blocks",
                    flush=True,
                )
    return rows


def table(rows: list[dict[str, Any]], gbs: float) -> str:
    """Markdown table: medians with p10–p90 and the weight-read limit."""
    lines = [
        "| x · w | config | ms | vs blocks | limit ms (weight bytes ÷ bandwidth) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        width = 4 if r["config"] == "float32" else 1  # bytes per weight element
        limit = width * r["k"] * r["n"] / (gbs * 1e9) * 1e3
        ms, ratio = r["ms"], r["vs_blocks"]
        lines.append(
            f"| ({r['m']}, {r['k']}) · ({r['k']}, {r['n']}) | {r['config']} | "
            f"{ms['median']:.3f} ({ms['p10']:.3f}–{ms['p90']:.3f}) | "
            f"{ratio['median']:.2f}× ({ratio['p10']:.2f}–{ratio['p90']:.2f}) | {limit:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="timed rounds (>= 21)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "w8a8_layout.json")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args(argv)
    if args.reps < 21:
        parser.error(f"--reps must be >= 21, got {args.reps}")
    info = run_info(args.reps)
    gbs = bandwidth_gbs(args.reps)
    print(f"memory bandwidth {gbs:.1f} GB/s", flush=True)
    data = {"machine": info, "bandwidth_gbs": gbs, "rows": run(args.reps)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(data, indent=1).encode())
    print(f"wrote {args.out}")
    if args.readme:
        body = (
            measured_on(info, f"qcore {info['qcore']}")
            + f" {args.reps} interleaved rounds, medians with p10–p90; memory bandwidth"
            f" {gbs:.1f} GB/s measured in the same run. The kernel runs the int8 GEMM"
            " except at batch 1 on weights above 4 MiB.\n\n" + table(data["rows"], gbs)
        )
        replace_section(HERE / "README.md", "w8a8_layout", body)
        print(f"updated {HERE / 'README.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

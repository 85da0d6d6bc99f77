"""The matrix products under w8a8 at batch on this CPU: float32, XLA's int8, qkernels'.

Shapes: the three products of MiniLM's encoder at 32 x 128 tokens (``(4096, 384) x
(384, 384)``, ``x (384, 1536)``, ``(4096, 1536) x (1536, 384)``) and one layer of the
Flax PTQ stack at batch 64 (``(64, 4096) x (4096, 4096)``); weights stored ``(K, N)``
(Flax's layout). Per shape, jitted:

* ``f32``: ``x @ w`` in float32 (what the float model runs);
* ``xla int8``: ``lax.dot`` of int8 codes with int32 accumulation (qcore's w8a8
  product without qkernels);
* ``qkernels int8``: ``qkernels.int8_gemm`` on the same codes (skipped if the package
  is not installed); its int32 result is checked equal to XLA's on every run.

The codes are those qcore makes (symmetric int8, which reaches -128). Rounds call the
three in turn, each timed call after three untimed ones; medians and p10–p90 over
``--reps`` (>= 21) rounds. GMAC/s is multiply-accumulates (M·K·N) per second of the
median. These products are bound by arithmetic, not memory (each weight byte is used
M times), so the limit that applies is the CPU's multiply-accumulate rate: on a CPU
without VNNI an exact int8 multiply-accumulate costs about as many vector
instructions as a float32 one (``docs/design.md``), which is why neither int8 row can
be far ahead of float32 there.

Run: ``nox -s bench`` (or ``python benchmarks/int8_gemm.py --help``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from ops import HERE, measured_on, publish, qkernels_version, replace_section, run_info, time_call

import qcore

SHAPES = {
    "MiniLM q/k/v/out": (4096, 384, 384),
    "MiniLM intermediate": (4096, 384, 1536),
    "MiniLM output": (4096, 1536, 384),
    "Flax stack b64": (64, 4096, 4096),
}


def impls() -> dict[str, Any]:
    """The jitted products by name: each takes ``(x, w)`` as its row prepares them."""
    out = {
        "f32": jax.jit(lambda x, w: x @ w),
        "xla int8": jax.jit(lambda x, w: lax.dot(x, w, preferred_element_type=jnp.int32)),
    }
    if qkernels_version() is not None:
        import qkernels  # noqa: PLC0415 - optional

        out["qkernels int8"] = jax.jit(qkernels.int8_gemm)
    return out


def run(reps: int, untimed: int) -> list[dict[str, Any]]:
    """Times every product on every shape; returns the table's rows."""
    rng = np.random.default_rng(0)
    fns = impls()
    rows = []
    for label, (m, k, n) in SHAPES.items():
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        q_x = qcore.quantize(x, qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,)))
        q_w = qcore.quantize(w, qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)))
        args = {name: (x, w) if name == "f32" else (q_x.qvalue, q_w.qvalue) for name in fns}
        ints = {n: np.asarray(f(*args[n])) for n, f in fns.items() if n != "f32"}
        if "qkernels int8" in ints and not np.array_equal(ints["qkernels int8"], ints["xla int8"]):
            raise SystemExit(f"{label}: qkernels' int8 GEMM differs from XLA's")
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(reps):
            for name, fn in fns.items():
                for _ in range(untimed):
                    time_call(fn, *args[name])
                times[name].append(time_call(fn, *args[name]))
        base = statistics.median(times["f32"])
        for name, t in times.items():
            med = statistics.median(t)
            rows.append(
                {
                    "shape": label,
                    "m_k_n": [m, k, n],
                    "impl": name,
                    "median_ms": med,
                    "p10_ms": float(np.percentile(t, 10)),
                    "p90_ms": float(np.percentile(t, 90)),
                    "gmac_per_s": m * k * n / med / 1e6,
                    "speedup_vs_f32": base / med,
                }
            )
            print(f"{label:20s} {name:14s} {med:8.2f} ms {rows[-1]['gmac_per_s']:6.0f} GMAC/s")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the results."""
    lines = [
        "| product | M × K × N | impl | median ms | p10–p90 ms | GMAC/s | vs f32 |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        m, k, n = r["m_k_n"]
        lines.append(
            f"| {r['shape']} | {m} × {k} × {n} | {r['impl']} | {r['median_ms']:.2f} | "
            f"{r['p10_ms']:.2f}–{r['p90_ms']:.2f} | {r['gmac_per_s']:.0f} | "
            f"{r['speedup_vs_f32']:.2f}× |"
        )
    return "\n".join(lines)


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the int8-gemm table of benchmarks/README.md."""
    m = data["machine"]
    body = "\n".join(
        [
            measured_on(m, f"qkernels {m['qkernels']}")
            + f" Median of {m['reps']} rounds, each timed call after {m['untimed']} untimed"
            " ones.",
            "",
            table(data["rows"]),
        ]
    )
    replace_section(path, "int8-gemm", body)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="timed rounds (>= 21)")
    parser.add_argument("--untimed", type=int, default=3, help="untimed calls before each timed")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "int8_gemm.json")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args(argv)
    if args.reps < 21:
        parser.error(f"--reps must be >= 21, got {args.reps}")
    if args.untimed < 1:
        parser.error(f"--untimed must be >= 1, got {args.untimed}")
    info = run_info(args.reps, untimed=args.untimed, qkernels=qkernels_version())
    data = {"machine": info, "rows": run(args.reps, args.untimed)}
    print()
    print(table(data["rows"]))
    publish("int8_gemm", data, args.out, args.readme, update_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())

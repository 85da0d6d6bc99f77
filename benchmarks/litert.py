"""LiteRT export: float vs full-int8 .tflite size, conversion time and interpreter latency.

Models: the digits CNN (conv 8 -> conv 16 -> max pool -> dense, 8x8x1 inputs,
trained a few steps on scikit-learn's digits) and a 4-layer MLP, 1024 wide. Each is
exported as float (``qlitert.export(fn, validate=False)``) and as int8 (calibrated
on 4 batches, annotated, exported and validated). Latency: the LiteRT interpreter
(``ai_edge_litert``, XNNPACK delegate) at batch 1 with 2 threads, median of
``--reps`` timings of ``--calls`` calls each after warm-up; conversion time is one
export (jax.export + conversion + validation for int8). Ratios compare the two
files of one model in the same run.

Run: ``nox -s bench`` (or ``python benchmarks/litert.py --help``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from ops import measured_on, publish, replace_section, run_info

import qlitert

HERE = Path(__file__).resolve().parent


class DigitsCNN(nn.Module):
    """The digits CNN of the qlitert tests."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.max_pool(nn.relu(nn.Conv(16, (3, 3))(x)), (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class MLP(nn.Module):
    """Four Dense(1024) layers with relu between them."""

    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = nn.Dense(1024)(x)
            if i < 3:
                x = nn.relu(x)
        return x


def latency_ms(tflite: bytes, x: np.ndarray, reps: int, calls: int) -> list[float]:
    """Milliseconds per call, one median-able value per rep of ``calls`` calls."""
    model = qlitert.LiteRTModel(tflite, num_threads=2)
    for _ in range(10):
        model(x)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            model(x)
        out.append((time.perf_counter() - t0) * 1e3 / calls)
    return out


def case(name: str, fn: Any, batches: list[np.ndarray], reps: int, calls: int) -> list[dict]:
    """Float and int8 rows for one model function."""
    x1 = batches[0][:1]
    rows = []
    t0 = time.perf_counter()
    float_tfl = qlitert.export(fn, x1, validate=False)
    float_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cal = qlitert.calibrate(fn, batches)
    int8_tfl = qlitert.export(qlitert.annotate(fn, cal), x1)
    int8_s = time.perf_counter() - t0
    for kind, tfl, secs in (("float32", float_tfl, float_s), ("int8", int8_tfl, int8_s)):
        times = latency_ms(tfl, x1, reps, calls)
        rows.append(
            {
                "model": name,
                "type": kind,
                "bytes": len(tfl),
                "convert_s": secs,
                "median_ms": statistics.median(times),
                "p10_ms": float(np.percentile(times, 10)),
                "p90_ms": float(np.percentile(times, 90)),
                "ops": qlitert.inspect(tfl).op_names(),
            }
        )
        print(
            f"  {name:10s} {kind:8s} {len(tfl):>10,d} B {rows[-1]['median_ms']:.4f} ms", flush=True
        )
    f, q = rows
    q["size_vs_float"] = q["bytes"] / f["bytes"]
    q["speedup_vs_float"] = f["median_ms"] / q["median_ms"]
    return rows


def table(rows: list[dict]) -> str:
    """Markdown table of the results."""
    lines = [
        "| model | type | file bytes | vs float | convert s | latency ms | p10–p90 | speed-up |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        size = f"{r['size_vs_float']:.3f}×" if "size_vs_float" in r else ""
        speed = f"{r['speedup_vs_float']:.2f}×" if "speedup_vs_float" in r else ""
        lines.append(
            f"| {r['model']} | {r['type']} | {r['bytes']:,} | {size} | {r['convert_s']:.2f} "
            f"| {r['median_ms']:.4f} | {r['p10_ms']:.4f}–{r['p90_ms']:.4f} | {speed} |"
        )
    return "\n".join(lines)


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the litert table of benchmarks/README.md."""
    m = data["machine"]
    body = "\n".join(
        [
            measured_on(m, f"qlitert {m['qlitert']}")
            + f" Median of {m['reps']} repetitions of {m['calls']} interpreter calls.",
            "",
            table(data["rows"]),
        ]
    )
    replace_section(path, "litert", body)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions (>= 5)")
    parser.add_argument("--calls", type=int, default=200, help="calls per repetition")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "litert.json")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error(f"--reps must be >= 5, got {args.reps}")
    from sklearn.datasets import load_digits  # noqa: PLC0415 - benchmark-only dependency

    info = run_info(args.reps, qlitert=qlitert.__version__, calls=args.calls)
    images = (load_digits().images[..., None] / 16.0).astype(np.float32)
    cnn = DigitsCNN()
    cnn_params = cnn.init(jax.random.key(0), images[:1])
    rng = np.random.default_rng(0)
    mlp = MLP()
    mlp_params = mlp.init(jax.random.key(1), np.zeros((1, 1024), np.float32))
    rows = case(
        "digits CNN",
        lambda x: cnn.apply(cnn_params, x),
        [images[i : i + 64] for i in range(0, 256, 64)],
        args.reps,
        args.calls,
    )
    rows += case(
        "MLP 4x1024",
        lambda x: mlp.apply(mlp_params, x),
        [rng.normal(size=(64, 1024)).astype(np.float32) for _ in range(4)],
        args.reps,
        args.calls,
    )
    print()
    print(table(rows))
    data = {"machine": info, "rows": rows}
    publish("litert", data, args.out, args.readme, update_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput of ``qflax.quantize_params`` on ~100 M parameters, against Qwix's.

The checkpoint is a Linen model of 24 ``nn.Dense(1024)`` layers on a 4096-wide
input: 24 float32 kernels of 4096 × 1024 (100.7 M parameters, 403 MB) and their
biases. Every kernel is quantized to int8 with one scale per output channel (the
biases stay float). "GB/s" is the float32 bytes of the kernels over the median
wall time of one whole ``quantize_params`` call, outputs ready
(``jax.block_until_ready``), after a warm-up call that compiles.

Rows, timed in rounds of one call each (so the slow drifts of a shared machine
hit every row alike):

* ``read only (max of abs)``: a jitted ``max |w|`` over each kernel's rows, which reads every
  float byte once and writes 4 KiB per kernel: the rate at which this machine's
  memory feeds XLA, a ceiling for anything that reads its input.
* ``one pass (cast to int8)``: a jitted ``w.astype(int8)`` per kernel: one read of
  the floats and one write of fresh int8 codes (first touch of new pages
  included), the least any quantizer that returns new codes must do.
* ``qflax``: ``qflax.quantize_params(params, abstract)`` as documented (eager; it
  runs one compiled function per kernel and dispatches them asynchronously).
* ``qflax, jitted``: the same call inside ``jax.jit``.
* ``Qwix`` / ``Qwix, jitted``: ``qwix.quantize_params`` 0.1.8 with the same rule,
  eager and inside ``jax.jit``.

The script also compares the codes: every row's with qflax's, and qflax's first
kernel with a float64 NumPy reference (see :func:`check`).

Run: ``nox -s bench`` (or ``python benchmarks/quantize_params.py --help``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from ops import load_qwix, measured_on, publish, replace_section, run_info

import qflax

HERE = Path(__file__).resolve().parent
LAYERS, IN, OUT = 24, 4096, 1024
TARGET_GBS = 20.0  # the main-job issue's target for this benchmark
FLOORS = ("read only (max of abs)", "one pass (cast to int8)")  # not quantizers


class Wide(nn.Module):
    """24 Dense(1024) layers side by side on one 4096-wide input."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return sum(nn.Dense(OUT, name=f"dense_{i}")(x) for i in range(LAYERS))


def abstract_params(qmodel: nn.Module) -> Any:
    """The quantized model's params as shapes (nothing is computed)."""
    return jax.eval_shape(qmodel.init, jax.random.key(0), jnp.ones((1, IN)))["params"]


def configs(params: Any, qwix: Any) -> dict[str, Callable[[], Any]]:
    """Name -> a call that quantizes (or, for the ceiling, reads) all of ``params``."""
    rule = qflax.QuantizationRule(weight_qtype="int8")
    ours = abstract_params(qflax.quantize_model(Wide(), qflax.PtqProvider([rule])))
    ours_jit = jax.jit(lambda p: qflax.quantize_params(p, ours))
    kernels = [params[f"dense_{i}"]["kernel"] for i in range(LAYERS)]
    read = jax.jit(lambda w: jnp.max(jnp.abs(w), axis=0))
    cast = jax.jit(lambda w: w.astype(jnp.int8))
    out: dict[str, Callable[[], Any]] = {
        "read only (max of abs)": lambda: [read(w) for w in kernels],
        "one pass (cast to int8)": lambda: [cast(w) for w in kernels],
        "qflax": lambda: qflax.quantize_params(params, ours),
        "qflax, jitted": lambda: ours_jit(params),
    }
    if qwix is not None:
        qrule = qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8)
        theirs = abstract_params(qwix.quantize_model(Wide(), qwix.PtqProvider([qrule])))
        theirs_jit = jax.jit(lambda p: qwix.quantize_params(p, theirs))
        out["Qwix"] = lambda: qwix.quantize_params(params, theirs)
        out["Qwix, jitted"] = lambda: theirs_jit(params)
    return out


def codes(result: Any, i: int) -> np.ndarray:
    """Layer ``i``'s int8 codes from a qflax or Qwix quantized tree."""
    kernel = result[f"dense_{i}"]["kernel"]
    qarray = kernel.qarray if hasattr(kernel, "qarray") else kernel.array
    return np.asarray(qarray.qvalue)


def check(calls: dict[str, Callable[[], Any]], params: Any) -> dict[str, str]:
    """How every quantizing row's codes compare with qflax's, and qflax's with NumPy's.

    The float64 NumPy reference is ``clip(round(w / s), -128, 127)`` with
    ``s = max|w| / 127.5`` (qcore's int8 bound). XLA computes ``w / s`` as
    ``w * (1 / s)`` (its algebraic simplifier rewrites division by a broadcast),
    so a code may differ by one where ``w / s`` lies within rounding error of a
    half-integer; the count and the largest difference are reported.
    """
    w = np.asarray(params["dense_0"]["kernel"], np.float64)
    scale = np.max(np.abs(w), axis=0) / 127.5
    reference = np.clip(np.round(w / scale), -128, 127)
    ours = calls["qflax"]()
    mine = [codes(ours, i) for i in range(LAYERS)]
    diff = np.abs(mine[0] - reference)
    agree = {
        "qflax vs float64 NumPy (layer 0)": f"{int(np.count_nonzero(diff)):,} of {diff.size:,} "
        f"codes differ, by at most {int(diff.max())}"
    }
    for name, call in calls.items():
        if name not in (*FLOORS, "qflax"):
            got = call()
            same = all(np.array_equal(codes(got, i), mine[i]) for i in range(LAYERS))
            agree[f"{name} vs qflax"] = "identical" if same else "DIFFERENT"
    return agree


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9, help="timed rounds (>= 5)")
    parser.add_argument("--no-qwix", action="store_true", help="skip the Qwix comparison")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "quantize_params.json")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error(f"--reps must be >= 5, got {args.reps}")
    qwix = load_qwix(args.no_qwix)
    info = run_info(args.reps, qwix=getattr(qwix, "__version__", None), qflax=qflax.__version__)
    init = jax.jit(lambda key: Wide().init(key, jnp.ones((1, IN)))["params"])
    params = jax.block_until_ready(init(jax.random.key(0)))
    kernel_bytes = sum(params[f"dense_{i}"]["kernel"].nbytes for i in range(LAYERS))
    calls = configs(params, qwix)
    agree = check(calls, params)  # also the warm-up (compiles every row)
    for what, how in agree.items():
        print(f"{what}: {how}")
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(args.reps):
        print(f"round {r + 1}/{args.reps}", flush=True)
        for name, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - t0)
    rows = []
    for name, ts in times.items():
        median = statistics.median(ts)
        rows.append(
            {
                "config": name,
                "median_ms": median * 1e3,
                "p10_ms": float(np.percentile(ts, 10)) * 1e3,
                "p90_ms": float(np.percentile(ts, 90)) * 1e3,
                "gb_per_s": kernel_bytes / median / 1e9,
            }
        )
    best_qwix = min((r["median_ms"] for r in rows if r["config"].startswith("Qwix")), default=None)
    for r in rows:
        r["speedup_vs_best_qwix"] = None if best_qwix is None else best_qwix / r["median_ms"]
    data = {
        "machine": info,
        "shapes": f"{LAYERS} x ({IN}, {OUT}) float32 kernels",
        "parameters": LAYERS * IN * OUT,
        "kernel_bytes": kernel_bytes,
        "codes_agree": agree,
        "target_gb_per_s": TARGET_GBS,
        "rows": rows,
    }
    print()
    print(table(data))
    publish("quantize_params", data, args.out, args.readme, update_readme)
    return 0


def table(data: dict[str, Any]) -> str:
    """Markdown table of the results."""
    lines = [
        "| config | median ms | p10–p90 ms | GB/s of float input | vs fastest Qwix |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        vs = "" if r["speedup_vs_best_qwix"] is None else f"{r['speedup_vs_best_qwix']:.2f}×"
        lines.append(
            f"| {r['config']} | {r['median_ms']:.1f} | {r['p10_ms']:.1f}–{r['p90_ms']:.1f} | "
            f"{r['gb_per_s']:.1f} | {vs} |"
        )
    return "\n".join(lines)


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the quantize_params table of benchmarks/README.md."""
    m = data["machine"]
    agree = "; ".join(f"{k}: {v}" for k, v in data["codes_agree"].items())
    body = "\n".join(
        [
            measured_on(m, f"qflax {m['qflax']}, Qwix {m['qwix']}")
            + f" {data['shapes']} ({data['parameters'] / 1e6:.1f} M parameters,"
            f" {data['kernel_bytes'] / 1e6:.0f} MB), per-channel int8; median of"
            f" {m['reps']} rounds of one call per config. Codes: {agree}.",
            "",
            table(data),
        ]
    )
    replace_section(path, "quantize_params", body)


if __name__ == "__main__":
    sys.exit(main())

"""A Flax model quantized with qflax against float and against Qwix's PTQ, on this CPU.

The model is four ``nn.Dense(4096)`` layers with relu between them (Linen, 4096
inputs, ~67 M parameters). Every configuration is the whole model under
``jax.jit``, timed for ``--reps`` calls after warm-up (median, p10, p90), at
batch 1 and batch 64, in one process, in rounds of one timed call per
configuration (so slow drifts of a shared machine hit every configuration alike),
each after untimed calls of the same configuration, at least three and for at least
100 ms (``ops.settled_call``); ratios compare rows measured in the same run.
"rel L2 err" is ``|y - y_fp32| / |y_fp32|`` on the same input. "params MiB" is
the sum of ``nbytes`` of the param leaves as stored: qflax's int4 codes are packed
two per byte in ``uint8``; Qwix keeps int4 codes in ``jnp.int4`` arrays, whose
``nbytes`` reports one byte per code (DESIGN.md: they appear to be stored packed in
host memory), so that row also gives the packed size in brackets.

Configurations (weights quantized ahead of time with one scale per output
channel, activations at call time):

* ``fp32`` / ``bf16``: the float model (bf16: ``dtype`` and ``param_dtype`` bf16).
* ``w8``: int8 weight-only. ``w8a8``: plus int8 activations, one scale per row.
* ``w4``: int4 weight-only.
* ``… (XLA path)``: with the optional ``qkernels`` package installed, the configs it
  serves (``w8`` and ``w4`` at batch 1, ``w8a8`` at batch 64 on a CPU without VNNI)
  run with it; these rows trace the same model with it bypassed.
* ``qwix …``: the same rules with Qwix 0.1.8 (``qwix.PtqProvider``,
  ``qwix.quantize_params``).

Run: ``nox -s bench`` (or ``python benchmarks/flax_ptq.py --help``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from ops import (
    SETTLE_MS,
    load_qwix,
    measured_on,
    publish,
    qkernels_version,
    replace_section,
    run_info,
    settled_call,
    time_call,
    xla_path,
)

import qflax

HERE = Path(__file__).resolve().parent
WIDTH, LAYERS, BATCHES = 4096, 4, (1, 64)


class Stack(nn.Module):
    """Four Dense(4096) layers with relu between them."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = nn.Dense(WIDTH, dtype=self.dtype, param_dtype=self.dtype)(x)
            if i < LAYERS - 1:
                x = nn.relu(x)
        return x


# Configs that call qkernels where it is installed: each gets a second row traced with
# it bypassed (qcore's pure-XLA path), so the two are compared in the same run.
NATIVE = ("w8", "w8a8", "w4")

RULES: dict[str, dict[str, Any]] = {
    "w8": {"weight_qtype": "int8"},
    "w8a8": {"weight_qtype": "int8", "act_qtype": "int8"},
    "w4": {"weight_qtype": "int4"},
}


def ours(
    name: str, params: Any, x: jax.Array, rule: dict[str, Any] | None = None
) -> tuple[Callable, Any]:
    """(jitted ``apply(x, params)``, quantized params) for a qflax config.

    ``rule``: the rule's arguments, for a config not in ``RULES``.
    """
    rule = RULES[name] if rule is None else rule
    qmodel = qflax.quantize_model(Stack(), qflax.PtqProvider([qflax.QuantizationRule(**rule)]))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
    return jax.jit(lambda x, p: qmodel.apply({"params": p}, x)), qflax.quantize_params(
        params, abstract
    )


def theirs(qwix: Any, name: str, params: Any, x: jax.Array) -> tuple[Callable, Any]:
    """(jitted apply, quantized params) for the same config in Qwix."""
    kw = {k: getattr(jnp, v) for k, v in RULES[name].items()}
    qmodel = qwix.quantize_model(Stack(), qwix.PtqProvider([qwix.QuantizationRule(**kw)]))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
    return jax.jit(lambda x, p: qmodel.apply({"params": p}, x)), qwix.quantize_params(
        params, abstract
    )


def param_bytes(params: Any) -> tuple[int, int]:
    """(sum of nbytes as stored, the same with jnp.int4 leaves counted at 4 bits)."""
    leaves = jax.tree.leaves(params)
    stored = sum(leaf.nbytes for leaf in leaves)
    packed = sum(leaf.size // 2 if leaf.dtype == jnp.int4 else leaf.nbytes for leaf in leaves)
    return int(stored), int(packed)


def round_robin(
    configs: dict[str, tuple[Callable, Any]],
    x: jax.Array,
    reps: int,
    warmup: int,
    untimed: int = 3,
) -> dict[str, list[float]]:
    """Milliseconds per call of every config, timed one call each per round.

    Interleaving the configs spreads the slow drifts of a shared machine over all
    of them, so the ratios of one run are fair even when its absolute times move.
    Each turn makes untimed calls first (at least ``untimed``, for at least 100 ms),
    so the timed call finds the model's code and data warm (as a server calling one
    model repeatedly does) and does not pay for what the previous configuration left
    behind: after a bf16 or Qwix call (100 ms or more on both cores) three untimed
    calls of the int8 model were not enough (``settle.py``).
    """
    for fn, p in configs.values():
        for _ in range(warmup):
            time_call(fn, x, p)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(reps):
        for name, (fn, p) in configs.items():
            times[name].append(settled_call(fn, x, p, untimed))
    return times


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="timed calls per config (>= 21)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-qwix", action="store_true", help="skip the Qwix comparison")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "flax_ptq.json")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args(argv)
    if args.reps < 21:
        parser.error(f"--reps must be >= 21, got {args.reps}")
    qwix = load_qwix(args.no_qwix)
    info = run_info(
        args.reps,
        qwix=getattr(qwix, "__version__", None),
        qflax=qflax.__version__,
        qkernels=qkernels_version(),
        settle_ms=SETTLE_MS,
    )
    probe = jnp.ones((1, WIDTH))
    params = Stack().init(jax.random.key(0), probe)["params"]
    configs: dict[str, tuple[Callable, Any]] = {
        "fp32": (jax.jit(lambda x, p: Stack().apply({"params": p}, x)), params),
        "bf16": (
            jax.jit(lambda x, p: Stack(jnp.bfloat16).apply({"params": p}, x)),
            jax.tree.map(lambda a: a.astype(jnp.bfloat16), params),
        ),
    }
    for name in RULES:
        configs[name] = ours(name, params, probe)
        if name in NATIVE and info["qkernels"] is not None:
            fn, p = ours(name, params, probe)
            configs[f"{name} (XLA path)"] = (xla_path(fn), p)
        if qwix is not None:
            configs[f"qwix {name}"] = theirs(qwix, name, params, probe)
    rows = []
    for batch in BATCHES:
        x = jax.random.normal(jax.random.key(batch), (batch, WIDTH))
        ref = np.asarray(configs["fp32"][0](x, params), np.float64)
        times = round_robin(configs, x, args.reps, args.warmup)
        for name, (fn, p) in configs.items():
            y = np.asarray(fn(x, p).astype(jnp.float32), np.float64)
            stored, packed = param_bytes(p)
            rows.append(
                {
                    "batch": batch,
                    "config": name,
                    "median_ms": statistics.median(times[name]),
                    "p10_ms": float(np.percentile(times[name], 10)),
                    "p90_ms": float(np.percentile(times[name], 90)),
                    "rel_l2_error": float(np.linalg.norm(y - ref) / np.linalg.norm(ref)),
                    "param_bytes": stored,
                    "param_bytes_packed": packed,
                }
            )
            print(f"  batch {batch:3d} {name:10s} {rows[-1]['median_ms']:9.3f} ms", flush=True)
    for r in rows:
        same = {q["config"]: q["median_ms"] for q in rows if q["batch"] == r["batch"]}
        r["speedup_vs_fp32"] = same["fp32"] / r["median_ms"]
        q = same.get(f"qwix {r['config']}")
        r["speedup_vs_qwix"] = None if q is None else q / r["median_ms"]
    data = {"machine": info, "rows": rows}
    print()
    print(table(rows))
    publish("flax_ptq", data, args.out, args.readme, update_readme)
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the results."""
    lines = [
        "| batch | config | median ms | p10–p90 ms | vs fp32 | vs Qwix | rel L2 err | params MiB |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        vs_q = "" if r["speedup_vs_qwix"] is None else f"{r['speedup_vs_qwix']:.2f}×"
        mib = f"{r['param_bytes'] / 2**20:,.1f}"
        if r["param_bytes_packed"] != r["param_bytes"]:
            mib += f" ({r['param_bytes_packed'] / 2**20:,.1f})"
        lines.append(
            f"| {r['batch']} | {r['config']} | {r['median_ms']:.2f} | "
            f"{r['p10_ms']:.2f}–{r['p90_ms']:.2f} | {r['speedup_vs_fp32']:.2f}× | {vs_q} | "
            f"{r['rel_l2_error']:.1e} | {mib} |"
        )
    return "\n".join(lines)


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the flax table of benchmarks/README.md."""
    m = data["machine"]
    body = "\n".join(
        [
            measured_on(m, f"qflax {m['qflax']}, qkernels {m['qkernels']}, Qwix {m['qwix']}")
            + f" Median of {m['reps']} warm calls of the jitted model, in rounds of one timed"
            " call per config, each after at least three untimed ones lasting at least"
            f" {m.get('settle_ms', 0):.0f} ms.",
            "",
            table(data["rows"]),
        ]
    )
    replace_section(path, "flax", body)


if __name__ == "__main__":
    sys.exit(main())

"""Decoding-shaped inference on this CPU: a chain of Flax Dense layers at small batches.

The model is ``--layers`` (default 6) ``nn.Dense(4096)`` layers with relu between
them (Linen; kernels stored ``(in, out)`` = ``(K, N)``, Flax's layout), the whole
model under ``jax.jit``, called with one row, as a decoder runs its projections for
one token. Every layer has its own weight: 6 × 16 MiB of int8 codes (96 MiB, three
times this machine's 32 MiB L3), so the weights come from memory on every call, as
in a model too big for the cache.

Configurations, each quantized with qflax's ``PtqProvider`` (one scale per output
channel unless stated):

* ``fp32``: the float model;
* ``w8`` / ``w4`` / ``nf4``: int8 / packed int4 / packed nf4 weight-only, traced
  twice: on qcore's pure-XLA path and with the optional ``qkernels`` package's native
  kernels, which compute the same values bit for bit (checked here on every run);
* ``w8a8``: int8 weights and int8 activations (one scale per row, quantized at call
  time), traced twice in the same way (qkernels' exact int8 sums; not on CPUs with
  VNNI, where qcore leaves w8a8 to XLA and the script prints that there is no row);
* ``w4 tiles 128`` / ``nf4 tiles 64``: int4 with one scale per 128 input rows, nf4
  with one per 64 (QLoRA's blocks), traced twice in the same way;
* ``qwix w8`` / ``qwix w8a8`` / ``qwix w4``: the same rules with Qwix 0.1.8's
  ``PtqProvider``.

Rounds call every configuration in turn; in each turn untimed calls come first, at
least ``--untimed`` (default 3) of them and for at least 100 ms, and the next call is
timed, so the timed call does not pay for what the previous configuration left
behind (after a 100 ms call, the next calls of a fast model ran up to twice their
steady time for about 30 ms: ``settle.py``). Medians and p10–p90 over
``--reps`` (≥ 21) rounds.

Limits printed beside each row: "bandwidth limit" is the bytes of the weights read
per call (codes and scales) over the memory read bandwidth measured in the same run
(a jitted sum of 256 MiB of float32); no computation that reads every weight once
can beat it.

``--batch`` (default 1) sets the activation rows per call: a small batch of tokens
decoded together (beams, speculative drafts). qkernels covers one row only, so
other batches have no ``(qkernels)`` rows; each batch has its own README section
(``decode``, ``decode-b4``, ...).

Run: ``nox -s bench`` (or ``python benchmarks/decode.py --help``).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from ops import (
    HERE,
    SETTLE_MS,
    load_qwix,
    measured_on,
    publish,
    qkernels_version,
    replace_section,
    run_info,
    settled_call,
)
from w8a8_layout import bandwidth_gbs

import qflax
from qcore.ops import kernels

WIDTH = 4096
RULES: dict[str, dict[str, Any]] = {
    "w8": {"weight_qtype": "int8"},
    "w8a8": {"weight_qtype": "int8", "act_qtype": "int8"},
    "w4": {"weight_qtype": "int4"},
    "w4 tiles 128": {"weight_qtype": "int4", "tile_size": 128},
    "nf4": {"weight_qtype": "nf4"},
    "nf4 tiles 64": {"weight_qtype": "nf4", "tile_size": 64},
}
NATIVE = ("w8", "w8a8", "w4", "w4 tiles 128", "nf4", "nf4 tiles 64")  # what qkernels covers
QWIX_RULES = {
    "w8": {"weight_qtype": jnp.int8},
    "w8a8": {"weight_qtype": jnp.int8, "act_qtype": jnp.int8},
    "w4": {"weight_qtype": jnp.int4},
}


class Chain(nn.Module):
    """``layers`` Dense(4096) layers with relu between them.

    The biases are random, not Flax's zeros: XLA fuses a bias add with the scale
    multiply before it, and the bitwise check of qkernels' rows must see that.
    """

    layers: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = nn.Dense(WIDTH, bias_init=nn.initializers.normal(0.1))(x)
            if i < self.layers - 1:
                x = nn.relu(x)
        return x


def _weight_bytes(params: Any) -> int:
    """Bytes of the kernels (codes and scales) a call reads; biases excluded."""
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if "bias" not in jax.tree_util.keystr(path):
            total += leaf.size // 2 if leaf.dtype == jnp.int4 else leaf.nbytes
    return int(total)


def configs(layers: int, qwix: Any, batch: int = 1) -> dict[str, tuple[Callable, Any]]:
    """name -> (compiled ``f(x, params)``, params); each traced with its own path.

    qkernels covers one activation row only, so with ``batch`` > 1 there are no
    ``(qkernels)`` rows.
    """
    model = Chain(layers)
    x = jnp.ones((batch, WIDTH), jnp.float32)
    params = model.init(jax.random.key(0), x)["params"]
    out: dict[str, tuple[Callable, Any]] = {
        "fp32": (jax.jit(lambda x, p: model.apply({"params": p}, x)), params)
    }
    for name, rule in RULES.items():
        qmodel = qflax.quantize_model(model, qflax.PtqProvider([qflax.QuantizationRule(**rule)]))
        abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
        qparams = qflax.quantize_params(params, abstract)
        for native in (False, True) if name in NATIVE and batch == 1 else (False,):
            with kernels.native_kernels(native):
                fn = jax.jit(lambda x, p, m=qmodel: m.apply({"params": p}, x))
                compiled = fn.lower(x, qparams).compile()
            label = f"{name} (qkernels)" if native else name
            if native and "qkernels_" not in compiled.as_text():
                print(f"qkernels not installed: no '{label}' row")
                continue
            out[label] = (compiled, qparams)
    if qwix is not None:
        for name, rule in QWIX_RULES.items():
            qmodel = qwix.quantize_model(model, qwix.PtqProvider([qwix.QuantizationRule(**rule)]))
            abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
            qparams = qwix.quantize_params(params, abstract)
            out[f"qwix {name}"] = (
                jax.jit(lambda x, p, m=qmodel: m.apply({"params": p}, x)),
                qparams,
            )
    return out


def run(layers: int, reps: int, untimed: int, qwix: Any, batch: int = 1) -> list[dict[str, Any]]:
    """One row per configuration: times, error against fp32, bytes."""
    cfgs = configs(layers, qwix, batch)
    x = jax.random.normal(jax.random.key(1), (batch, WIDTH), jnp.float32)
    outputs = {name: np.asarray(fn(x, p), np.float64) for name, (fn, p) in cfgs.items()}
    for name in NATIVE:
        native = f"{name} (qkernels)"
        if native in outputs and not np.array_equal(outputs[native], outputs[name]):
            raise SystemExit(f"{native} differs from the XLA path: not bit for bit")
    times: dict[str, list[float]] = {name: [] for name in cfgs}
    for _ in range(reps):
        for name, (fn, p) in cfgs.items():
            times[name].append(settled_call(fn, x, p, untimed))
    ref = outputs["fp32"]
    rows = []
    for name, (_, p) in cfgs.items():
        v = times[name]
        p10, p90 = np.percentile(v, [10, 90])
        rows.append(
            {
                "config": name,
                "median_ms": statistics.median(v),
                "p10_ms": float(p10),
                "p90_ms": float(p90),
                "rel_l2_err": float(np.linalg.norm(outputs[name] - ref) / np.linalg.norm(ref)),
                "weight_bytes": _weight_bytes(p),
            }
        )
        print(f"  {name:18s} {rows[-1]['median_ms']:8.3f} ms", flush=True)
    return rows


def table(data: dict[str, Any]) -> str:
    """Markdown table: time, ratios, bandwidth limit and error per configuration."""
    gbs = data["bandwidth_gbs"]
    rows = {r["config"]: r for r in data["rows"]}
    fp32 = rows["fp32"]["median_ms"]
    lines = [
        "| config | ms (p10–p90) | vs fp32 | vs Qwix | weight MiB | bandwidth limit ms "
        "| × limit | rel L2 err |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        base = name.split(" (")[0]
        qwix = rows.get(f"qwix {base}")
        vs_qwix = (
            f"{qwix['median_ms'] / r['median_ms']:.1f}×" if qwix and "qwix" not in name else ""
        )
        limit = r["weight_bytes"] / (gbs * 1e9) * 1e3
        lines.append(
            f"| {name} | {r['median_ms']:.2f} ({r['p10_ms']:.2f}–{r['p90_ms']:.2f}) "
            f"| {fp32 / r['median_ms']:.2f}× | {vs_qwix} | {r['weight_bytes'] / 2**20:.1f} "
            f"| {limit:.2f} | {r['median_ms'] / limit:.1f} | {r['rel_l2_err']:.1e} |"
        )
    return "\n".join(lines)


def section(batch: int) -> str:
    """The README section (and results file stem) of a run at ``batch`` rows."""
    return "decode" if batch == 1 else f"decode-b{batch}"


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the decode section (of the run's batch) of benchmarks/README.md."""
    m = data["machine"]
    body = (
        measured_on(m, f"qflax {m['qflax']}, qkernels {m['qkernels']}, Qwix {m['qwix']}")
        + f" {m['layers']} chained Dense(4096) layers at batch {m.get('batch', 1)}; {m['reps']}"
        " interleaved"
        f" rounds, each timed call after at least {m['untimed']} untimed ones lasting at least"
        f" {m.get('settle_ms', 0):.0f} ms; medians with p10–p90;"
        " memory"
        f" bandwidth {data['bandwidth_gbs']:.1f} GB/s measured in the same run.\n\n" + table(data)
    )
    replace_section(path, section(m.get("batch", 1)), body)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="timed rounds (>= 21)")
    parser.add_argument("--layers", type=int, default=6, help="Dense(4096) layers (>= 4)")
    parser.add_argument("--untimed", type=int, default=3, help="untimed calls before each timed")
    parser.add_argument("--no-qwix", action="store_true", help="skip the Qwix comparison")
    parser.add_argument("--batch", type=int, default=1, help="activation rows per call (>= 1)")
    parser.add_argument("--out", type=Path, help="results JSON (default results/SECTION.json)")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args(argv)
    if args.reps < 21:
        parser.error(f"--reps must be >= 21, got {args.reps}")
    if args.layers < 4:
        parser.error(f"--layers must be >= 4, got {args.layers}")
    if args.untimed < 1:
        parser.error(f"--untimed must be >= 1, got {args.untimed}")
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    name = section(args.batch)
    if args.readme and f"<!-- {name}:begin -->" not in (HERE / "README.md").read_text():
        parser.error(f"--batch {args.batch} with --readme: README.md has no '{name}' section")
    qwix = load_qwix(args.no_qwix)
    info = run_info(
        args.reps,
        layers=args.layers,
        batch=args.batch,
        untimed=args.untimed,
        settle_ms=SETTLE_MS,
        qflax=qflax.__version__,
        qkernels=qkernels_version(),
        qwix=getattr(qwix, "__version__", None),
    )
    gbs = bandwidth_gbs(args.reps)
    print(f"memory bandwidth {gbs:.1f} GB/s", flush=True)
    rows = run(args.layers, args.reps, args.untimed, qwix, args.batch)
    data = {"machine": info, "bandwidth_gbs": gbs, "rows": rows}
    print(table(data))
    out = args.out or HERE / "results" / f"{name.replace('-', '_')}.json"
    publish(name, data, out, args.readme, update_readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

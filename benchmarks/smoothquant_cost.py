"""What carried SmoothQuant scales cost in the compiled MiniLM encoder, from XLA itself.

``minilm.py`` times w8a8 with SmoothQuant (scales carried, qflax's default) about
130 ms per batch slower than plain w8a8 (1044 against 917 ms in its committed run).
This script shows where that goes without timing anything: it compiles both models
for one batch of 32 × 128 tokens and prints, per model, what XLA:CPU's compiled cost
analysis reports (floating-point operations and bytes accessed per call; qkernels'
custom calls are opaque to it, so with qkernels the products' operations are not
counted), how many fusions the program has, how many of them write int8 codes (each
one an activation quantized for a product), and the fusions that write a float32
tensor of the FFN's activation size (32 × 128 × 1536, 24 MiB: what is materialized
between the intermediate and the output Dense).

A carried scale makes each quantized Dense divide its input by ``s`` before the
per-token quantization. The query, key and value weights each carry their own
``s``, so their common input is quantized three times instead of once; and in the
FFN, XLA:CPU hands the quantization's row maximum to YNNPACK, which does not take
the division in, so the GELU output divided by ``s`` is materialized for it while
the quantizing fusion computes the GELU again. Folding the scales into the previous
op (``smoothquant(..., fold_into=...)``) removes the division, but in BERT's
post-LayerNorm blocks a LayerNorm's output also feeds the residual, so only the
attention output projection's scale could fold (into the value projection).

The numbers are deterministic for a given jax/XLA version and model (no timing).

Run: ``nox -s bench`` (or ``python benchmarks/smoothquant_cost.py --help``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import minilm
from minilm_model import load_params, load_tokenizer, tokenize
from ops import HERE, measured_on, publish, qkernels_version, replace_section, run_info

import qflax
from qcore.ops import kernels

FFN_F32 = "f32[32,128,1536]"


def compiled_cost(apply: Any, params: Any, ids: jax.Array, mask: jax.Array) -> dict[str, Any]:
    """XLA's cost analysis and fusion counts of ``apply`` compiled for this batch."""
    compiled = apply.lower(params, ids, mask).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    entry = compiled.as_text().split("ENTRY", 1)[1]
    fusions = re.findall(r"= (\S+?)(?:\{[^}]*\})? fusion\(", entry)
    return {
        "gflop": cost["flops"] / 1e9,
        "gb_accessed": cost["bytes accessed"] / 1e9,
        "fusions": len(fusions),
        "ffn_f32_fusions": sum(t == FFN_F32 for t in fusions),
        "int8_fusions": sum(t.startswith("s8[") for t in fusions),
    }


def main(argv: list[str] | None = None) -> int:
    """Compiles the two models and prints (and with ``--readme`` publishes) the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "smoothquant_cost.json")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    parser.add_argument("--quick", action="store_true", help="accepted for nox -s bench; no-op")
    args = parser.parse_args(argv)
    tok = load_tokenizer()
    params = jax.tree.map(jnp.asarray, load_params())
    pool = minilm.stdlib_sentences()
    ids, mask = (jnp.asarray(a) for a in tokenize(tok, pool[: minilm.BATCH]))
    cal_ids, cal_mask = tokenize(tok, pool[-minilm.CALIBRATION_SENTENCES :])
    minilm.CALIBRATION[:] = [
        (jnp.asarray(cal_ids[i : i + minilm.BATCH]), jnp.asarray(cal_mask[i : i + minilm.BATCH]))
        for i in range(0, len(cal_ids), minilm.BATCH)
    ]
    info = run_info(0, qflax=qflax.__version__, qkernels=qkernels_version())
    builds = {
        "w8a8": minilm.qflax_ptq(**minilm.RULES["w8a8"]),
        "w8a8 SmoothQuant (carried)": minilm.qflax_smoothquant(0.5),
    }
    rows = []
    for native in (False, True) if info["qkernels"] else (False,):
        for name, build in builds.items():
            with kernels.native_kernels(native):
                apply, qparams = build(params, ids, mask)
                row = compiled_cost(apply, qparams, ids, mask)
            rows.append({"config": name, "qkernels": native, **row})
            print(rows[-1], flush=True)
    data = {"machine": info, "rows": rows}
    publish("smoothquant_cost", data, args.out, args.readme, update_readme)
    print(table(data))
    return 0


def table(data: dict[str, Any]) -> str:
    """The README section: what the run is and the table."""
    m = data["machine"]
    lines = [
        measured_on(m, f"qflax {m['qflax']}, qkernels {m['qkernels']}")
        + " MiniLM encoder compiled for one batch of 32 × 128 tokens; XLA's compiled cost"
        " analysis per call (not a timing; qkernels' custom calls are not in its GFLOP).",
        "",
        "| config | path | GFLOP | GB accessed | fusions | int8-writing fusions "
        "| 24 MiB FFN f32 fusions |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        path = "qkernels" if r["qkernels"] else "XLA"
        lines.append(
            f"| {r['config']} | {path} | {r['gflop']:.2f} | {r['gb_accessed']:.2f} "
            f"| {r['fusions']} | {r['int8_fusions']} | {r['ffn_f32_fusions']} |"
        )
    return "\n".join(lines)


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the smoothquant-cost section of benchmarks/README.md."""
    replace_section(path, "smoothquant-cost", table(data))


if __name__ == "__main__":
    raise SystemExit(main())

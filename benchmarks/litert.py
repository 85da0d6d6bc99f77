"""LiteRT export: float vs qlitert's vs ai-edge-quantizer's quantized ``.tflite``, one run.

Each model is one entry of ``CASES`` (a builder returning a :class:`Case`: the float
JAX function, its calibration batches and held-out inputs, each a tuple of arrays,
one per input of the function):

* ``digits CNN``: conv 8 -> conv 16 -> max pool -> dense, 8x8x1 inputs (the qlitert
  tests' CNN), trained 300 Adam steps on scikit-learn's digits.
* ``MLP 4x1024``: four Dense(1024) layers with relu between them, random weights,
  random normal inputs (no classifier: top-1 agreement is not reported).
* ``MobileNetV2-style``: ``MobileNetV2`` of ``packages/qlitert/tests/archs.py`` (13
  inverted residual blocks, 40 convolutions, batch norm, ReLU6, residual adds,
  global average pooling) on 64x64x3 inputs: the digits, upsampled with
  ``jax.image.resize`` (bilinear) and repeated over 3 channels. Trained
  ``MOBILENET_STEPS`` Adam steps at batch 16 with every batch norm normalizing by
  its batch's statistics (``batch_norm_in_training_mode``: the model builds them in
  inference mode); then their inference statistics are set to the mean and variance
  of their inputs over the first 256 training images, and the model is exported with
  batch norm in inference mode. ``trained_batch_norms`` is not used: with its fixed
  random statistics, 120 steps (Adam, 1e-2) left the model at chance (0.10).
* ``encoder 2x``: two pre-norm transformer encoder blocks around Flax's
  ``nn.MultiHeadDotProductAttention`` (4 heads, width 64, gelu MLP of 128), then a
  LayerNorm, on 16 tokens; random weights, random normal inputs (no classifier).
* ``MiniLM-L6``: all-MiniLM-L6-v2 with its real weights (``minilm_model.py``: BERT
  encoder, mean pooling, L2 normalisation), ``fn(ids, mask)`` on 128 int32 token ids
  and their 0/1 mask, returning the (1, 384) unit sentence embedding. Its sentences
  are ``minilm.py``'s: first sentences of the standard library's docstrings
  (``minilm.stdlib_sentences()``), permuted with ``minilm.SEED``; the first
  ``MINILM_HELDOUT`` of the permutation (sorted; the 512 that ``minilm.py``
  evaluates) are held out, the next ``MINILM_CALIBRATION`` calibrate (none of them
  held out). Tokenized to 128 tokens (padded, truncated). Its attention mask is an
  additive bias of ``jnp.finfo(float32).min`` on padded keys: ai-edge-quantizer
  0.10.0's static recipes give that tensor a scale of about 4e-12 (int8) or 3e-14
  (int16), so padded keys are no longer masked, which their rows show (qlitert
  makes the add a select). qlitert's int8 file keeps the root module (the mean
  pooling, whose division by the token count has no int8 kernel, and the L2
  normalisation) float: ``Case.rules``.

* ``conv 1x1``, ``depthwise 3x3``, ``Dense``: single layers (``Layer``) of
  ``LAYER_CHANNELS`` outputs on random weights and inputs (a 32x32x256 image; 128
  rows of 256 features, the Dense 4x wider), 4 calibration batches of 8, 16 held
  out; ``Case.macs`` gives their multiply-accumulates, and ``layer_lines`` their
  rate per file at 1 thread: what the models' int8 latency is made of.

Digits: scikit-learn's ``load_digits`` (1,797 images, nothing downloaded), shuffled
with seed 0; the first 1,297 train, the last 500 are held out. Calibration: the
first 256 training inputs, in 4 batches of 64 for ``qlitert.calibrate`` and one
by one (the ``.tflite`` files take batch 1) for ai-edge-quantizer; the random-input
models (MLP, encoder) calibrate on 4 batches of 64 random inputs the same way,
MiniLM-L6 on its 64 calibration sentences in 4 batches of 16.

Files per model (each a kind, one row of the table):

* ``float32``: the float file every tool starts from, the all-float export through
  qlitert's interpreter: ``qlitert.export(qlitert.annotate(fn, cal), *example,
  validate=False)`` with ``cal`` from ``qlitert.calibrate`` under one
  ``Rule(act_qtype=None, weight_qtype=None)`` (``strict=False``). It writes the
  composites LiteRT has kernels for (MiniLM's exact GELU becomes one ``GELU``, where
  ``qlitert.export(fn, validate=False)`` expands erf), and it is the float model
  ``qlitert.export_dynamic_range`` starts from, so the peer quantizes the same float
  model our dynamic export does.
* ``int8 qlitert``: full int8 (``qlitert.calibrate`` with its default rules, strict,
  then ``annotate`` and ``export``, validated layer by layer); an export that fails
  is a row with its error.
* ``dynamic qlitert`` (``Case.dynamic``: MLP, encoder, MiniLM):
  ``qlitert.export_dynamic_range(fn, *example)``: int8 weights (per output channel)
  and embedding tables, float activations, LiteRT's hybrid kernels; no calibration.
* With ``--peer DIR``, Google's ai-edge-quantizer applied to the same float file by
  ``litert_peer.py`` in its own venv (``nox -s litert_peer``), with the same
  calibration inputs one by one: ``int8 ai-edge-quantizer`` (recipe
  ``static_wi8_ai8``: int8 weights and activations, min/max calibration),
  ``dynamic ai-edge-quantizer`` (``dynamic_wi8_afp32``, for the models with
  ``Case.dynamic``) and ``16x8 ai-edge-quantizer`` (``static_wi8_ai16``: int16
  activations, int8 weights; ``Case.int16``: the encoder and MiniLM).

Latency: LiteRT's interpreter (``ai_edge_litert``, XNNPACK delegate: its default) at
batch 1 with 1 and with 2 threads, one interpreter per file and thread count.
One call is ``set_tensor`` of every input + ``invoke`` + ``get_tensor`` of every
output, on the model's own input types: float for ours (whose graph quantizes its
input), integer codes for the peer's static files (whose float inputs and outputs
are int8 or int16: quantized once, untimed), int32 token ids as they are. ``--reps``
rounds (>= 21) visit every file of a model in turn (starting with a different one
each round), each timing ``calls`` calls after warm-up (as many as make a float
round last ``--round-ms``); median and p10-p90 of the per-call times; ratios are to
the float file of the same run.

Accuracy: each ``.tflite`` file on the held-out inputs (one by one, batch 1) against
the float JAX model: the relative L2 error of all outputs,
``||y - y_jax|| / ||y_jax||``; ``cosine``, the mean over the outputs' rows (their last
axis: a digit's 10 logits, a token's 64 features, a sentence's embedding) of the
cosine between the file's row and JAX's; for the classifiers, top-1 agreement; for
MiniLM-L6, neighbour agreement: the fraction of held-out sentences whose nearest
other held-out sentence by cosine (``minilm.nearest_other``) is the same among the
file's embeddings as among the float JAX ones. ``targets()`` checks issue 21's
targets with this run's numbers.

Run: ``nox -s bench`` (export, peer, measurement), or by hand::

    python benchmarks/litert.py --export-for-peer DIR   # builds, writes DIR
    <peer venv>/python benchmarks/litert_peer.py DIR    # ai-edge-quantizer
    python benchmarks/litert.py --peer DIR --readme     # measures every file

Without ``--peer``, the float and qlitert files are measured and the peer's size
and accuracy are shown from ``fixtures/litert_peer.json`` (no latency).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from minilm import SEED, nearest_other, stdlib_sentences
from minilm_model import MiniLM, load_params, load_tokenizer, tokenize
from ops import measured_on, publish, replace_section, run_info

import qlitert
from qcore.files import write_atomic
from qlitert.export import INTEGER_TYPES

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "packages" / "qlitert" / "tests"))
from archs import MobileNetV2  # noqa: E402 - the tests' model code

FLOAT, OURS, OURS_DYNAMIC = "float32", "int8 qlitert", "dynamic qlitert"
PEER, PEER_DYNAMIC, PEER_16X8 = (
    "int8 ai-edge-quantizer",
    "dynamic ai-edge-quantizer",
    "16x8 ai-edge-quantizer",
)
# The ai-edge-quantizer recipe (a function of its ``recipe`` module) behind each peer kind.
PEER_RECIPES = {
    PEER: "static_wi8_ai8",
    PEER_DYNAMIC: "dynamic_wi8_afp32",
    PEER_16X8: "static_wi8_ai16",
}
# Row order within a model: each of our kinds next to the peer's of the same kind.
KINDS = [FLOAT, OURS, PEER, OURS_DYNAMIC, PEER_DYNAMIC, PEER_16X8]
PEER_FIXTURE = HERE / "fixtures" / "litert_peer.json"
TRAIN, CAL_BATCHES, CAL_BATCH = 1297, 4, 64
MOBILENET_SIZE, MOBILENET_STEPS = 64, 100
ENCODER_BLOCKS, ENCODER_TOKENS, ENCODER_WIDTH = 2, 16, 64
MINILM_TOKENS, MINILM_HELDOUT, MINILM_CALIBRATION, MINILM_CAL_BATCH = 128, 512, 64, 16
REFERENCE_BATCH = 64  # the float JAX model's held-out outputs are computed in these batches
# The single layers: channels, image side of the convolutions, rows of the Dense.
LAYER_CHANNELS, LAYER_SIDE, LAYER_ROWS = 256, 32, 128

Inputs = tuple[np.ndarray, ...]  # one array per input of the function


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


class Layer(nn.Module):
    """One layer of ``LAYER_CHANNELS`` outputs: ``kind`` is "conv" (1x1), "depthwise"
    (3x3) or "dense" (4x wider)."""

    kind: str

    @nn.compact
    def __call__(self, x):
        if self.kind == "conv":
            return nn.Conv(LAYER_CHANNELS, (1, 1))(x)
        if self.kind == "depthwise":
            return nn.Conv(LAYER_CHANNELS, (3, 3), feature_group_count=LAYER_CHANNELS)(x)
        return nn.Dense(4 * LAYER_CHANNELS)(x)


class EncoderBlock(nn.Module):
    """A pre-norm transformer encoder block around Flax's own attention module."""

    heads: int = 4
    hidden: int = 128

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h)
        h = nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(self.hidden)(nn.LayerNorm()(x))))
        return x + h


class Encoder(nn.Module):
    """``ENCODER_BLOCKS`` encoder blocks over ``(batch, tokens, width)`` embeddings."""

    @nn.compact
    def __call__(self, x):
        for _ in range(ENCODER_BLOCKS):
            x = EncoderBlock()(x)
        return nn.LayerNorm()(x)


@dataclass
class Case:
    """One model of the table: what is exported, calibrated on and evaluated on."""

    fn: Callable[..., Any]
    calibration: list[Inputs]  # batches; their samples also calibrate the peer
    heldout: Inputs
    # How the outputs' rows are compared beyond rel L2 and cosine: "top-1" (argmax,
    # classifiers), "neighbour" (nearest other held-out row, embeddings) or None.
    agreement: str | None
    shapes: str
    dynamic: bool = False  # also the dynamic-range files (ours and the peer's)
    rules: Any = None  # qlitert's rules for its int8 file (None: every op int8)
    int16: bool = False  # also the peer's 16x8 file
    macs: int = 0  # multiply-accumulates per call (the single layers)

    def kinds(self) -> list[str]:
        """The rows of this model, in table order."""
        return [
            k
            for k in KINDS
            if (k not in (OURS_DYNAMIC, PEER_DYNAMIC) or self.dynamic)
            and (k != PEER_16X8 or self.int16)
        ]


@dataclass
class Digits:
    """scikit-learn's digits in [0, 1], NHWC, shuffled once and split."""

    images: np.ndarray
    labels: np.ndarray

    @staticmethod
    def load() -> Digits:
        from sklearn.datasets import load_digits  # noqa: PLC0415 - benchmark-only dependency

        d = load_digits()
        order = np.random.default_rng(0).permutation(len(d.target))
        images = (d.images[order, :, :, None] / 16.0).astype(np.float32)
        return Digits(images, d.target[order].astype(np.int32))

    def case(self, fn: Any, images: np.ndarray, shapes: str) -> Case:
        cal = [(images[i * CAL_BATCH : (i + 1) * CAL_BATCH],) for i in range(CAL_BATCHES)]
        return Case(fn, cal, (images[TRAIN:],), "top-1", shapes)


def batch_norm_in_training_mode(record: dict | None = None) -> Any:
    """An interceptor normalizing every nn.BatchNorm's input by its batch's statistics.

    The tests' model builds its batch norms with ``use_running_average=True``; this
    makes them train as batch norms do, and with ``record`` stores each one's input
    mean and variance (by module path), to be its inference statistics.
    """

    def interceptor(next_fun, args, kwargs, context):
        bn = context.module
        if not (isinstance(bn, nn.BatchNorm) and context.method_name == "__call__"):
            return next_fun(*args, **kwargs)
        x = args[0]
        mean, var = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))
        if record is not None:
            record[bn.path] = (mean, var)
        p = bn.variables["params"]
        return (x - mean) * jax.lax.rsqrt(var + bn.epsilon) * p["scale"] + p["bias"]

    return nn.intercept_methods(interceptor)


def train(
    model: nn.Module,
    variables: Any,
    x: np.ndarray,
    y: np.ndarray,
    steps: int,
    batch: int,
    lr: float,
) -> Any:
    """``variables`` with their "params" trained by Adam on (x, y).

    Batch norms (if any) run on batch statistics while training; their inference
    statistics are then those of the first 256 training inputs.
    """
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"}
    opt = optax.adam(lr)

    @jax.jit
    def step(params, state, xb, yb):
        def loss(p):
            with batch_norm_in_training_mode():
                logits = model.apply({"params": p, **rest}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state = opt.init(params)
    rng = np.random.default_rng(1)
    value = None
    for _ in range(steps):
        idx = rng.integers(0, len(x), batch)
        params, state, value = step(params, state, x[idx], y[idx])
    print(f"    trained {steps} steps, last batch loss {float(value):.3f}", flush=True)
    if "batch_stats" not in rest:
        return {"params": params, **rest}
    record: dict = {}
    with batch_norm_in_training_mode(record):
        model.apply({"params": params, **rest}, x[:256])
    stats = jax.tree.map(np.asarray, rest["batch_stats"])
    for path, (mean, var) in record.items():
        node = stats
        for key in path:
            node = node[key]
        node["mean"], node["var"] = np.asarray(mean), np.asarray(var)
    return {"params": params, **rest, "batch_stats": stats}


def accuracy_of(fn: Any, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of the float JAX model (printed, to show the training worked)."""
    return float(np.mean(np.asarray(jax.jit(fn)(x)).argmax(-1) == y))


def digits_cnn(digits: Digits) -> Case:
    model = DigitsCNN()
    x, y = digits.images, digits.labels
    variables = model.init(jax.random.key(0), x[:1])
    variables = train(model, variables, x[:TRAIN], y[:TRAIN], 300, 64, 1e-2)

    def fn(v):
        return model.apply(variables, v)

    print(f"    held-out accuracy {accuracy_of(fn, x[TRAIN:], y[TRAIN:]):.3f}")
    return digits.case(fn, x, "8×8×1 → 10")


def mlp(_: Digits) -> Case:
    model = MLP()
    variables = model.init(jax.random.key(1), np.zeros((1, 1024), np.float32))
    rng = np.random.default_rng(0)
    cal = [(rng.normal(size=(CAL_BATCH, 1024)).astype(np.float32),) for _ in range(CAL_BATCHES)]
    heldout = (rng.normal(size=(256, 1024)).astype(np.float32),)
    return Case(lambda v: model.apply(variables, v), cal, heldout, None, "1024 → 1024", True)


def mobilenet(digits: Digits) -> Case:
    size = MOBILENET_SIZE
    resized = jax.image.resize(digits.images, (len(digits.images), size, size, 1), "bilinear")
    x = np.repeat(np.asarray(resized, np.float32), 3, axis=-1)
    y = digits.labels
    model = MobileNetV2()
    variables = model.init(jax.random.key(0), x[:1])
    variables = train(model, variables, x[:TRAIN], y[:TRAIN], MOBILENET_STEPS, 16, 3e-3)

    def fn(v):
        return model.apply(variables, v)

    print(f"    held-out accuracy {accuracy_of(fn, x[TRAIN:], y[TRAIN:]):.3f}")
    return digits.case(fn, x, f"{size}×{size}×3 → 10")


def encoder(_: Digits) -> Case:
    model = Encoder()
    shape = (ENCODER_TOKENS, ENCODER_WIDTH)
    variables = model.init(jax.random.key(2), np.zeros((1, *shape), np.float32))
    rng = np.random.default_rng(2)
    cal = [(rng.normal(size=(CAL_BATCH, *shape)).astype(np.float32),) for _ in range(CAL_BATCHES)]
    heldout = (rng.normal(size=(128, *shape)).astype(np.float32),)
    shapes = f"{ENCODER_TOKENS}×{ENCODER_WIDTH} → {ENCODER_TOKENS}×{ENCODER_WIDTH}"

    def fn(v):
        return model.apply(variables, v)

    return Case(fn, cal, heldout, None, shapes, dynamic=True, int16=True)


def minilm(_: Digits) -> Case:
    """all-MiniLM-L6-v2 on minilm.py's held-out sentences, calibrated on 64 others."""
    pool = stdlib_sentences()
    order = np.random.default_rng(SEED).permutation(len(pool))
    heldout = [pool[i] for i in sorted(order[:MINILM_HELDOUT])]
    cal = [pool[i] for i in sorted(order[MINILM_HELDOUT : MINILM_HELDOUT + MINILM_CALIBRATION])]
    tok = load_tokenizer(MINILM_TOKENS)
    ids, mask = tokenize(tok, heldout)
    cal_ids, cal_mask = tokenize(tok, cal)
    batches = [
        (cal_ids[i : i + MINILM_CAL_BATCH], cal_mask[i : i + MINILM_CAL_BATCH])
        for i in range(0, len(cal_ids), MINILM_CAL_BATCH)
    ]
    print(
        f"    {len(heldout)} held-out and {len(cal)} calibration sentences of {len(pool)}; "
        f"{int(mask[:, -1].sum())} held-out ones truncated at {MINILM_TOKENS} tokens",
        flush=True,
    )
    params = jax.tree.map(jnp.asarray, load_params())
    model = MiniLM()

    def fn(i, m):
        return model.apply({"params": params}, i, m)

    shapes = f"{MINILM_TOKENS} tokens → 384"
    # The mean pooling divides by the token count (LiteRT has no int8 DIV): pooling
    # and normalisation, the ops of the root module, stay float.
    rules = [qlitert.Rule(module_path="", act_qtype=None, weight_qtype=None), qlitert.Rule()]
    return Case(
        fn, batches, (ids, mask), "neighbour", shapes, dynamic=True, int16=True, rules=rules
    )


def layer(kind: str, shape: tuple[int, ...], macs: int) -> Callable[[Digits], Case]:
    """A single-layer case: random weights, 4 calibration batches of 8, 16 held out."""

    def build(_: Digits) -> Case:
        model = Layer(kind)
        variables = model.init(jax.random.key(3), np.zeros((1, *shape), np.float32))
        rng = np.random.default_rng(3)
        cal = [(rng.normal(size=(8, *shape)).astype(np.float32),) for _ in range(CAL_BATCHES)]
        heldout = (rng.normal(size=(16, *shape)).astype(np.float32),)
        out = (*shape[:-1], 4 * LAYER_CHANNELS if kind == "dense" else LAYER_CHANNELS)
        shapes = f"{'×'.join(map(str, shape))} → {'×'.join(map(str, out))}"

        def fn(v):
            return model.apply(variables, v)

        return Case(fn, cal, heldout, None, shapes, macs=macs)

    return build


_C, _S, _R = LAYER_CHANNELS, LAYER_SIDE, LAYER_ROWS

# name -> builder. A model is one entry here (and one row group of the table).
CASES: dict[str, Callable[[Digits], Case]] = {
    "digits CNN": digits_cnn,
    "MLP 4x1024": mlp,
    "MobileNetV2-style": mobilenet,
    "encoder 2x": encoder,
    "MiniLM-L6": minilm,
    "conv 1x1": layer("conv", (_S, _S, _C), _S * _S * _C * _C),
    "depthwise 3x3": layer("depthwise", (_S, _S, _C), _S * _S * _C * 9),
    "Dense": layer("dense", (_R, _C), _R * _C * 4 * _C),
}
LAYERS = ("conv 1x1", "depthwise 3x3", "Dense")


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower())


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)


def float_export(fn: Callable[..., Any], example: Inputs) -> bytes:
    """The float ``.tflite`` every tool starts from: all ops float, through qlitert's interpreter.

    As ``qlitert.export_dynamic_range`` makes its float model: LiteRT's composite
    kernels (GELU, ...) where a plain ``qlitert.export(fn)`` would expand them.
    """
    rule = qlitert.Rule(act_qtype=None, weight_qtype=None)
    floats = qlitert.calibrate(fn, [example], rules=[rule], strict=False)
    return qlitert.export(qlitert.annotate(fn, floats), *example, validate=False)


def int8_export(
    fn: Callable[..., Any], calibration: list[Inputs], example: Inputs, rules: Any = None
) -> bytes:
    """qlitert's int8 file: calibrated (``rules``, default every op int8; strict),
    annotated, validated."""
    cal = qlitert.calibrate(fn, calibration, rules=rules)
    return qlitert.export(qlitert.annotate(fn, cal), *example)


def _export(entry: dict, kind: str, out: Path, name: str, make: Callable[[], bytes]) -> None:
    """Writes ``make()`` to ``out/name`` as ``kind``'s file, or records its error."""
    t0 = time.perf_counter()
    try:
        tflite = make()
    except Exception as err:  # noqa: BLE001 - recorded in the table, not hidden
        entry["errors"][kind] = f"{type(err).__name__}: {err}"
        print(f"    {kind} export failed: {entry['errors'][kind]}", flush=True)
        return
    entry["convert_s"][kind] = time.perf_counter() - t0
    _write(out / name, tflite)
    entry["files"][kind] = name
    print(f"    {kind}: {len(tflite):,} B in {entry['convert_s'][kind]:.1f} s", flush=True)


def reference_outputs(fn: Callable[..., Any], inputs: Inputs) -> np.ndarray:
    """The float JAX model's outputs on ``inputs`` (in batches of ``REFERENCE_BATCH``)."""
    jitted = jax.jit(fn)
    return np.concatenate(
        [
            np.asarray(jitted(*(a[i : i + REFERENCE_BATCH] for a in inputs)), np.float32)
            for i in range(0, len(inputs[0]), REFERENCE_BATCH)
        ]
    )


def build(names: list[str], out: Path) -> None:
    """Builds every case; writes its files, inputs and JAX outputs to out."""
    digits = Digits.load()
    for stale in (*out.glob("*.peer*.tflite"), out / "peer.json"):  # a previous peer run's
        stale.unlink(missing_ok=True)
    manifest = []
    for name in names:
        print(f"  {name}", flush=True)
        case = CASES[name](digits)
        s = slug(name)
        example = tuple(a[:1] for a in case.calibration[0])
        kinds = case.kinds()
        entry: dict[str, Any] = {
            "name": name,
            "slug": s,
            "shapes": case.shapes,
            "agreement": case.agreement,
            "kinds": kinds,
            "peer_recipes": [PEER_RECIPES[k] for k in kinds if k in PEER_RECIPES],
            "files": {},
            "convert_s": {},
            "errors": {},
            "macs": case.macs,
        }
        t0 = time.perf_counter()
        float_tfl = float_export(case.fn, example)
        entry["convert_s"][FLOAT] = time.perf_counter() - t0
        _write(out / f"{s}.float.tflite", float_tfl)
        entry["files"][FLOAT] = f"{s}.float.tflite"
        print(f"    {FLOAT}: {len(float_tfl):,} B", flush=True)

        int8 = partial(int8_export, case.fn, case.calibration, example, case.rules)
        _export(entry, OURS, out, f"{s}.qlitert.tflite", int8)
        if OURS_DYNAMIC in kinds:
            dynamic = partial(qlitert.export_dynamic_range, case.fn, *example)
            _export(entry, OURS_DYNAMIC, out, f"{s}.dynamic.tflite", dynamic)
        inputs = range(len(example))
        calibration = {f"x{k}": np.concatenate([b[k] for b in case.calibration]) for k in inputs}
        heldout = {f"x{k}": case.heldout[k] for k in inputs}
        reference = reference_outputs(case.fn, case.heldout)
        _write(out / f"{s}.calibration.npz", _npz(**calibration))
        _write(out / f"{s}.heldout.npz", _npz(**heldout, reference=reference))
        entry["calibration"] = f"{s}.calibration.npz"
        manifest.append(entry)
    _write(out / "manifest.json", json.dumps({"models": manifest}, indent=1).encode())
    print(f"wrote {out}", flush=True)


def _npz(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _signature_inputs(it: Any, xs: Inputs) -> list[tuple[dict, np.ndarray]]:
    """``(input detail, array)`` pairs: ``xs[k]`` goes to the signature input ``x<k>``."""
    details = it.get_signature_runner().get_input_details()
    if sorted(details) != sorted(f"x{k}" for k in range(len(xs))):
        raise ValueError(f"signature inputs {sorted(details)}, {len(xs)} arrays")
    return [(details[f"x{k}"], x) for k, x in enumerate(xs)]


def timed_calls(tflite: bytes, xs: Inputs, threads: int) -> Callable[[int], float]:
    """A function timing ``n`` calls of ``tflite`` on ``xs`` (ms per call)."""
    from ai_edge_litert.interpreter import Interpreter  # noqa: PLC0415 - heavy import

    it = Interpreter(model_content=tflite, num_threads=threads)  # XNNPACK: the default
    it.allocate_tensors()
    feeds = []
    for detail, x in _signature_inputs(it, xs):
        dtype = np.dtype(detail["dtype"])
        if dtype.kind == "i" and x.dtype.kind == "f":  # integer codes: quantized once, untimed
            scale, zero = detail["quantization"]
            info = np.iinfo(dtype)
            x = np.clip(np.round(x / scale) + zero, info.min, info.max).astype(dtype)
        feeds.append((detail["index"], x))  # token ids (int32) go as they are
    outs = [d["index"] for d in it.get_output_details()]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            for index, x in feeds:
                it.set_tensor(index, x)
            it.invoke()
            for index in outs:
                it.get_tensor(index)
        return (time.perf_counter() - t0) * 1e3 / n

    run(10)
    return run


def latency(files: dict[str, bytes], xs: Inputs, threads: int, reps: int, round_ms: float):
    """Interleaved rounds over ``files``: {type: {median_ms, p10_ms, p90_ms}}, calls."""
    runs = {kind: timed_calls(tfl, xs, threads) for kind, tfl in files.items()}
    float_ms = statistics.median(runs[FLOAT](20) for _ in range(5))
    calls = max(1, math.ceil(round_ms / float_ms))
    kinds = list(runs)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(reps):
        for i in range(len(kinds)):  # each round starts with the next file
            kind = kinds[(r + i) % len(kinds)]
            times[kind].append(runs[kind](calls))
    return {
        k: {
            "median_ms": statistics.median(t),
            "p10_ms": float(np.percentile(t, 10)),
            "p90_ms": float(np.percentile(t, 90)),
        }
        for k, t in times.items()
    }, calls


def row_cosines(y: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Cosine between each row (last axis) of ``y`` and the same row of ``ref``."""
    a, b = y.reshape(-1, y.shape[-1]), ref.reshape(-1, ref.shape[-1])
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def accuracy(tflite: bytes, xs: Inputs, reference: np.ndarray, agreement: str | None) -> dict:
    """The file's outputs on the held-out inputs (batch 1) against the float JAX model's."""
    from ai_edge_litert.interpreter import Interpreter  # noqa: PLC0415 - heavy import

    model = qlitert.LiteRTModel(tflite, num_threads=2)
    # LiteRTModel takes its inputs in the order of the interpreter's input details.
    pairs = _signature_inputs(Interpreter(model_content=tflite), xs)
    order = {int(d["index"]): x for d, x in pairs}
    xs = tuple(order[int(d["index"])] for d in model.inputs)
    y = np.concatenate([model(*(x[i : i + 1] for x in xs)) for i in range(len(xs[0]))])
    y, ref = y.astype(np.float64), reference.astype(np.float64)
    cos = row_cosines(y, ref)
    out: dict[str, Any] = {
        "rel_l2": float(np.linalg.norm(y - ref) / np.linalg.norm(ref)),
        "cosine": float(np.mean(cos)),
        "min_cosine": float(np.min(cos)),
        "top1_agreement": None,
        "neighbour_agreement": None,
    }
    if agreement == "top-1":
        out["top1_agreement"] = float(np.mean(y.argmax(-1) == ref.argmax(-1)))
    elif agreement == "neighbour":
        out["neighbour_agreement"] = float(np.mean(nearest_other(y) == nearest_other(ref)))
    return out


def measure(
    root: Path, reps: int, round_ms: float, peer: bool, threads: tuple[int, ...] = (1, 2)
) -> tuple[list[dict], dict]:
    """Rows of the table from the files in root (with the peer's when ``peer``)."""
    manifest = json.loads((root / "manifest.json").read_text())["models"]
    peer_info: dict[str, Any] = {}
    if peer:
        peer_info = json.loads((root / "peer.json").read_text())
    rows: list[dict] = []
    for entry in manifest:
        name = entry["name"]
        kinds = [k for k in entry["kinds"] if peer or k not in PEER_RECIPES]
        files = {k: (root / f).read_bytes() for k, f in entry["files"].items()}
        errors = dict(entry["errors"])
        convert = dict(entry["convert_s"])
        quantized = peer_info.get("models", {}).get(entry["slug"], {})
        for kind in (k for k in kinds if k in PEER_RECIPES):
            p = quantized.get(PEER_RECIPES[kind], {"error": "not quantized by the peer"})
            if "error" in p:
                errors[kind] = p["error"]
            else:
                files[kind] = (root / p["file"]).read_bytes()
                convert[kind] = p["quantize_s"]
        files = {k: files[k] for k in kinds if k in files}  # table order
        with np.load(root / f"{entry['slug']}.heldout.npz") as held:
            xs = tuple(held[f"x{k}"] for k in range(len(held.files) - 1))
            reference = held["reference"]
        print(f"  {name}: {', '.join(files)}", flush=True)
        lat = {}
        for n in threads:
            lat[n], calls = latency(files, tuple(x[:1] for x in xs), n, reps, round_ms)
            lat[n]["calls"] = calls
        for kind in kinds:
            row: dict[str, Any] = {"model": name, "shapes": entry["shapes"], "type": kind}
            if entry.get("macs"):
                row["macs"] = entry["macs"]
            if kind in PEER_RECIPES:
                row["recipe"] = PEER_RECIPES[kind]
            if kind not in files:
                row["error"] = errors.get(kind, "missing")
                rows.append(row)
                continue
            tfl = files[kind]
            report = qlitert.inspect(tfl)
            # Ops that compute in float: every op with a FLOAT32 operand, a float input's
            # QUANTIZE and an output's DEQUANTIZE aside.
            float_ops = qlitert.check_kernels(report, (*INTEGER_TYPES, "INT16"))
            row |= {
                "bytes": len(tfl),
                "size_vs_float": len(tfl) / len(files[FLOAT]),
                "convert_s": convert.get(kind),
                "latency": {
                    str(n): lat[n][kind]
                    | {"vs_float": lat[n][kind]["median_ms"] / lat[n][FLOAT]["median_ms"]}
                    | {"calls_per_round": lat[n]["calls"]}
                    for n in threads
                },
                **accuracy(tfl, xs, reference, entry["agreement"]),
                "ops": sorted(set(report.op_names())),
                "float_compute_ops": len(float_ops),
                "float_compute_first": float_ops[:1],
            }
            rows.append(row)
            one, two = row["latency"]["1"], row["latency"]["2"]
            print(
                f"    {kind:26s} {len(tfl):>11,d} B  1t {one['median_ms']:.4f} ms "
                f"({one['vs_float']:.2f}×)  2t {two['median_ms']:.4f} ms "
                f"({two['vs_float']:.2f}×)  cos {row['cosine']:.5f}  rel L2 {row['rel_l2']:.4f}",
                flush=True,
            )
    return rows, peer_info


def fixture_rows(rows: list[dict]) -> list[dict]:
    """The peer's rows from the committed fixture (size and accuracy; no latency)."""
    if not PEER_FIXTURE.exists():
        return []
    fixture = json.loads(PEER_FIXTURE.read_text())
    out = []
    for name in dict.fromkeys(r["model"] for r in rows):
        for recipe, f in fixture["models"].get(name, {}).items():
            out.append({"model": name, "recipe": recipe, "from_fixture": True} | f)
    return out


def _ms(lat: dict | None) -> tuple[str, str]:
    if lat is None:
        return "—", "—"
    return (
        f"{lat['median_ms']:.4f} ({lat['p10_ms']:.4f}–{lat['p90_ms']:.4f})",
        f"{lat['vs_float']:.2f}×",
    )


def _fraction(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def table(rows: list[dict]) -> str:
    """Markdown table of the results."""
    lines = [
        "| model | file | bytes | vs float | 1 thread ms (p10–p90) | vs float "
        "| 2 threads ms (p10–p90) | vs float | top-1 agree | neighbour agree | cosine "
        "| rel L2 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        label = f"{r['model']} ({r['shapes']})" if "shapes" in r else r["model"]
        kind = r["type"] + (" (fixture)" if r.get("from_fixture") else "")
        if "error" in r:
            err = r["error"].splitlines()[0].replace("|", "\\|")
            lines.append(f"| {label} | {kind} | no file: {err} | | | | | | | | | |")
            continue
        lat = r.get("latency", {})
        one, one_vs = _ms(lat.get("1"))
        two, two_vs = _ms(lat.get("2"))
        size = "" if r["type"] == FLOAT else f"{r['size_vs_float']:.3f}×"
        if r["type"] == FLOAT:
            one_vs = two_vs = ""
        lines.append(
            f"| {label} | {kind} | {r['bytes']:,} | {size} | {one} | {one_vs} | {two} "
            f"| {two_vs} | {_fraction(r['top1_agreement'])} "
            f"| {_fraction(r['neighbour_agreement'])} | {r['cosine']:.5f} | {r['rel_l2']:.4f} |"
        )
    return "\n".join(lines)


def _row(rows: list[dict], model: str, kind: str) -> dict | None:
    return next((r for r in rows if r["model"] == model and r["type"] == kind), None)


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _latency_target(row: dict, limit: float) -> str:
    """``latency ≤ limit× float: met (1 and 2 threads)`` for a measured row."""
    if "latency" not in row:
        return f"latency ≤ {limit:g}× float: not measured (fixture row)"
    one, two = (row["latency"][n]["vs_float"] for n in ("1", "2"))
    return (
        f"latency ≤ {limit:g}× float: {_met(max(one, two) <= limit)} "
        f"({one:.2f}× with 1 thread, {two:.2f}× with 2)"
    )


def _numbers(row: dict | None) -> str:
    """A row's accuracy, size and latency in a few words (for the peer beside ours)."""
    if row is None:
        return "not run"
    if "error" in row:
        return f"no file ({row['error'].splitlines()[0][:120]})"
    words = [f"cosine {row['cosine']:.5f}"]
    if row.get("neighbour_agreement") is not None:
        words.append(f"neighbour agreement {row['neighbour_agreement']:.3f}")
    words.append(f"{row['size_vs_float']:.3f}× the float file")
    if "latency" in row:
        one, two = (row["latency"][n]["vs_float"] for n in ("1", "2"))
        words.append(f"{one:.2f}×/{two:.2f}× float latency (1/2 threads)")
    return ", ".join(words)


def _peer_beside(rows: list[dict], model: str) -> str:
    peers = [r for r in rows if r["model"] == model and r["type"] in PEER_RECIPES]
    return "; ".join(f"{r['type']}: {_numbers(r)}" for r in peers)


def transformer_targets(rows: list[dict]) -> list[str]:
    """Issue 21's targets for the encoder and MiniLM-L6, each qlitert kind on its own."""
    out = []
    for kind in (OURS, OURS_DYNAMIC):
        row = _row(rows, "encoder 2x", kind)
        if row is None:
            continue
        if "error" in row:
            out.append(f"encoder 2x, {kind}: no file, every target **not met** ({row['error']}).")
            continue
        if kind == OURS:
            n = row["float_compute_ops"]
            ops = f"no float compute op: {_met(n == 0)}" + (f" ({n} ops)" if n else "")
        else:
            ops = f"float activations by design ({row['float_compute_ops']} float ops)"
        out.append(
            f"encoder 2x, {kind}: {ops}; cosine ≥ 0.999 vs float: "
            f"{_met(row['cosine'] >= 0.999)} ({row['cosine']:.5f}); {_latency_target(row, 0.8)}."
        )
    if any(r["model"] == "encoder 2x" for r in rows):
        out.append(f"encoder 2x, the peer beside: {_peer_beside(rows, 'encoder 2x')}.")
    for kind in (OURS, OURS_DYNAMIC):
        row = _row(rows, "MiniLM-L6", kind)
        if row is None:
            continue
        if "error" in row:
            err = row["error"].splitlines()[0]
            out.append(f"MiniLM-L6, {kind}: no file, every target **not met** ({err}).")
            continue
        cos, nn_ = row["cosine"], row["neighbour_agreement"]
        out.append(
            f"MiniLM-L6, {kind}: mean cosine ≥ 0.99: {_met(cos >= 0.99)} ({cos:.5f}); "
            f"top-1 neighbour agreement ≥ 0.90: {_met(nn_ >= 0.90)} ({nn_:.3f}); file ≤ 0.30× "
            f"float: {_met(row['size_vs_float'] <= 0.30)} ({row['size_vs_float']:.3f}×); "
            f"{_latency_target(row, 0.8)}."
        )
    if any(r["model"] == "MiniLM-L6" for r in rows):
        out.append(f"MiniLM-L6, the peer beside: {_peer_beside(rows, 'MiniLM-L6')}.")
    return out


def targets(rows: list[dict]) -> list[str]:
    """Issue 21's targets, each stated met or not with the numbers of this run."""
    out = []
    ours, peer = _row(rows, "MobileNetV2-style", OURS), _row(rows, "MobileNetV2-style", PEER)
    if ours is not None and "error" in ours:
        out.append("MobileNetV2-style: no qlitert file, no target can be checked.")
    elif ours is not None:
        if peer is not None and "error" not in peer:
            a, b = ours["top1_agreement"], peer["top1_agreement"]
            out.append(
                f"MobileNetV2-style top-1 agreement with float ≥ the peer's static int8: "
                f"{_met(a >= b)} ({a:.3f} vs {b:.3f})."
            )
        out.append(f"MobileNetV2-style int8 {_latency_target(ours, 0.6)}.")
    out += transformer_targets(rows)
    mlp_row = _row(rows, "MLP 4x1024", OURS)
    if mlp_row is not None and "error" not in mlp_row:
        one, two = (1 / mlp_row["latency"][n]["vs_float"] for n in ("1", "2"))
        out.append(
            f"MLP 4x1024 int8 ≥ 3× faster than float: {_met(min(one, two) >= 3)} "
            f"({one:.2f}× with 1 thread, {two:.2f}× with 2)."
        )
    return out


def layer_lines(rows: list[dict]) -> list[str]:
    """Each single layer's arithmetic rate per file at 1 thread (MACs / median time)."""
    out = []
    for name in LAYERS:
        rates = [
            f"{r['type']} {r['macs'] / r['latency']['1']['median_ms'] / 1e6:.1f}"
            for r in rows
            if r["model"] == name and "latency" in r and r.get("macs")
        ]
        if rates:
            (first,) = {r["shapes"] for r in rows if r["model"] == name}
            out.append(f"{name} ({first}): {', '.join(rates)} GMAC/s.")
    return out


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the litert table of benchmarks/README.md."""
    m = data["machine"]
    versions = f"qlitert {m['qlitert']}, ai-edge-litert {m['ai_edge_litert']}"
    peer = data.get("peer_versions")
    if peer:
        versions += (
            f"; peer: ai-edge-quantizer {peer['ai-edge-quantizer']} (its own venv: "
            f"ai-edge-litert {peer['ai-edge-litert']}, Python {peer['python']})"
        )
    recipes = ", ".join(f"{kind}: `{recipe}`" for kind, recipe in PEER_RECIPES.items())
    lines = [
        measured_on(m, versions)
        + f" {m['reps']} interleaved rounds per model and thread count; each round times"
        f" every file over the same number of calls (≥ {m['round_ms']:g} ms of float calls)."
        f" The machine is shared: 1-minute load average {m['load_average_before']:.1f} at"
        f" the start of the run, {m['load_average_after']:.1f} after.",
        "",
        "Every file is made from the float one (qlitert's all-float export); the peer's"
        f" recipes: {recipes}. Accuracy against the float JAX model on held-out inputs at"
        " batch 1 (500 digits; 256 and 128 random inputs for the MLP and the encoder; 512"
        " stdlib docstring sentences for MiniLM-L6, calibrated on 64 others): *cosine* is"
        " the mean over output rows (last axis) of the cosine with"
        " JAX's row; *top-1 agree* compares the classifiers' argmax; *neighbour agree* is"
        " the fraction of sentences whose nearest other held-out sentence is the same as"
        " with the float JAX embeddings.",
        "",
        table(data["rows"]),
        "",
        "Targets (issue 21):",
        "",
        *(f"* {t}" for t in targets(data["rows"])),
        "",
        "Single layers, 1 thread, multiply-accumulates per second (batch 1):",
        "",
        *(f"* {t}" for t in layer_lines(data["rows"])),
    ]
    replace_section(path, "litert", "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="interleaved rounds (>= 21)")
    parser.add_argument("--round-ms", type=float, default=100.0, help="float ms per round")
    parser.add_argument("--models", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "litert.json")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--export-for-peer", type=Path, metavar="DIR", help="build, write DIR")
    mode.add_argument("--peer", type=Path, metavar="DIR", help="measure the files in DIR")
    args = parser.parse_args(argv)
    if args.reps < 21:
        parser.error(f"--reps must be >= 21, got {args.reps}")
    if args.export_for_peer is not None:
        build(args.models, args.export_for_peer)
        return 0
    from ai_edge_litert import __version__ as litert_version  # noqa: PLC0415

    info = run_info(args.reps, qlitert=qlitert.__version__, ai_edge_litert=litert_version) | {
        "round_ms": args.round_ms,
        "load_average_before": os.getloadavg()[0],
    }
    if args.peer is not None:
        rows, peer_info = measure(args.peer, args.reps, args.round_ms, peer=True)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            build(args.models, Path(tmp))
            rows, peer_info = measure(Path(tmp), args.reps, args.round_ms, peer=False)
        rows += fixture_rows(rows)
        rows.sort(key=lambda r: (list(CASES).index(r["model"]), KINDS.index(r["type"])))
    info["load_average_after"] = os.getloadavg()[0]
    print()
    print(table(rows))
    print()
    print("\n".join(targets(rows)))
    print("\n".join(layer_lines(rows)))
    data: dict[str, Any] = {"machine": info, "rows": rows, "peer_recipes": PEER_RECIPES}
    if peer_info:
        data["peer_versions"] = peer_info["versions"]
    else:
        data["peer_from_fixture"] = str(PEER_FIXTURE.relative_to(HERE))
    publish("litert", data, args.out, args.readme, update_readme)
    if args.readme and peer_info:
        write_fixture(rows, peer_info, info["date"])
    return 0


def write_fixture(rows: list[dict], peer_info: dict, date: str) -> None:
    """The peer's size and accuracy per model and recipe, with its versions."""
    keys = (
        "type",
        "shapes",
        "bytes",
        "size_vs_float",
        "convert_s",
        "top1_agreement",
        "neighbour_agreement",
        "cosine",
        "rel_l2",
        "error",
    )
    models: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["type"] in PEER_RECIPES:
            models.setdefault(r["model"], {})[r["recipe"]] = {k: r[k] for k in keys if k in r}
    fixture = {
        "about": "ai-edge-quantizer's recipes on the float .tflite files of "
        "benchmarks/litert.py (same calibration inputs as qlitert), measured by "
        "litert.py --peer; accuracy against the float JAX model on the held-out inputs. "
        "models: model -> recipe -> its row (or the error of its quantization).",
        "date": date,
        "versions": peer_info["versions"],
        "models": models,
    }
    _write(PEER_FIXTURE, (json.dumps(fixture, indent=1) + "\n").encode())
    print(f"wrote {PEER_FIXTURE}")


if __name__ == "__main__":
    sys.exit(main())

"""LiteRT export: float vs qlitert's int8 vs ai-edge-quantizer's int8 ``.tflite``, one run.

Each model is one entry of ``CASES`` (a builder returning a :class:`Case`: the float
JAX function, its calibration batches and held-out inputs):

* ``digits CNN``: conv 8 -> conv 16 -> max pool -> dense, 8x8x1 inputs (the qlitert
  tests' CNN), trained 300 Adam steps on scikit-learn's digits.
* ``MLP 4x1024``: four Dense(1024) layers with relu between them, random weights,
  random normal inputs (no classifier: top-1 agreement is not reported).
* ``encoder 2x``: two pre-norm transformer encoder blocks around Flax's
  ``nn.MultiHeadDotProductAttention`` (4 heads, width 64, gelu MLP of 128), then a
  LayerNorm, on 16 tokens; random weights, random normal inputs (no classifier).
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

Digits: scikit-learn's ``load_digits`` (1,797 images, nothing downloaded), shuffled
with seed 0; the first 1,297 train, the last 500 are held out. Calibration: the
first 256 training inputs, in 4 batches of 64 for ``qlitert.calibrate`` and one
by one (the ``.tflite`` files take batch 1) for ai-edge-quantizer.

Files per model: the float ``.tflite`` (``qlitert.export(fn, validate=False)``),
qlitert's full-int8 one (calibrated, annotated, exported and validated layer by
layer) and, with ``--peer DIR``, Google's ai-edge-quantizer's ``static_wi8_ai8``
(int8 weights, int8 activations, min/max calibration) applied to the same float
file with the same calibration inputs, by ``litert_peer.py`` in its own venv
(``nox -s litert_peer``).

Latency: LiteRT's interpreter (``ai_edge_litert``, XNNPACK delegate: its default) at
batch 1 with 1 and with 2 threads, one interpreter per file and thread count.
One call is ``set_tensor`` + ``invoke`` + ``get_tensor`` on the model's own input
type (float for ours, whose graph quantizes its input; int8 codes for the peer's,
whose inputs and outputs are int8). ``--reps`` rounds (>= 21) visit every file of
a model in turn (starting with a different one each round), each timing ``calls``
calls after warm-up (as many as make a float round last ``--round-ms``); median and
p10-p90 of the per-call times; ratios are to the float file of the same run.

Accuracy: each ``.tflite`` file on the held-out inputs (one by one, batch 1) against
the float JAX model: top-1 agreement (classifiers) and the relative L2 error of
all outputs, ``||y - y_jax|| / ||y_jax||``.

Run: ``nox -s bench`` (export, peer, measurement), or by hand::

    python benchmarks/litert.py --export-for-peer DIR   # builds, writes DIR
    <peer venv>/python benchmarks/litert_peer.py DIR    # ai-edge-quantizer
    python benchmarks/litert.py --peer DIR --readme     # measures all three

Without ``--peer``, the float and qlitert files are measured and the peer's size
and accuracy are shown from ``fixtures/litert_peer.json`` (no latency).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from ops import measured_on, publish, replace_section, run_info

import qlitert
from qcore.files import write_atomic

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "packages" / "qlitert" / "tests"))
from archs import MobileNetV2  # noqa: E402 - the tests' model code

FLOAT, OURS, PEER = "float32", "int8 qlitert", "int8 ai-edge-quantizer"
PEER_FIXTURE = HERE / "fixtures" / "litert_peer.json"
TRAIN, CAL_BATCHES, CAL_BATCH = 1297, 4, 64
MOBILENET_SIZE, MOBILENET_STEPS = 64, 100
ENCODER_BLOCKS, ENCODER_TOKENS, ENCODER_WIDTH = 2, 16, 64


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

    fn: Callable[[Any], Any]
    calibration: list[np.ndarray]  # batches; their samples also calibrate the peer
    heldout: np.ndarray
    classifier: bool
    shapes: str


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
        cal = [images[i * CAL_BATCH : (i + 1) * CAL_BATCH] for i in range(CAL_BATCHES)]
        return Case(fn, cal, images[TRAIN:], True, shapes)


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
    cal = [rng.normal(size=(CAL_BATCH, 1024)).astype(np.float32) for _ in range(CAL_BATCHES)]
    heldout = rng.normal(size=(256, 1024)).astype(np.float32)
    return Case(lambda v: model.apply(variables, v), cal, heldout, False, "1024 → 1024")


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
    cal = [rng.normal(size=(CAL_BATCH, *shape)).astype(np.float32) for _ in range(CAL_BATCHES)]
    heldout = rng.normal(size=(128, *shape)).astype(np.float32)
    shapes = f"{ENCODER_TOKENS}×{ENCODER_WIDTH} → {ENCODER_TOKENS}×{ENCODER_WIDTH}"
    return Case(lambda v: model.apply(variables, v), cal, heldout, False, shapes)


# name -> builder. A model is one entry here (and one row group of the table).
# Not yet here: MiniLM (benchmarks/minilm_model.py; its token ids and mask are
# two inputs, and the cases take one).
CASES: dict[str, Callable[[Digits], Case]] = {
    "digits CNN": digits_cnn,
    "MLP 4x1024": mlp,
    "MobileNetV2-style": mobilenet,
    "encoder 2x": encoder,
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower())


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)


def build(names: list[str], out: Path) -> None:
    """Builds every case; writes its float and qlitert files, inputs and JAX outputs to out."""
    digits = Digits.load()
    for stale in (*out.glob("*.peer.tflite"), out / "peer.json"):  # a previous peer run's
        stale.unlink(missing_ok=True)
    manifest = []
    for name in names:
        print(f"  {name}", flush=True)
        case = CASES[name](digits)
        s = slug(name)
        example = case.calibration[0][:1]
        entry: dict[str, Any] = {
            "name": name,
            "slug": s,
            "shapes": case.shapes,
            "classifier": case.classifier,
            "files": {},
            "convert_s": {},
            "errors": {},
        }
        t0 = time.perf_counter()
        float_tfl = qlitert.export(case.fn, example, validate=False)
        entry["convert_s"][FLOAT] = time.perf_counter() - t0
        _write(out / f"{s}.float.tflite", float_tfl)
        entry["files"][FLOAT] = f"{s}.float.tflite"
        t0 = time.perf_counter()
        try:
            cal = qlitert.calibrate(case.fn, case.calibration)
            ours = qlitert.export(qlitert.annotate(case.fn, cal), example)
        except Exception as err:  # noqa: BLE001 - recorded in the table, not hidden
            entry["errors"][OURS] = f"{type(err).__name__}: {err}"
            print(f"    qlitert export failed: {entry['errors'][OURS]}", flush=True)
        else:
            entry["convert_s"][OURS] = time.perf_counter() - t0
            _write(out / f"{s}.qlitert.tflite", ours)
            entry["files"][OURS] = f"{s}.qlitert.tflite"
        calibration = np.concatenate(case.calibration)
        reference = np.asarray(jax.jit(case.fn)(case.heldout), np.float32)
        buf = _npz(x0=calibration)
        _write(out / f"{s}.calibration.npz", buf)
        _write(out / f"{s}.heldout.npz", _npz(x0=case.heldout, reference=reference))
        entry["calibration"] = f"{s}.calibration.npz"
        manifest.append(entry)
    _write(out / "manifest.json", json.dumps({"models": manifest}, indent=1).encode())
    print(f"wrote {out}", flush=True)


def _npz(**arrays: np.ndarray) -> bytes:
    import io  # noqa: PLC0415

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def timed_calls(tflite: bytes, x: np.ndarray, threads: int) -> Callable[[int], float]:
    """A function timing ``n`` calls of ``tflite`` on ``x`` (ms per call)."""
    from ai_edge_litert.interpreter import Interpreter  # noqa: PLC0415 - heavy import

    it = Interpreter(model_content=tflite, num_threads=threads)  # XNNPACK: the default
    it.allocate_tensors()
    (detail,) = it.get_input_details()
    (out,) = it.get_output_details()
    if np.dtype(detail["dtype"]).kind == "i":  # int8 inputs: quantize once, untimed
        scale, zero = detail["quantization"]
        info = np.iinfo(detail["dtype"])
        x = np.clip(np.round(x / scale) + zero, info.min, info.max).astype(detail["dtype"])
    index, out_index = detail["index"], out["index"]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            it.set_tensor(index, x)
            it.invoke()
            it.get_tensor(out_index)
        return (time.perf_counter() - t0) * 1e3 / n

    run(10)
    return run


def latency(files: dict[str, bytes], x: np.ndarray, threads: int, reps: int, round_ms: float):
    """Interleaved rounds over ``files``: {type: {median_ms, p10_ms, p90_ms}}, calls."""
    runs = {kind: timed_calls(tfl, x, threads) for kind, tfl in files.items()}
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


def accuracy(tflite: bytes, x: np.ndarray, reference: np.ndarray, classifier: bool) -> dict:
    """The file's outputs on the held-out inputs (batch 1) against the float JAX model's."""
    model = qlitert.LiteRTModel(tflite, num_threads=2)
    y = np.concatenate([model(x[i : i + 1]) for i in range(len(x))]).astype(np.float64)
    ref = reference.astype(np.float64)
    out: dict[str, Any] = {"rel_l2": float(np.linalg.norm(y - ref) / np.linalg.norm(ref))}
    out["top1_agreement"] = float(np.mean(y.argmax(-1) == ref.argmax(-1))) if classifier else None
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
        files = {k: (root / f).read_bytes() for k, f in entry["files"].items()}
        errors = dict(entry["errors"])
        convert = dict(entry["convert_s"])
        if peer:
            p = peer_info["models"].get(entry["slug"], {"error": "not quantized by the peer"})
            if "error" in p:
                errors[PEER] = p["error"]
            else:
                files[PEER] = (root / p["file"]).read_bytes()
                convert[PEER] = p["quantize_s"]
        held = np.load(root / f"{entry['slug']}.heldout.npz")
        x, reference = held["x0"], held["reference"]
        print(f"  {name}: {', '.join(files)}", flush=True)
        lat = {}
        for n in threads:
            lat[n], calls = latency(files, x[:1], n, reps, round_ms)
            lat[n]["calls"] = calls
        kinds = [FLOAT, OURS, *([PEER] if peer else [])]
        for kind in kinds:
            row: dict[str, Any] = {"model": name, "shapes": entry["shapes"], "type": kind}
            if kind not in files:
                row["error"] = errors.get(kind, "missing")
                rows.append(row)
                continue
            tfl = files[kind]
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
                **accuracy(tfl, x, reference, entry["classifier"]),
                "ops": sorted(set(qlitert.inspect(tfl).op_names())),
            }
            rows.append(row)
            one, two = row["latency"]["1"], row["latency"]["2"]
            print(
                f"    {kind:24s} {len(tfl):>10,d} B  1t {one['median_ms']:.4f} ms "
                f"({one['vs_float']:.2f}×)  2t {two['median_ms']:.4f} ms "
                f"({two['vs_float']:.2f}×)  rel L2 {row['rel_l2']:.4f}",
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
        f = fixture["models"].get(name)
        if f is not None:
            out.append({"model": name, "type": PEER, "from_fixture": True} | f)
    return out


def _ms(lat: dict | None) -> tuple[str, str]:
    if lat is None:
        return "—", "—"
    return (
        f"{lat['median_ms']:.4f} ({lat['p10_ms']:.4f}–{lat['p90_ms']:.4f})",
        f"{lat['vs_float']:.2f}×",
    )


def table(rows: list[dict]) -> str:
    """Markdown table of the results."""
    lines = [
        "| model | file | bytes | vs float | 1 thread ms (p10–p90) | vs float "
        "| 2 threads ms (p10–p90) | vs float | top-1 agree | rel L2 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        label = f"{r['model']} ({r['shapes']})" if "shapes" in r else r["model"]
        kind = r["type"] + (" (fixture)" if r.get("from_fixture") else "")
        if "error" in r:
            err = r["error"].splitlines()[0].replace("|", "\\|")
            lines.append(f"| {label} | {kind} | export failed: {err} | | | | | | | |")
            continue
        lat = r.get("latency", {})
        one, one_vs = _ms(lat.get("1"))
        two, two_vs = _ms(lat.get("2"))
        top1 = "—" if r["top1_agreement"] is None else f"{r['top1_agreement']:.3f}"
        size = "" if r["type"] == FLOAT else f"{r['size_vs_float']:.3f}×"
        if r["type"] == FLOAT:
            one_vs = two_vs = ""
        lines.append(
            f"| {label} | {kind} | {r['bytes']:,} | {size} | {one} | {one_vs} | {two} "
            f"| {two_vs} | {top1} | {r['rel_l2']:.4f} |"
        )
    return "\n".join(lines)


def _row(rows: list[dict], model: str, kind: str) -> dict | None:
    return next((r for r in rows if r["model"] == model and r["type"] == kind), None)


def targets(rows: list[dict]) -> list[str]:
    """Issue 21's targets, each stated met or not with the numbers of this run."""
    out = []
    ours, peer = _row(rows, "MobileNetV2-style", OURS), _row(rows, "MobileNetV2-style", PEER)
    if ours is not None and "error" in ours:
        out.append("MobileNetV2-style: no qlitert file, no target can be checked.")
    elif ours is not None:
        if peer is not None and "error" not in peer:
            a, b = ours["top1_agreement"], peer["top1_agreement"]
            met = "met" if a >= b else "**not met**"
            out.append(
                f"MobileNetV2-style top-1 agreement with float ≥ the peer's: {met} "
                f"({a:.3f} vs {b:.3f})."
            )
        one, two = ours["latency"]["1"]["vs_float"], ours["latency"]["2"]["vs_float"]
        met = "met" if max(one, two) <= 0.6 else "**not met**"
        out.append(
            f"MobileNetV2-style int8 latency ≤ 0.6× float: {met} ({one:.2f}× with 1 thread, "
            f"{two:.2f}× with 2)."
        )
    mlp_row = _row(rows, "MLP 4x1024", OURS)
    if mlp_row is not None and "error" not in mlp_row:
        one, two = (1 / mlp_row["latency"][n]["vs_float"] for n in ("1", "2"))
        met = "met" if min(one, two) >= 3 else "**not met**"
        out.append(
            f"MLP 4x1024 int8 ≥ 3× faster than float: {met} ({one:.2f}× with 1 thread, "
            f"{two:.2f}× with 2)."
        )
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
    lines = [
        measured_on(m, versions)
        + f" {m['reps']} interleaved rounds per model and thread count; each round times"
        f" every file over the same number of calls (≥ {m['round_ms']:g} ms of float calls)."
        f" The machine is shared: 1-minute load average {m['load_average_before']:.1f} at"
        f" the start of the run, {m['load_average_after']:.1f} after.",
        "",
        table(data["rows"]),
        "",
        "Targets (issue 21):",
        "",
        *(f"* {t}" for t in targets(data["rows"])),
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
        rows.sort(key=lambda r: list(CASES).index(r["model"]))
    info["load_average_after"] = os.getloadavg()[0]
    print()
    print(table(rows))
    print()
    print("\n".join(targets(rows)))
    data: dict[str, Any] = {"machine": info, "rows": rows}
    if peer_info:
        data["peer_versions"] = peer_info["versions"]
        data["peer_recipe"] = peer_info["recipe"]
    else:
        data["peer_from_fixture"] = str(PEER_FIXTURE.relative_to(HERE))
    publish("litert", data, args.out, args.readme, update_readme)
    if args.readme and peer_info:
        write_fixture(rows, peer_info, info["date"])
    return 0


def write_fixture(rows: list[dict], peer_info: dict, date: str) -> None:
    """The peer's size and accuracy, with its versions, for runs without the peer."""
    keys = ("shapes", "bytes", "size_vs_float", "convert_s", "top1_agreement", "rel_l2")
    models = {
        r["model"]: {k: r[k] for k in keys} for r in rows if r["type"] == PEER and "error" not in r
    }
    fixture = {
        "about": "ai-edge-quantizer's static_wi8_ai8 on the float .tflite files of "
        "benchmarks/litert.py (same calibration inputs as qlitert), measured by "
        "litert.py --peer; accuracy against the float JAX model on the held-out inputs.",
        "date": date,
        "recipe": peer_info["recipe"],
        "versions": peer_info["versions"],
        "models": models,
    }
    _write(PEER_FIXTURE, (json.dumps(fixture, indent=1) + "\n").encode())
    print(f"wrote {PEER_FIXTURE}")


if __name__ == "__main__":
    sys.exit(main())

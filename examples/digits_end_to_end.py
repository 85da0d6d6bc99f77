"""The main job end to end: a float CNN on real digits becomes smaller integer models.

1. Loads scikit-learn's bundled ``load_digits`` (1797 grey-scale 8x8 handwritten
   digits; nothing is downloaded) with the fixed, stratified 75/25 split of
   ``qtorchlike_digits.py``, and trains a small Flax Linen CNN in float32
   (conv 16 -> conv 32 -> max-pool -> dense 10, the network of that example).
2. Quantizes it with qflax: static-range w8a8 PTQ (activation ranges calibrated on
   the training images), weight-only int4 (packed, half a byte per weight) and nf4,
   and an int8 QAT fine-tune (``qflax.QtProvider``) converted to PTQ params.
3. Converts the float model with qlitert into a full-integer int8 ``.tflite`` and runs
   it in the LiteRT interpreter.
4. Exports the qflax static-range w8a8 model of step 2 with qort to ``.onnx`` (validated
   op by op against JAX; the batch is fixed at the test set's size) and runs it in ONNX
   Runtime.
5. Trains the same network eagerly with qtorchlike (Brevitas-style QAT, int8) and
   exports it to ``.tflite`` too.

It prints one table (test accuracy, params or file bytes, median latency per batch of
the whole test set, relative L2 error of the logits vs the float model's) and writes
``results.json``, ``accuracy_vs_size.png``, the two ``.tflite`` files and the ``.onnx``
file to the output directory it names. About 90 s on 2 CPU cores; ``--quick`` (fewer
epochs) is hardly shorter.

Run from the repository root with every package installed (``nox -s demo`` does it)::

    python examples/digits_end_to_end.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import qtorchlike_digits

import qflax
import qlitert
import qort
import qtorchlike
from qcore.files import write_atomic

BATCH = 64
LEARNING_RATE = 3e-3
TIMING_REPS = 7
W8A8_STATIC = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]


class CNN(nn.Module):
    """8x8x1 -> conv 16 -> conv 32 -> max-pool -> 10 logits (NHWC)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(16, (3, 3), name="conv1")(x))
        x = nn.relu(nn.Conv(32, (3, 3), name="conv2")(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        return nn.Dense(10, name="head")(x.reshape(x.shape[0], -1))


def load_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """qtorchlike_digits' split, NHWC float32 images in [0, 1] and int labels."""
    x_train, y_train, x_test, y_test = qtorchlike_digits.load_data()
    return x_train.transpose(0, 2, 3, 1), y_train, x_test.transpose(0, 2, 3, 1), y_test


def batches(x: np.ndarray, y: np.ndarray, rng: np.random.Generator):
    """Shuffled whole minibatches (one compiled shape)."""
    order = rng.permutation(len(x))
    for i in range(len(x) // BATCH):
        idx = order[i * BATCH : (i + 1) * BATCH]
        yield jnp.asarray(x[idx]), jnp.asarray(y[idx])


def fit(
    loss_fn: Callable[..., tuple[jax.Array, Any]],
    params: Any,
    state: Any,
    data: tuple[np.ndarray, np.ndarray],
    epochs: int,
    label: str,
    evaluate: Callable[[Any, Any], float],
    seed: int,
) -> tuple[Any, Any]:
    """Adam on ``loss_fn(params, state, x, y) -> (loss, new state)``; a line per epoch."""
    opt = optax.adam(LEARNING_RATE)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, state, x, y):
        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, loss

    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        losses = []
        for x, y in batches(*data, rng):
            params, opt_state, state, loss = step(params, opt_state, state, x, y)
            losses.append(loss)
        print(
            f"  {label} epoch {epoch:2d}/{epochs}  loss {float(jnp.mean(jnp.stack(losses))):.4f}"
            f"  test acc {evaluate(params, state):6.2%}  ({time.perf_counter() - start:.1f} s)",
            flush=True,
        )
    return params, state


def cross_entropy(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def median_ms(fn: Callable[[], Any]) -> float:
    """Median wall time of ``fn()`` over TIMING_REPS calls after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(TIMING_REPS):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def nbytes(tree: Any) -> int:
    """Bytes of every array leaf (QuantizedParams: codes, scales, zero points)."""
    return sum(int(np.asarray(leaf).nbytes) for leaf in jax.tree.leaves(tree))


def row(
    name: str, logits: np.ndarray, ref: np.ndarray | None, y: np.ndarray, size: int, ms: float
) -> dict[str, Any]:
    """One result: accuracy, bytes, latency, relative L2 error of the logits vs float."""
    err = None if ref is None else float(np.linalg.norm(logits - ref) / np.linalg.norm(ref))
    acc = float(np.mean(np.argmax(logits, axis=1) == y))
    return {"model": name, "accuracy": acc, "bytes": size, "ms_per_batch": ms, "logit_error": err}


def run(out: Path, quick: bool, seed: int) -> list[dict[str, Any]]:
    """Every model of the table; writes the .tflite and .onnx files into ``out``."""
    x_train, y_train, x_test, y_test = load_data()
    xt = jnp.asarray(x_test)
    epochs, qat_epochs = (8, 1) if quick else (30, 3)
    rows = []

    print(f"[1/6] float32 Flax CNN, {epochs} epochs on {len(x_train)} images", flush=True)
    model = CNN()
    params = model.init(jax.random.key(seed), xt[:1])["params"]
    float_apply = jax.jit(lambda p, x: model.apply({"params": p}, x))

    def float_loss(p, state, x, y):
        return cross_entropy(model.apply({"params": p}, x), y), state

    def float_acc(p, _):
        return float(jnp.mean(jnp.argmax(float_apply(p, xt), axis=1) == y_test))

    params, _ = fit(float_loss, params, None, (x_train, y_train), epochs, "float", float_acc, seed)
    ref = np.asarray(float_apply(params, xt))
    rows.append(
        row("float32", ref, ref, y_test, nbytes(params), median_ms(lambda: float_apply(params, xt)))
    )

    print("[2/6] qflax PTQ: w8a8 static ranges, int4 and nf4 weights", flush=True)
    calibrate = qflax.quantize_model(model, qflax.QtProvider(W8A8_STATIC))
    stats = calibrate.init(jax.random.key(0), xt[:1])["quant_stats"]
    observe = jax.jit(
        lambda s, x: calibrate.apply(
            {"params": params, "quant_stats": s}, x, mutable=["quant_stats"]
        )[1]["quant_stats"]
    )
    for i in range(0, len(x_train) - BATCH + 1, BATCH):
        stats = observe(stats, jnp.asarray(x_train[i : i + BATCH]))
    for name, rules, st in (
        ("qflax w8a8 static", W8A8_STATIC, stats),
        ("qflax int4 weights", [qflax.QuantizationRule(weight_qtype="int4")], None),
        ("qflax nf4 weights", [qflax.QuantizationRule(weight_qtype="nf4")], None),
    ):
        rows.append(ptq_row(name, model, rules, params, st, xt, ref, y_test))

    print(f"[3/6] qflax QAT int8: {qat_epochs} epoch(s) from the float weights", flush=True)
    qat = qflax.quantize_model(model, qflax.QtProvider(W8A8_STATIC))

    def qat_loss(p, s, x, y):
        logits, new = qat.apply({"params": p, "quant_stats": s}, x, mutable=["quant_stats"])
        return cross_entropy(logits, y), new["quant_stats"]

    def qat_acc(p, s):
        logits = qat.apply({"params": p, "quant_stats": s}, xt)
        return float(jnp.mean(jnp.argmax(logits, axis=1) == y_test))

    qat_params, qat_stats = fit(
        qat_loss, params, stats, (x_train, y_train), qat_epochs, "QAT", qat_acc, seed + 1
    )
    rows.append(
        ptq_row("qflax QAT int8", model, W8A8_STATIC, qat_params, qat_stats, xt, ref, y_test)
    )

    print("[4/6] qlitert: full-integer int8 .tflite of the float model", flush=True)
    fn = lambda x: model.apply({"params": params}, x)  # noqa: E731 - params become constants
    cal = qlitert.calibrate(fn, [x_train[i : i + BATCH] for i in range(0, len(x_train), BATCH)])
    tflite = qlitert.export(qlitert.annotate(fn, cal), x_test)
    # overwrite=True replaces the model a previous run wrote; any other file is refused.
    path = qlitert.save(out / "flax_int8.tflite", tflite, overwrite=True)
    rows.append(tflite_row("qlitert int8 .tflite", path, x_test, ref, y_test))

    print("[5/6] qort: the qflax w8a8 static model as .onnx, run in ONNX Runtime", flush=True)
    qmodel, qparams = ptq_model(model, W8A8_STATIC, params, stats, xt)
    # The test set is the example input: the graph's batch size is fixed to it.
    exported = qort.export(qmodel, {"params": qparams}, x_test, threads=2)
    print("  " + str(exported.report).replace("\n", "\n  "), flush=True)
    path = exported.save(out / "flax_w8a8.onnx", overwrite=True)
    r = onnx_row("qort w8a8 .onnx (ONNX Runtime)", path, x_test, ref, y_test)
    r["integer_kernels"] = exported.report.integer_kernels
    rows.append(r)

    q_epochs = qtorchlike_digits.QUICK_EPOCHS if quick else qtorchlike_digits.DEFAULT_EPOCHS
    print(f"[6/6] qtorchlike eager QAT int8 ({q_epochs} epochs), exported to .tflite", flush=True)
    qt_model, qt_acc = qtorchlike_digits.train(8, q_epochs, seed, verbose=True)
    x_nchw = x_test.transpose(0, 3, 1, 2)
    path = out / "qtorchlike_int8.tflite"
    qtorchlike.export_tflite(qt_model, x_nchw, path=path, overwrite=True)
    r = tflite_row("qtorchlike QAT int8 .tflite", path, x_nchw, None, y_test)
    r["eager_qat_accuracy"] = qt_acc
    rows.append(r)
    return rows


def ptq_model(
    model: nn.Module,
    rules: list[qflax.QuantizationRule],
    params: Any,
    stats: Any,
    xt: jax.Array,
) -> tuple[nn.Module, Any]:
    """The qflax PTQ model of ``rules`` and its params quantized from ``params`` (and ``stats``)."""
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), xt[:1])["params"]
    return qmodel, qflax.quantize_params(params, abstract, stats)


def ptq_row(
    name: str,
    model: nn.Module,
    rules: list[qflax.QuantizationRule],
    params: Any,
    stats: Any,
    xt: jax.Array,
    ref: np.ndarray,
    y: np.ndarray,
) -> dict[str, Any]:
    """The plain qflax PTQ model of ``rules`` on ``params`` (and static-range ``stats``)."""
    qmodel, qparams = ptq_model(model, rules, params, stats, xt)
    apply = jax.jit(lambda p, x: qmodel.apply({"params": p}, x))
    logits = np.asarray(apply(qparams, xt))
    return row(name, logits, ref, y, nbytes(qparams), median_ms(lambda: apply(qparams, xt)))


def tflite_row(
    name: str, path: Path, x: np.ndarray, ref: np.ndarray | None, y: np.ndarray
) -> dict[str, Any]:
    """Runs the ``.tflite`` at ``path`` in the LiteRT interpreter (2 threads)."""
    interpreter = qlitert.LiteRTModel(path.read_bytes(), num_threads=2)
    logits = np.asarray(interpreter(x))
    r = row(name, logits, ref, y, path.stat().st_size, median_ms(lambda: interpreter(x)))
    r["file"] = str(path)
    return r


def onnx_row(
    name: str, path: Path, x: np.ndarray, ref: np.ndarray | None, y: np.ndarray
) -> dict[str, Any]:
    """Runs the ``.onnx`` at ``path`` in ONNX Runtime (CPU, 2 threads)."""
    session = qort.Session(path, threads=2)
    logits = np.asarray(session(x))
    r = row(name, logits, ref, y, path.stat().st_size, median_ms(lambda: session(x)))
    r["file"] = str(path)
    return r


def format_table(rows: Sequence[dict[str, Any]], n_test: int) -> str:
    """The results as an aligned text table."""
    head = ("model", "accuracy", "bytes", "vs float", f"ms/batch of {n_test}", "logit error")
    base = rows[0]["bytes"]
    body = [
        (
            r["model"],
            f"{r['accuracy']:.2%}",
            f"{r['bytes']:,}",
            f"{r['bytes'] / base:.3f}",
            f"{r['ms_per_batch']:.2f}",
            "-" if r["logit_error"] is None else f"{r['logit_error']:.4f}",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = [
        [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(b, widths, strict=True))
        ]
        for b in (head, *body)
    ]
    rule = ["-" * w for w in widths]
    return "\n".join("  ".join(cells) for cells in (lines[0], rule, *lines[1:]))


def plot(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Test accuracy vs stored bytes (log scale), one labelled point per model."""
    import matplotlib  # noqa: PLC0415 - only needed here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(9, 5.5), layout="constrained")
    for r in rows:
        ax.scatter(r["bytes"], 100 * r["accuracy"], s=50, edgecolors="black", linewidths=0.5)
        point = (r["bytes"], 100 * r["accuracy"])
        ax.annotate(r["model"], point, textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xscale("log")
    ax.margins(x=0.2)
    ax.set_xlabel("params bytes (JAX models) or .tflite / .onnx file bytes")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Digits CNN: accuracy vs size, float32 and quantized")
    ax.grid(True, alpha=0.35)
    write_atomic(path, lambda p: fig.savefig(p, format="png", dpi=120))
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("out/digits_end_to_end"),
        metavar="DIR",
        help="output directory (created if missing; default: %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer epochs (under a minute)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; returns the process exit code."""
    args = parse_args(argv)
    out: Path = args.out
    if out.exists() and not out.is_dir():
        print(
            f"digits_end_to_end.py: error: --out {out} exists and is not a directory",
            file=sys.stderr,
        )
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"digits_end_to_end.py: error: cannot create --out {out}: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = run(out, args.quick, args.seed)
    _, _, x_test, _ = load_data()
    print()
    print(format_table(rows, len(x_test)))
    summary = {
        "quick": args.quick,
        "seed": args.seed,
        "test_images": len(x_test),
        "jax": jax.__version__,
        "seconds": round(time.perf_counter() - start, 1),
    }
    results = json.dumps({**summary, "rows": rows}, indent=2) + "\n"
    write_atomic(out / "results.json", results.encode())
    plot(out / "accuracy_vs_size.png", rows)
    print(
        "\nwrote results.json, accuracy_vs_size.png, the .tflite and .onnx files to "
        f"{out.resolve()}"
    )
    print(f"({summary['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

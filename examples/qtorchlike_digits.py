"""Quantization-aware training of a small CNN on scikit-learn's digits, Brevitas style.

The model and the training loop are written the way a Brevitas user writes them,
with ``qtorchlike`` in place of ``brevitas`` and ``torch``:

1. Loads scikit-learn's bundled ``load_digits`` (1797 grey-scale 8x8 images of the
   digits 0-9; nothing is downloaded), scales the pixels to [0, 1], shapes them NCHW
   ``(N, 1, 8, 8)`` and makes a fixed, stratified 75/25 train/test split.
2. Builds ``QuantIdentity`` (int8 input quantization) -> two ``QuantConv2d`` + ``QuantReLU``
   (uint8 activations) -> ``MaxPool2d`` -> ``Flatten`` -> ``QuantLinear``. Weights are
   quantized per output channel to ``--weight-bit-width`` bits (``weight_bit_width=4`` is a
   prefixed keyword override, as in Brevitas); biases are 32-bit integers at input scale x
   weight scale (``Int32Bias``). Every activation quantizer collects statistics for its
   first ``COLLECT_STATS_STEPS`` training steps, then learns its scale.
3. Trains with ``qtorchlike.optim.Adam`` through ``qtorchlike.func.train_step`` (one jitted
   step: forward, gradients, optimizer update, running statistics written back) on shuffled
   minibatches, printing one line per epoch.
4. Switches to ``model.eval()`` and reports the test accuracy of the quantized model, plus
   each layer's integer weight codes and activation scales.
5. With ``--tflite PATH`` (needs qlitert: ``pip install "jaxquant-qtorchlike[litert]"``),
   exports the trained model to a full-integer ``.tflite`` with ``qtorchlike.export_tflite``
   and reports the test accuracy of the LiteRT interpreter on it. Otherwise nothing is
   written to disk.

Run it from the repository root (needs qcore, qtorchlike and scikit-learn)::

    python examples/qtorchlike_digits.py                        # int8 weights, 10 epochs
    python examples/qtorchlike_digits.py --weight-bit-width 4
    python examples/qtorchlike_digits.py --quick                # 3 epochs
    python examples/qtorchlike_digits.py --tflite digits.tflite # + LiteRT export

``train()`` is what ``packages/qtorchlike/tests/test_digits.py`` runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import qtorchlike
import qtorchlike.nn as qnn
from qtorchlike import optim
from qtorchlike.func import functional_call, static_key, train_step
from qtorchlike.quant import Int8WeightPerChannelFloat, Int32Bias

DEFAULT_EPOCHS = 10
QUICK_EPOCHS = 3
BATCH_SIZE = 64
LEARNING_RATE = 3e-3
# Brevitas' activation quantizers average 300 training steps of statistics before
# learning their scale; one epoch here is 21 steps, so the hand-over comes earlier.
COLLECT_STATS_STEPS = 50


def load_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as float32 NCHW images in [0, 1] and int32 labels: a fixed 75/25 split."""
    digits = load_digits()
    x = (digits.images[:, None, :, :] / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y
    )
    return x_train, y_train, x_test, y_test


def build_model(weight_bit_width: int = 8) -> qnn.Sequential:
    """The quantized CNN: 1x8x8 -> 16x8x8 -> 32x8x8 -> 32x4x4 -> 10 logits."""
    weights = {
        "weight_quant": Int8WeightPerChannelFloat,
        "weight_bit_width": weight_bit_width,
        "bias_quant": Int32Bias,
    }
    # return_quant_tensor=True passes QuantTensors on, so the next layer knows its
    # input scale (Int32Bias needs it: bias scale = input scale x weight scale).
    return qnn.Sequential(
        qnn.QuantIdentity(collect_stats_steps=COLLECT_STATS_STEPS, return_quant_tensor=True),
        qnn.QuantConv2d(1, 16, kernel_size=3, padding=1, **weights),
        qnn.QuantReLU(collect_stats_steps=COLLECT_STATS_STEPS, return_quant_tensor=True),
        qnn.QuantConv2d(16, 32, kernel_size=3, padding=1, **weights),
        qnn.QuantReLU(collect_stats_steps=COLLECT_STATS_STEPS, return_quant_tensor=True),
        qnn.MaxPool2d(2),
        qnn.Flatten(),
        qnn.QuantLinear(32 * 4 * 4, 10, **weights),
    )


def cross_entropy(model: qnn.Module, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of the model's logits (``train_step``'s loss)."""
    log_probs = jax.nn.log_softmax(model(x))
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))


def make_predict(model: qnn.Module) -> Callable[[jax.Array], jax.Array]:
    """A jitted forward pass of ``model`` in its current mode (retraced when the mode changes).

    ``model(x)`` works too; the compiled version spares the eager dispatch of every op.
    """

    @functools.partial(jax.jit, static_argnums=0)
    def run(_mode: tuple, state: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return functional_call(model, state, x)[0]

    def predict(x: jax.Array) -> jax.Array:
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        return run(static_key(model), state, x)

    return predict


def accuracy(predict: Callable[[jax.Array], jax.Array], x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of correctly classified examples."""
    return float(np.mean(np.argmax(np.asarray(predict(jnp.asarray(x))), axis=1) == y))


def train(
    weight_bit_width: int = 8,
    epochs: int = DEFAULT_EPOCHS,
    seed: int = 0,
    *,
    verbose: bool = False,
) -> tuple[qnn.Sequential, float]:
    """Trains the quantized CNN and returns it in eval mode with its QAT test accuracy.

    Args:
        weight_bit_width: Bits of every weight (per output channel, narrow range).
        epochs: Passes over the training set.
        seed: Seeds the initial weights and the minibatch order.
        verbose: Print a progress line per epoch.

    Returns:
        ``(model, test_accuracy)``, the accuracy measured with ``model.eval()``.
    """
    x_train, y_train, x_test, y_test = load_data()
    qtorchlike.manual_seed(seed)
    model = build_model(weight_bit_width)
    optimizer = optim.Adam(model, lr=LEARNING_RATE)
    step = train_step(model, cross_entropy, optimizer)
    predict = make_predict(model)
    rng = np.random.default_rng(seed)
    n_batches = len(x_train) // BATCH_SIZE  # whole batches only: one compiled shape
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        model.train()
        order = rng.permutation(len(x_train))
        losses = []
        for i in range(n_batches):
            idx = order[i * BATCH_SIZE : (i + 1) * BATCH_SIZE]
            losses.append(step(jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx])))
        if verbose:
            model.eval()
            acc = accuracy(predict, x_test, y_test)
            loss = float(jnp.mean(jnp.stack(losses)))
            elapsed = time.perf_counter() - start
            print(
                f"  epoch {epoch:2d}/{epochs}  loss {loss:.4f}  test acc {acc:6.2%}  "
                f"({elapsed:.1f} s)",
                flush=True,
            )
    model.eval()
    return model, accuracy(predict, x_test, y_test)


def describe(model: qnn.Sequential) -> str:
    """One line per quantized layer: its weight codes, or its activation threshold."""
    layers = dict(model.named_children())
    wbiol = {n: m for n, m in layers.items() if isinstance(m, qnn.QuantConv2d | qnn.QuantLinear)}
    # One compiled call for every quantized weight (eager, each op would compile on its own).
    weights = jax.jit(lambda: {n: m.quant_weight() for n, m in wbiol.items()})()
    lines = []
    for name, layer in layers.items():
        kind = type(layer).__name__
        if name in weights:
            w = weights[name]
            codes = np.asarray(w.int())
            lines.append(
                f"  {name} {kind:13s} weight codes {codes.dtype} in [{codes.min()}, "
                f"{codes.max()}] ({int(w.bit_width)} bits, {w.scale.size} scales)"
            )
        elif isinstance(layer, qnn.QuantIdentity | qnn.QuantReLU):
            proxy = layer.act_quant
            seen, steps = int(proxy.counter), proxy.spec.collect_stats_steps
            if seen >= steps:
                t = float(proxy.value)
                how = f"learned threshold {t:.3f} (after {steps} steps of statistics)"
            else:  # still collecting: eval uses the running statistic
                t = float(proxy.running)
                how = f"running threshold {t:.3f} (statistics: {seen}/{steps} steps)"
            lines.append(f"  {name} {kind:13s} {proxy.spec.qtype} activations, {how}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description="Quantization-aware training of a small CNN on scikit-learn's digits "
        "with qtorchlike (Brevitas-style layers on JAX); prints the quantized test accuracy.",
    )
    parser.add_argument(
        "--weight-bit-width",
        type=int,
        default=8,
        choices=range(2, 9),
        metavar="{2..8}",
        help="bits per weight, e.g. 8 or 4 (activations stay 8-bit; default: %(default)s)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"training epochs (default: {DEFAULT_EPOCHS}, or {QUICK_EPOCHS} with --quick)",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"train for {QUICK_EPOCHS} epochs only"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    parser.add_argument(
        "--tflite",
        metavar="PATH",
        default=None,
        help="also export the trained model to this full-integer .tflite (needs qlitert) "
        "and report its accuracy in the LiteRT interpreter",
    )
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = QUICK_EPOCHS if args.quick else DEFAULT_EPOCHS
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Trains, then prints the eval-mode test accuracy and a per-layer summary."""
    args = parse_args(argv)
    print(
        f"QAT on digits: {args.weight_bit_width}-bit weights, 8-bit activations, "
        f"{args.epochs} epochs (jax {jax.__version__}, {jax.default_backend()})"
    )
    start = time.perf_counter()
    model, acc = train(args.weight_bit_width, args.epochs, args.seed, verbose=True)
    print(describe(model))
    print(f"QAT test accuracy, model.eval(): {acc:.2%} ({time.perf_counter() - start:.1f} s)")
    if args.tflite is not None:
        litert_acc = export(model, args.tflite)
        size = os.path.getsize(args.tflite)
        print(f"LiteRT int8 model: {args.tflite} ({size} bytes), test accuracy {litert_acc:.2%}")
    return 0


def export(model: qnn.Sequential, path: str) -> float:
    """Exports ``model`` to a full-integer ``.tflite`` at ``path``; returns its test accuracy.

    The model is exported at the test set's batch shape and validated by qlitert
    (integer kernels only, every op within one quantization step of the model's).
    """
    import qlitert  # noqa: PLC0415 - only this option needs it

    _, _, x_test, y_test = load_data()
    # The path the user named: a previous model there is replaced, any other file refused.
    tflite = qtorchlike.export_tflite(model, x_test, path=path, overwrite=True)
    logits = qlitert.LiteRTModel(tflite)(x_test)
    return float(np.mean(np.argmax(logits, axis=1) == y_test))


if __name__ == "__main__":
    sys.exit(main())

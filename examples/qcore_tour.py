"""A tour of qcore: quantize the weights of a small digits classifier every which way.

What it shows:

1. Loads scikit-learn's bundled ``load_digits`` data set (1797 8x8 grey-scale images of
   the digits 0-9; nothing is downloaded), scales the pixels to [0, 1] and makes a fixed,
   seeded, stratified train/test split.
2. Trains a 64 -> 128 -> 10 ReLU MLP in plain JAX (softmax cross-entropy, full-batch
   Adam written inline) and prints its float32 test accuracy.
3. Quantizes both weight matrices with :func:`qcore.quantize` for a grid of
   quantization type x calibration x granularity (per-tensor, per-channel = one scale
   per output column, sub-channel = one scale per 32 input rows of each column, and the
   fixed blocks of the block-scaled mxfp8 / mxfp4 / nvfp4 formats). Sub-byte codes are
   packed (``pack=True``) so the byte counts are what would really be stored. Biases
   stay float32. For every configuration it reports the weights' mean relative error and
   SQNR, the bytes of both :class:`qcore.QArray` objects (codes + scales + zero points),
   their ratio to the float32 weights, and the test accuracy of the classifier run on the
   quantized weights through ``qcore.matmul``.
4. Prints one table, then writes ``results.json`` and a ``sqnr_vs_bytes.png`` plot to the
   output directory (default ``out/qcore_tour/``).

Run it from the repository root::

    nox -s demo                                  # installs qcore, matplotlib, scikit-learn
    nox -s demo -- --quick                       # reduced grid, a few seconds
    PYTHONPATH=packages/qcore/src python examples/qcore_tour.py --out /tmp/tour

Options: ``--out DIR``, ``--quick``, ``--seed N``, ``--steps N`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import qcore
from qcore.files import write_atomic

Params = dict[str, Any]  # float arrays, or QArrays for quantized weights

HIDDEN = 128
NUM_CLASSES = 10
SUB_CHANNEL_TILE = 32

# Grid order is also the table's sort order.
QTYPES = (
    "int8",
    "int4",
    "int3",
    "int2",
    "int1",
    "uint8",
    "nf4",
    "float8_e4m3fn",
    "float4_e2m1fn",
    "mxfp8",
    "mxfp4",
    "nvfp4",
)
CALIBRATIONS = ("absmax", "mse", "percentile,99.9")
GRANULARITIES = ("per-tensor", "per-channel", "sub-channel")
QUICK_QTYPES = ("int8", "int4", "nf4", "mxfp4")


# -- data and model -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Data:
    """The digits split: float32 pixels in [0, 1] and int32 labels."""

    x_train: jax.Array
    y_train: jax.Array
    x_test: jax.Array
    y_test: jax.Array


def load_data(seed: int) -> Data:
    """Loads scikit-learn's digits, scales pixels to [0, 1] and splits 75/25 (stratified)."""
    digits = load_digits()
    x = np.asarray(digits.data, np.float32) / np.float32(16.0)
    y = np.asarray(digits.target, np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return Data(jnp.asarray(x_tr), jnp.asarray(y_tr), jnp.asarray(x_te), jnp.asarray(y_te))


def init_params(key: jax.Array, n_in: int) -> Params:
    """He-initialised weights, shaped (in, out), and zero biases."""
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (n_in, HIDDEN), jnp.float32) * math.sqrt(2.0 / n_in),
        "b1": jnp.zeros((HIDDEN,), jnp.float32),
        "w2": jax.random.normal(k2, (HIDDEN, NUM_CLASSES), jnp.float32) * math.sqrt(2.0 / HIDDEN),
        "b2": jnp.zeros((NUM_CLASSES,), jnp.float32),
    }


def logits_fn(params: Params, x: jax.Array) -> jax.Array:
    """The MLP: relu(x @ w1 + b1) @ w2 + b2.

    ``qcore.matmul`` takes float weights or QArrays alike, so the same function runs the
    float model and every quantized one (scales applied to the product, codes never
    dequantized into a float weight on the kernel paths).
    """
    h = jax.nn.relu(qcore.matmul(x, params["w1"]) + params["b1"])
    return qcore.matmul(h, params["w2"]) + params["b2"]


def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy."""
    logp = jax.nn.log_softmax(logits_fn(params, x))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


@jax.jit
def accuracy(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Fraction of correctly classified examples."""
    return jnp.mean(jnp.argmax(logits_fn(params, x), axis=1) == y)


def train(data: Data, *, seed: int, steps: int, lr: float = 1e-2) -> Params:
    """Full-batch Adam (b1=0.9, b2=0.999), printing progress every 50 steps."""
    params = init_params(jax.random.key(seed), data.x_train.shape[1])
    b1, b2, eps = 0.9, 0.999, 1e-8

    @jax.jit
    def step(
        params: Params, m: Params, v: Params, t: jax.Array
    ) -> tuple[Params, Params, Params, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, data.x_train, data.y_train)
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        m_hat_scale = 1.0 / (1 - b1**t)
        v_hat_scale = 1.0 / (1 - b2**t)
        params = jax.tree.map(
            lambda p, m, v: p - lr * (m * m_hat_scale) / (jnp.sqrt(v * v_hat_scale) + eps),
            params,
            m,
            v,
        )
        return params, m, v, loss

    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    for t in range(1, steps + 1):
        params, m, v, loss = step(params, m, v, jnp.float32(t))
        if t % 50 == 0 or t == steps:
            train_acc = float(accuracy(params, data.x_train, data.y_train))
            print(f"  step {t:4d}/{steps}  loss {float(loss):.4f}  train acc {train_acc:.2%}")
    return params


# -- the quantization sweep -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One point of the grid."""

    qtype: str
    calibration: str
    granularity: str
    symmetric: bool = True

    @property
    def label(self) -> str:
        """A short human-readable label."""
        asym = " (asym)" if not self.symmetric else ""
        return f"{self.qtype} {self.calibration} {self.granularity}{asym}"

    def how(self) -> qcore.HowToQuantize:
        """The qcore spec for a weight matrix shaped (in, out)."""
        qtype = qcore.qtypes.get(self.qtype)
        if qtype.block_size is not None:
            # Blocks run along the input (reduction) axis, one scale per block and column.
            channel, tiles = (1,), {0: qtype.block_size}
        elif self.granularity == "per-tensor":
            channel, tiles = (), {}
        elif self.granularity == "per-channel":
            channel, tiles = (1,), {}
        else:
            channel, tiles = (1,), {0: SUB_CHANNEL_TILE}
        return qcore.HowToQuantize(
            qtype=qtype,
            channelwise_axes=channel,
            tiled_axes=tiles,
            calibration=self.calibration,
            symmetric=self.symmetric,
            pack=qtype.packable,
            # Pack along the input axis (64 and 128 rows): whole packing groups, no padding.
            pack_axis=0,
        )


def build_grid(quick: bool) -> list[Config]:
    """The configurations to run; combinations that make no sense are left out."""
    if quick:
        return [Config(q, "absmax", _block_label(q) or "per-channel") for q in QUICK_QTYPES]
    grid: list[Config] = []
    for name in QTYPES:
        block = _block_label(name)
        # A 99.9th percentile of the 16 or 32 values of one block or sub-channel tile is just
        # the tile's maximum blended with the runner-up (~absmax), so it is not run there.
        if block:
            # Block-scaled formats have exactly one granularity: their own blocks.
            grid += [Config(name, cal, block) for cal in ("absmax", "mse")]
            continue
        symmetric = name != "uint8"  # uint8 is the asymmetric (zero point) example
        for gran in GRANULARITIES:
            cals = CALIBRATIONS if symmetric else ("minmax", "mse", "percentile,99.9")
            if gran == "sub-channel":
                cals = tuple(c for c in cals if not c.startswith("percentile"))
            grid += [Config(name, cal, gran, symmetric=symmetric) for cal in cals]
    return grid


def _block_label(name: str) -> str | None:
    block = qcore.qtypes.get(name).block_size
    return None if block is None else f"block/{block}"


def granularity_rank(granularity: str) -> int:
    """Sort key: coarse to fine."""
    order = ("per-tensor", "per-channel", "sub-channel")
    return order.index(granularity) if granularity in order else len(order)


@functools.partial(jax.jit, static_argnames="how")
def quantize_weights(
    w1: jax.Array, w2: jax.Array, how: qcore.HowToQuantize
) -> tuple[qcore.QArray, qcore.QArray, jax.Array, jax.Array]:
    """Quantizes and dequantizes both weight matrices in one compiled program.

    ``HowToQuantize`` is frozen and hashable, so it is a static argument: the sweep pays one
    XLA compilation per configuration rather than one per qcore call and matrix shape.
    """
    q1, q2 = qcore.quantize(w1, how), qcore.quantize(w2, how)
    return q1, q2, qcore.dequantize(q1), qcore.dequantize(q2)


def evaluate(config: Config, params: Params, data: Data, n_float_bytes: int) -> dict[str, Any]:
    """Quantizes both weight matrices under ``config`` and measures the damage."""
    q1, q2, d1, d2 = quantize_weights(params["w1"], params["w2"], config.how())
    deq = dict(params, w1=d1, w2=d2)
    ref = np.concatenate([np.ravel(params["w1"]), np.ravel(params["w2"])])
    approx = np.concatenate([np.ravel(deq["w1"]), np.ravel(deq["w2"])])
    n_bytes = q1.nbytes + q2.nbytes
    n_weights = ref.size
    return {
        "qtype": config.qtype,
        "calibration": config.calibration,
        "granularity": config.granularity,
        "symmetric": config.symmetric,
        "packed": q1.packing is not None,
        "w1_scale_shape": list(q1.scale.shape),
        "w2_scale_shape": list(q2.scale.shape),
        "mean_relative_error": qcore.mean_relative_error(ref, approx),
        "sqnr_db": qcore.sqnr_db(ref, approx),
        "bytes": int(n_bytes),
        "bytes_per_weight": n_bytes / n_weights,
        "ratio_to_float32": n_bytes / n_float_bytes,
        # The classifier runs on the QArrays themselves, through qcore's quantized matmul.
        "test_accuracy": float(accuracy(dict(params, w1=q1, w2=q2), data.x_test, data.y_test)),
    }


# -- output -----------------------------------------------------------------------------------


def format_table(rows: Sequence[dict[str, Any]], float_acc: float, float_bytes: int) -> str:
    """One aligned text table, plus a float32 reference line."""
    headers = ("qtype", "calibration", "granularity", "MRE", "SQNR dB", "bytes", "B/weight")
    headers += ("vs f32", "test acc")
    body = [
        (
            r["qtype"] + ("" if r["symmetric"] else " asym"),
            r["calibration"],
            r["granularity"],
            f"{r['mean_relative_error']:.4f}",
            f"{r['sqnr_db']:.2f}",
            str(r["bytes"]),
            f"{r['bytes_per_weight']:.3f}",
            f"{r['ratio_to_float32']:.3f}",
            f"{r['test_accuracy']:.2%}",
        )
        for r in rows
    ]
    body.append(("float32", "-", "-", "0.0000", "inf", str(float_bytes), "4.000", "1.000"))
    body[-1] += (f"{float_acc:.2%}",)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    numeric = set(range(3, len(headers)))

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(b) for b in body[:-1]), rule, line(body[-1])])


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, rows: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    """Writes the rows and run metadata (non-finite floats become null)."""
    clean = [{k: _finite_or_none(v) for k, v in r.items()} for r in rows]
    write_atomic(path, (json.dumps({**summary, "rows": clean}, indent=2) + "\n").encode())


def plot(path: Path, rows: Sequence[dict[str, Any]], float_acc: float) -> None:
    """SQNR vs bytes per weight: colour = qtype, marker = granularity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    qtypes = [q for q in QTYPES if any(r["qtype"] == q for r in rows)]
    tab10 = plt.get_cmap("tab10")
    palette = [*(tab10(i) for i in range(10)), "black", "gold"]
    colours = {q: palette[i % len(palette)] for i, q in enumerate(qtypes)}
    grans = sorted({r["granularity"] for r in rows}, key=lambda g: (granularity_rank(g), g))
    marker_cycle = ("o", "s", "^", "D", "v", "P")
    markers = {g: marker_cycle[i % len(marker_cycle)] for i, g in enumerate(grans)}

    fig, ax = plt.subplots(figsize=(11, 6.5), layout="constrained")
    for r in rows:
        if r["sqnr_db"] is None or not math.isfinite(r["sqnr_db"]):
            continue
        ax.scatter(
            r["bytes_per_weight"],
            r["sqnr_db"],
            color=colours[r["qtype"]],
            marker=markers[r["granularity"]],
            s=46,
            edgecolors="black",
            linewidths=0.4,
            alpha=0.9,
        )
    qtype_handles = [
        Line2D([], [], ls="", marker="o", color=colours[q], markeredgecolor="black", label=q)
        for q in qtypes
    ]
    gran_handles = [
        Line2D([], [], ls="", marker=markers[g], color="white", markeredgecolor="black", label=g)
        for g in grans
    ]
    fig.legend(handles=qtype_handles, title="qtype", loc="outside right upper")
    fig.legend(handles=gran_handles, title="granularity", loc="outside right lower")
    ax.set_xlabel("stored bytes per weight (codes + scales + zero points; float32 = 4)")
    ax.set_ylabel("weight SQNR (dB)")
    ax.set_title(
        "qcore: SQNR vs storage for the weights of a digits MLP "
        f"(float32 test accuracy {float_acc:.1%})"
    )
    ax.grid(True, alpha=0.35)
    write_atomic(path, lambda p: fig.savefig(p, format="png", dpi=120))
    plt.close(fig)


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description="Quantize a small digits classifier with every qcore qtype, calibration "
        "and granularity; print a table and write results.json and sqnr_vs_bytes.png.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("out/qcore_tour"),
        metavar="DIR",
        help="output directory (created if missing; default: %(default)s)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="reduced grid: int8, int4, nf4, mxfp4 x absmax x per-channel (mxfp4: its blocks)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for split and init (default 0)")
    parser.add_argument("--steps", type=int, default=300, help="Adam steps (default 300)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the tour; returns the process exit code."""
    args = parse_args(argv)
    out: Path = args.out
    if out.exists() and not out.is_dir():
        print(f"qcore_tour.py: error: --out {out} exists and is not a directory", file=sys.stderr)
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"qcore_tour.py: error: cannot create --out {out}: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()

    data = load_data(args.seed)
    print(
        f"digits: {data.x_train.shape[0]} train / {data.x_test.shape[0]} test images of "
        f"{data.x_train.shape[1]} pixels, {NUM_CLASSES} classes"
    )
    print(f"training a {data.x_train.shape[1]}-{HIDDEN}-{NUM_CLASSES} MLP ({args.steps} steps)")
    t0 = time.perf_counter()
    params = train(data, seed=args.seed, steps=args.steps)
    float_acc = float(accuracy(params, data.x_test, data.y_test))
    train_s = time.perf_counter() - t0
    print(f"float32 test accuracy: {float_acc:.2%}  (trained in {train_s:.1f} s)")

    grid = build_grid(args.quick)
    float_bytes = int(params["w1"].nbytes + params["w2"].nbytes)
    print(f"sweeping {len(grid)} configurations (weights only; biases stay float32)")
    t0 = time.perf_counter()
    rows = []
    for i, config in enumerate(grid, 1):
        print(f"[{i}/{len(grid)}] {config.label}", end="", flush=True)
        row = evaluate(config, params, data, float_bytes)
        print(f"  -> SQNR {row['sqnr_db']:.1f} dB, acc {row['test_accuracy']:.2%}")
        rows.append(row)
    sweep_s = time.perf_counter() - t0

    rows.sort(
        key=lambda r: (
            QTYPES.index(r["qtype"]),
            granularity_rank(r["granularity"]),
            CALIBRATIONS.index(r["calibration"]) if r["calibration"] in CALIBRATIONS else -1,
        )
    )
    print()
    print(format_table(rows, float_acc, float_bytes))
    print()

    summary = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "qcore": qcore.__version__,
        },
        "quick": args.quick,
        "seed": args.seed,
        "steps": args.steps,
        "model": f"{data.x_train.shape[1]}-{HIDDEN}-{NUM_CLASSES} MLP, ReLU, Adam",
        "float_test_accuracy": float_acc,
        "float32_weight_bytes": float_bytes,
        "num_test_examples": int(data.x_test.shape[0]),
        "train_seconds": round(train_s, 2),
        "sweep_seconds": round(sweep_s, 2),
    }
    write_json(out / "results.json", rows, summary)
    plot(out / "sqnr_vs_bytes.png", rows, float_acc)
    total_s = time.perf_counter() - start
    print(f"sweep {sweep_s:.1f} s, total {total_s:.1f} s")
    print(f"wrote results.json and sqnr_vs_bytes.png to {out.resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

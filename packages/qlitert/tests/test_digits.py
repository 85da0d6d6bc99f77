"""Real data: a digits CNN (scikit-learn's load_digits) as an int8 .tflite, PTQ and QAT."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.datasets import load_digits

import qlitert


class DigitsCNN(nn.Module):
    """conv -> relu -> conv -> relu -> max pool -> dense, on 8x8x1 images."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.max_pool(nn.relu(nn.Conv(16, (3, 3))(x)), (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


@pytest.fixture(scope="module")
def digits():
    data = load_digits()
    x = (data.images[..., None] / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1437], y[:1437]), (x[1437:], y[1437:])


def train(loss_fn, params, steps, lr):
    """Adam, written out (optax's bias correction fails under strict dtype promotion)."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)

    @jax.jit
    def step(params, m, v, t):
        g = jax.grad(loss_fn)(params)
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        c1, c2 = 1 - b1**t, 1 - b2**t
        params = jax.tree.map(
            lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), params, m, v
        )
        return params, m, v

    for t in range(1, steps + 1):
        params, m, v = step(params, m, v, jnp.float32(t))
    return params


def cross_entropy(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def accuracy(logits, y):
    return float(np.mean(np.argmax(np.asarray(logits), -1) == y))


def int8_accuracy(fn, calibration_batches, x_test, y_test):
    cal = qlitert.calibrate(fn, calibration_batches)
    tfl = qlitert.export(qlitert.annotate(fn, cal), x_test)  # validated: int8, <= 2 steps
    names = set(qlitert.inspect(tfl).op_names())
    assert names <= {"QUANTIZE", "CONV_2D", "DEPTHWISE_CONV_2D", "MAX_POOL_2D", "RESHAPE",
                     "FULLY_CONNECTED", "DEQUANTIZE"}, names  # fmt: skip
    return accuracy(qlitert.LiteRTModel(tfl)(x_test), y_test)


def test_digits_int8_tflite_is_within_one_point_of_float_with_ptq_and_with_qat(digits):
    (x, y), (x_test, y_test) = digits
    model = DigitsCNN()
    params = model.init(jax.random.key(0), x[:1])
    params = train(lambda p: cross_entropy(model.apply(p, x), y), params, 150, 1e-2)
    float_acc = accuracy(model.apply(params, x_test), y_test)
    assert float_acc > 0.95
    batches = [x[i : i + 256] for i in range(0, 1024, 256)]

    ptq_acc = int8_accuracy(lambda v: model.apply(params, v), batches, x_test, y_test)
    assert abs(ptq_acc - float_acc) <= 0.01, (ptq_acc, float_acc)

    # QAT: fine-tune through the int8 model's rounding, re-calibrate, export.
    cal = qlitert.calibrate(lambda v: model.apply(params, v), batches)
    trainable = qlitert.qat(model.apply, cal)
    qat_params = train(lambda p: cross_entropy(trainable(p, x), y), params, 20, 1e-3)
    assert not np.allclose(
        qat_params["params"]["Dense_0"]["kernel"], params["params"]["Dense_0"]["kernel"]
    )  # the straight-through gradients reached the weights
    qat_acc = int8_accuracy(lambda v: model.apply(qat_params, v), batches, x_test, y_test)
    assert abs(qat_acc - float_acc) <= 0.01, (qat_acc, float_acc)

    # QAT whose ranges follow training (moving averages): export without re-calibrating.
    tracked = qlitert.qat(model.apply, cal, track_ranges=True)
    step = jax.jit(
        jax.value_and_grad(lambda p, r, v, t: _tracked_loss(tracked, p, r, v, t), has_aux=True)
    )
    ranges, p = cal.state(), params
    for i in range(20):
        v, t = x[(i * 128) % 1280 :][:128], y[(i * 128) % 1280 :][:128]
        (_, ranges), g = step(p, ranges, v, t)
        p = jax.tree.map(lambda a, b: a - 1e-3 * b, p, g)
    trained = cal.with_state(ranges)
    assert all(trained.counts[s] == cal.counts[s] + 20 for s in cal.counts)
    assert trained.ranges != cal.ranges
    tfl = qlitert.export(qlitert.annotate(lambda v: model.apply(p, v), trained), x_test)
    tracked_acc = accuracy(qlitert.LiteRTModel(tfl)(x_test), y_test)
    assert abs(tracked_acc - float_acc) <= 0.01, (tracked_acc, float_acc)


def _tracked_loss(tracked, params, ranges, x, y):
    logits, ranges = tracked(params, ranges, x)
    return cross_entropy(logits, y), ranges


def test_qat_forward_is_the_annotated_forward(digits):
    (x, _), _ = digits
    model = DigitsCNN()
    params = model.init(jax.random.key(1), x[:1])
    batch = x[:32]
    cal = qlitert.calibrate(lambda v: model.apply(params, v), [batch])
    trained_view = qlitert.qat(model.apply, cal)(params, jnp.asarray(batch))
    export_view = qlitert.annotate(lambda v: model.apply(params, v), cal)(jnp.asarray(batch))
    np.testing.assert_allclose(trained_view, export_view, rtol=1e-5, atol=1e-5)

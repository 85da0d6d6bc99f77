"""The NaN/inf policy in qtorchlike, against float64 NumPy references.

Activations: a block (the values one scale serves) holding NaN or ±inf gets a NaN
scale and dequantizes to NaN, so everything computed from it is NaN, as in float.
Weights and statistics: a concrete non-finite value is an error naming the site
(test_reliability.py); under ``jax.jit`` no error can be raised and the block rule
applies, and a non-finite batch is left out of running statistics.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import nearest_rank

import qtorchlike
import qtorchlike.nn as qnn
from qtorchlike.func import functional_call
from qtorchlike.modes import jit_forward
from qtorchlike.quant import Int8ActPerTensorFloat, Int8WeightPerChannelFloat

BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
RNG = np.random.default_rng(0)
X = RNG.normal(size=(3, 4)).astype(np.float32)


def _narrow_int8(w: np.ndarray, axis: int | None) -> np.ndarray:
    """Reference: symmetric narrow int8 (max|w| / 127), ties to even, in float64."""
    w = np.asarray(w, np.float64)
    keep = tuple(i for i in range(w.ndim) if i != axis) if axis is not None else None
    scale = np.max(np.abs(w), axis=keep, keepdims=True) / 127
    return np.clip(np.round(w / scale), -127, 127) * scale


def _calibrated(layer, x=X):
    with qtorchlike.calibration_mode(layer):
        layer(x)
    return layer.eval()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
def test_weight_only_linear_makes_only_the_bad_row_non_finite_like_float(bad, training):
    layer = qnn.QuantLinear(4, 2, key=jax.random.key(1)).train(training)
    x = X.copy()
    x[1, 2] = BAD[bad]
    y = np.asarray(layer(x), np.float64)
    w = _narrow_int8(layer.weight, None)
    ref = x.astype(np.float64) @ w.T + np.asarray(layer.bias, np.float64)
    assert not np.isfinite(y[1]).any()
    # NaN and ±inf where float has them (assert_allclose matches both), values elsewhere.
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: qnn.QuantLinear(4, 2, input_quant=Int8ActPerTensorFloat), (3, 4)),
        (lambda: qnn.QuantConv2d(1, 2, 2, input_quant=Int8ActPerTensorFloat), (2, 1, 3, 4)),
        (lambda: qnn.QuantIdentity(), (3, 4)),
        (lambda: qnn.QuantReLU(), (3, 4)),
    ],
    ids=["linear", "conv2d", "identity", "relu"],
)
def test_a_per_tensor_activation_scale_makes_the_whole_output_nan(make, shape, bad):
    """One scale serves the tensor: one non-finite value makes every output NaN (eval)."""
    x = RNG.normal(size=shape).astype(np.float32)
    layer = _calibrated(make(), np.abs(x))
    assert np.isfinite(np.asarray(layer(x))).all()
    x.reshape(-1)[1] = BAD[bad]  # (relu(-inf) = 0 is finite: use +inf for it)
    if isinstance(layer, qnn.QuantReLU) and bad == "-inf":
        x.reshape(-1)[1] = np.inf
    y = np.asarray(layer(x))
    assert np.isnan(y).all(), y


def test_the_returned_quant_tensor_carries_the_nan_scale():
    layer = _calibrated(qnn.QuantIdentity(return_quant_tensor=True))
    x = X.copy()
    x[0, 0] = np.nan
    q = layer(x)
    assert np.isnan(np.asarray(q.scale)).all() and np.isnan(np.asarray(q.value)).all()
    assert not q.is_valid


def test_a_learned_scale_in_training_still_gives_nan():
    """After the statistics phase (one step here) a NaN batch trains into NaN, not an error."""
    layer = qnn.QuantIdentity(collect_stats_steps=1)
    layer(X)  # the one statistics step
    value = np.asarray(layer.act_quant.value)
    x = X.copy()
    x[2, 1] = np.nan
    y = np.asarray(layer(x))
    assert np.isnan(y).all()
    np.testing.assert_array_equal(np.asarray(layer.act_quant.value), value)


def test_under_jit_a_nan_batch_is_nan_and_left_out_of_the_running_statistics():
    layer = qnn.QuantIdentity(scaling_impl_type="stats", return_quant_tensor=True)
    forward = jit_forward(layer)
    forward(X)
    bad = X.copy()
    bad[0, 0] = np.nan
    q = forward(bad)  # no error can be raised under jit
    assert np.isnan(np.asarray(q.value)).all() and np.isnan(np.asarray(q.scale)).all()
    forward(2 * X)
    ref = [nearest_rank(np.abs(X.astype(np.float64))) * k for k in (1, 2)]
    momentum = 0.1  # Brevitas' default: running = 0.9 * first + 0.1 * second
    np.testing.assert_allclose(
        float(layer.act_quant.running), (1 - momentum) * ref[0] + momentum * ref[1], rtol=1e-5
    )
    assert int(layer.act_quant.counter) == 2


def test_calibration_under_jit_leaves_a_nan_batch_out():
    model = qnn.Sequential(qnn.QuantIdentity(), qnn.QuantLinear(4, 2))
    bad = X.copy()
    bad[2, 3] = np.inf
    with qtorchlike.calibration_mode(model) as forward:
        forward(X)
        assert not np.isfinite(np.asarray(forward(bad))).all()  # float run: inf propagates
        forward(3 * X)
    ref = np.mean([nearest_rank(np.abs(X.astype(np.float64))) * k for k in (1, 3)])
    np.testing.assert_allclose(float(model[0].act_quant.value), ref, rtol=1e-5)


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
def test_under_jit_a_non_finite_weight_makes_its_channel_nan(bad):
    """Per-channel weight scales: only the output channel of the bad weight row is NaN."""
    layer = qnn.QuantLinear(
        4, 3, bias=False, weight_quant=Int8WeightPerChannelFloat, key=jax.random.key(2)
    )
    w = np.asarray(layer.weight).copy()
    w[1, 2] = BAD[bad]
    y = jax.jit(lambda s, x: functional_call(layer, s, x)[0])({"weight": jnp.asarray(w)}, X)
    y = np.asarray(y, np.float64)
    assert np.isnan(y[:, 1]).all()
    ref = X.astype(np.float64) @ _narrow_int8(np.delete(w, 1, 0), 0).T
    np.testing.assert_allclose(np.delete(y, 1, 1), ref, rtol=1e-5, atol=1e-6)


def test_a_loaded_nan_weight_is_an_error_at_the_first_forward_not_at_load():
    layer = qnn.QuantLinear(4, 2)
    sd = {k: np.asarray(v) for k, v in layer.state_dict().items()}
    sd["weight"] = np.where(np.eye(2, 4) > 0, np.nan, sd["weight"])
    layer.load_state_dict(sd)  # PyTorch's behaviour: loading copies
    with pytest.raises(ValueError, match=r"param 'weight' of QuantLinear has 2 non-finite"):
        layer(X)


def test_eval_without_statistics_still_warns_and_a_zero_block_keeps_scale_one():
    """Finite degenerate input (all zeros) is not affected by the policy."""
    layer = qnn.QuantIdentity(scaling_impl_type="stats", return_quant_tensor=True)
    q = layer(np.zeros((2, 3), np.float32))
    assert float(np.asarray(q.scale).ravel()[0]) == 1.0
    assert np.array_equal(np.asarray(q.value), np.zeros((2, 3)))
    layer.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert np.isfinite(np.asarray(layer(X).value)).all()

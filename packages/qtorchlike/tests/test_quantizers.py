"""Closed-form quantizer outputs, checked against float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import nearest_rank

import qtorchlike
import qtorchlike.nn as qnn
from qtorchlike import quant
from qtorchlike.func import functional_call
from qtorchlike.inject import ExtendedInjector
from qtorchlike.proxy import scale_threshold
from qtorchlike.solver import ScalingImplType, StatsOp


def _w(layer):
    return np.asarray(layer.weight, np.float64)


def test_binary_const_scale_gives_plus_minus_0_1():
    layer = qnn.QuantLinear(6, 4, weight_quant=quant.SignedBinaryWeightPerTensorConst)
    layer.weight = layer.weight.at[0, 0].set(0.0)
    q = layer.quant_weight()
    want = np.where(_w(layer) >= 0, 0.1, -0.1)
    np.testing.assert_array_equal(np.asarray(q.value), want.astype(np.float32))
    assert q.is_valid and set(np.unique(np.asarray(q.int()))) == {-1, 1}


def test_ternary_const_scale_has_three_levels():
    layer = qnn.QuantLinear(64, 8, weight_quant=quant.SignedTernaryWeightPerTensorConst)
    q = layer.quant_weight()
    codes = np.clip(np.round(_w(layer) / 0.1), -1, 1)
    np.testing.assert_allclose(np.asarray(q.value), codes * 0.1, rtol=1e-6)
    assert set(np.unique(np.asarray(q.int()))) <= {-1, 0, 1}


@pytest.mark.parametrize("bits", [8, 4])
def test_per_channel_stats_scale_is_max_abs_over_int_max(bits):
    layer = qnn.QuantConv2d(
        3, 5, 3, weight_quant=quant.Int8WeightPerChannelFloat, weight_bit_width=bits
    )
    w = _w(layer)
    scale = np.abs(w).max(axis=(1, 2, 3), keepdims=True) / (2 ** (bits - 1) - 1)
    q = layer.quant_weight()
    np.testing.assert_allclose(np.asarray(q.scale), scale, rtol=1e-6)
    codes = np.clip(np.round(w / scale), -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1)
    np.testing.assert_array_equal(np.asarray(q.int()), codes)


def test_power_of_two_scale():
    layer = qnn.QuantLinear(8, 4, weight_quant=quant.Int8WeightPerTensorFixedPoint)
    m = np.abs(_w(layer)).max()
    want = 2.0 ** np.ceil(np.log2(m)) / 128
    np.testing.assert_allclose(np.asarray(layer.quant_weight().scale).ravel(), [want], rtol=1e-7)


def test_per_group_scale():
    layer = qnn.QuantLinear(64, 3, weight_quant=quant.Int4WeightPerGroupFloat)
    w = _w(layer).reshape(3, 2, 32)
    scale = np.abs(w).max(axis=2) / 7
    np.testing.assert_allclose(np.asarray(layer.quant_weight().scale), scale, rtol=1e-6)
    with pytest.raises(ValueError, match="group_size=32 must divide"):
        qnn.QuantLinear(48, 3, weight_quant=quant.Int4WeightPerGroupFloat)(jnp.ones((1, 48)))


def test_fp8_weights_are_representable():
    layer = qnn.QuantLinear(32, 4, weight_quant=quant.Fp8e4m3WeightPerTensorFloat)
    q = layer.quant_weight()
    scale = np.abs(_w(layer)).max() / 448
    np.testing.assert_allclose(np.asarray(q.scale).ravel(), [scale], rtol=1e-6)
    scaled = np.asarray(q.value, np.float32) / np.float32(scale)
    # e4m3 steps are >= 6% apart: within 1e-6 means on the grid (up to f32 division).
    on_grid = scaled.astype(jnp.float8_e4m3fn).astype(np.float32)
    np.testing.assert_allclose(scaled, on_grid, rtol=1e-6)


def test_max_initialised_learned_scale_follows_loaded_weights(monkeypatch):
    layer = qnn.QuantConv2d(2, 4, 3, weight_quant=quant.Int8WeightPerChannelFloatLSQ)
    np.testing.assert_allclose(
        scale_threshold(layer.weight_quant).ravel(),
        np.abs(_w(layer)).max(axis=(1, 2, 3)),
        rtol=1e-6,
    )
    new = np.random.default_rng(0).normal(size=(4, 2, 3, 3)).astype(np.float32) * 3
    ckpt = {"weight": new, "bias": np.zeros(4, np.float32)}
    monkeypatch.setattr(qtorchlike.config, "IGNORE_MISSING_KEYS", True)
    layer.load_state_dict(ckpt)
    np.testing.assert_allclose(
        scale_threshold(layer.weight_quant).ravel(), np.abs(new).max(axis=(1, 2, 3)), rtol=1e-6
    )
    # A checkpoint that carries the scale keeps it.
    stored = np.full((4, 1, 1, 1), 0.5, np.float32)
    layer.load_state_dict({**ckpt, "weight_quant.value": stored})
    np.testing.assert_array_equal(np.asarray(layer.weight_quant.value), stored)
    # With re-initialisation off, new weights leave the scale alone.
    monkeypatch.setattr(qtorchlike.config, "REINIT_ON_STATE_DICT_LOAD", False)
    layer.load_state_dict({"weight": new * 2, "bias": ckpt["bias"]})
    np.testing.assert_array_equal(np.asarray(layer.weight_quant.value), stored)


class MeanAbsShared(quant.Int8WeightPerTensorFloat):
    scaling_stats_op = StatsOp.AVE


def test_shared_proxy_scale_is_the_mean_over_both_layers():
    a = qnn.QuantLinear(4, 3, weight_quant=MeanAbsShared)
    b = qnn.QuantLinear(5, 2, weight_quant=a.weight_quant)
    assert a.weight_quant is b.weight_quant
    both = np.concatenate([_w(a).ravel(), _w(b).ravel()])
    want = np.abs(both).mean() / 127
    for layer in (a, b):
        np.testing.assert_allclose(
            np.asarray(layer.quant_weight().scale).ravel(), [want], rtol=1e-6
        )
    # A learned shared scale is re-initialised over every tracked weight.
    c = qnn.QuantLinear(
        4, 3, weight_quant=MeanAbsShared.let(scaling_impl_type="parameter_from_stats")
    )
    d = qnn.QuantLinear(6, 3, weight_quant=c.weight_quant)
    both = np.concatenate([_w(c).ravel(), _w(d).ravel()])
    np.testing.assert_allclose(
        scale_threshold(d.weight_quant).ravel(), [np.abs(both).mean()], rtol=1e-6
    )
    assert [n for n, _ in qnn.Sequential(c, d).named_parameters()].count(
        "0.weight_quant.value"
    ) == 1


def test_bias_scale_is_input_scale_times_weight_scale():
    layer = qnn.QuantLinear(
        4,
        3,
        weight_quant=quant.Int8WeightPerChannelFloat,
        bias_quant=quant.Int32Bias,
        input_quant=quant.Int8ActPerTensorFloat,
        return_quant_tensor=True,
    )
    x = jax.random.normal(jax.random.key(0), (8, 4))
    y = layer(x)
    x_scale = nearest_rank(np.abs(np.asarray(x, np.float64))) / 128
    w_scale = np.abs(_w(layer)).max(axis=1) / 127
    np.testing.assert_allclose(np.asarray(y.scale).ravel(), x_scale * w_scale, rtol=1e-5)
    bias_q = layer.bias_quant(
        layer.bias, jnp.asarray(x_scale, jnp.float32), jnp.asarray(w_scale, jnp.float32)
    )
    np.testing.assert_allclose(
        np.asarray(bias_q.value),
        np.round(np.asarray(layer.bias) / (x_scale * w_scale)) * x_scale * w_scale,
        rtol=1e-5,
    )
    assert y.is_valid
    no_input = qnn.QuantLinear(4, 3, bias_quant=quant.Int32Bias)
    with pytest.raises(ValueError, match="needs the input's scale.*set input_quant"):
        no_input(x)


def _act_state(proxy):
    return {k: v for k, v in proxy.state_dict().items()}


def test_activation_scale_collection_phase_and_handover_under_jit():
    ident = qnn.QuantIdentity(collect_stats_steps=3, return_quant_tensor=True)
    proxy = ident.act_quant
    step = jax.jit(lambda s, x: functional_call(ident, s, x))
    xs = [jax.random.normal(jax.random.key(i), (64,)) * (i + 1) for i in range(5)]
    stats = [nearest_rank(np.abs(np.asarray(x, np.float64))) for x in xs]
    running = None
    for i, x in enumerate(xs):
        out, new = step(ident.state_dict(), x)
        ident.load_state_dict({**ident.state_dict(), **new})
        if i < 3:  # batch statistic; EMA with momentum 0.1 accumulates
            running = stats[0] if i == 0 else 0.9 * running + 0.1 * stats[i]
            np.testing.assert_allclose(np.asarray(out.scale).ravel(), [stats[i] / 128], rtol=1e-5)
        else:  # the learned value took the running statistic at the handover
            np.testing.assert_allclose(np.asarray(out.scale).ravel(), [running / 128], rtol=1e-5)
        np.testing.assert_allclose(float(proxy.running), running, rtol=1e-5)
    assert int(proxy.counter) == 3
    np.testing.assert_allclose(float(proxy.value), running, rtol=1e-5)


def test_unsigned_activation_and_empty_statistics_warning():
    relu = qnn.QuantReLU(return_quant_tensor=True)
    x = jax.random.normal(jax.random.key(0), (256,))
    out = relu(x)
    want = nearest_rank(np.abs(np.maximum(np.asarray(x, np.float64), 0))) / 255
    np.testing.assert_allclose(np.asarray(out.scale).ravel(), [want], rtol=1e-5)
    assert not out.signed and out.is_valid
    fresh = qnn.QuantReLU().eval()
    with pytest.warns(UserWarning, match="has seen no statistics yet"):
        fresh(x)


def test_hardtanh_needs_bounds_and_starts_at_them():
    with pytest.raises(TypeError, match="min_val= and max_val="):
        qnn.QuantHardTanh()
    ht = qnn.QuantHardTanh(min_val=-2.0, max_val=2.0, return_quant_tensor=True)
    out = ht(jnp.linspace(-3.0, 3.0, 13))
    np.testing.assert_allclose(np.asarray(out.scale).ravel(), [2 / 128], rtol=1e-6)
    assert float(out.value.max()) == pytest.approx(127 * 2 / 128)


def test_binary_quantizer_without_sign_is_not_valid():
    class NoSign(ExtendedInjector):
        quant_type = "binary"
        scaling_impl_type = ScalingImplType.CONST
        scaling_const = 0.1

    layer = qnn.QuantLinear(4, 2, weight_quant=NoSign)
    q = layer.quant_weight()
    assert not q.is_valid
    with pytest.raises(ValueError, match="signedness is unknown"):
        q.int()
    assert qnn.QuantLinear(4, 2, weight_quant=NoSign, weight_signed=True).quant_weight().is_valid


def test_unprefixed_layer_kwargs_are_an_error():
    with pytest.raises(
        TypeError, match="unexpected keyword argument 'bit_width'.*weight_<attribute>"
    ):
        qnn.QuantLinear(4, 2, bit_width=4)
    with pytest.raises(TypeError, match="must be a quantizer class"):
        qnn.QuantLinear(4, 2, weight_quant="int8")
    shared = qnn.QuantLinear(4, 2)
    with pytest.raises(TypeError, match="shared proxy"):
        qnn.QuantLinear(4, 2, weight_quant=shared.weight_quant, weight_bit_width=4)

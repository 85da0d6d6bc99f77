"""Brevitas' shifted (zero-point) and MSE quantizers, against float64 references.

The references (shifted_mse_reference.py, NumPy only) implement Brevitas 0.13.4's
documented rules, and were checked against Brevitas 0.13.4 itself (torch CPU) by
running both on exactly these inputs: every scale agreed to 1.3e-7 relative, every
zero point exactly, every value to 1.7e-6 absolute (float32 against float64). The
Brevitas numbers are not stored here: the references stand in for them.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import shifted_mse_reference as ref

import qtorchlike
import qtorchlike.nn as qnn
from qtorchlike import quant
from qtorchlike.func import functional_call
from qtorchlike.nn.module import set_state

NEW_QUANTIZERS = [
    "ShiftedUint8ActPerTensorFloat",
    "ShiftedUint8ActPerTensorFixedPoint",
    "ShiftedUint8WeightPerTensorFloat",
    "ShiftedUint8WeightPerChannelFloat",
    "Int8WeightPerTensorFloatMSE",
    "Int8WeightPerChannelFloatMSE",
    "Int8ActPerTensorFloatMSE",
    "Uint8ActPerTensorFloatMSE",
    "ShiftedUint8ActPerTensorFloatMSE",
    "ShiftedUint8WeightPerTensorFloatMSE",
    "ShiftedUint8WeightPerChannelFloatMSE",
]
MIXINS = [
    "ShiftedMinUintQuant",
    "ShiftedParamFromPercentileUintQuant",
    "MinMaxStatsScaling",
    "ParamFromRuntimePercentileIntervalScaling",
    "MSESymmetricScale",
    "MSEAsymmetricScale",
    "MSEWeightZeroPoint",
    "MSEActZeroPoint",
]


def test_every_new_quantizer_and_mixin_is_exported():
    for name in NEW_QUANTIZERS + MIXINS:
        assert name in quant.__all__, name
        assert isinstance(getattr(quant, name), type)


def _layer(kind, q, bits):
    w = ref.weight(kind)
    if kind == "conv":
        layer = qnn.QuantConv2d(8, 16, 3, bias=False, weight_quant=q, weight_bit_width=bits)
    else:
        layer = qnn.QuantLinear(20, 12, bias=False, weight_quant=q, weight_bit_width=bits)
    layer.weight = jnp.asarray(w)
    proxy = layer.weight_quant
    assert proxy is not None
    if proxy.spec.scaling.value == "parameter_from_stats":
        proxy.init_scale()  # learned (MSE) scales start from the new weight
    return layer, w


def _weight_reference(name, w, bits):
    per_channel = "PerChannel" in name
    if name.startswith("ShiftedUint8Weight") and "MSE" not in name:
        return ref.shifted_weight(w, per_channel, bits)
    if name.startswith("Shifted"):
        return ref.shifted_mse_weight(w, per_channel, bits)
    value, scale = ref.mse_weight(w, per_channel, bits)
    return value, scale, None


@pytest.mark.parametrize("kind", ["conv", "linear"])
@pytest.mark.parametrize("name, bits", ref.WEIGHT_CASES)
def test_weight_quantizer_matches_brevitas(name, bits, kind):
    layer, w = _layer(kind, getattr(quant, name), bits)
    want_value, want_scale, want_zp = _weight_reference(name, w, bits)
    shifted = want_zp is not None
    per_channel = "PerChannel" in name
    scale_shape = (w.shape[0],) + (1,) * (w.ndim - 1) if per_channel else ()
    for _ in range(2):  # train, then eval: weights quantize the same way
        q = layer.quant_weight()
        assert q.scale.shape == scale_shape
        # Brevitas: a shifted zero point has the scale's shape, a zero one is 0-d.
        assert q.zero_point.shape == (scale_shape if shifted else ())
        assert q.bit_width.shape == () and float(q.bit_width) == bits
        assert q.signed is (not shifted)
        np.testing.assert_allclose(np.asarray(q.scale).ravel(), want_scale.ravel(), rtol=2e-6)
        if shifted:
            np.testing.assert_array_equal(np.asarray(q.zero_point).ravel(), want_zp.ravel())
        else:
            assert float(q.zero_point) == 0.0
        step = want_scale.reshape(scale_shape) if per_channel else float(want_scale[0, 0])
        assert np.all(np.abs(np.asarray(q.value, np.float64) - want_value) <= 1e-3 * step)
        assert q.is_valid
        codes = np.asarray(q.int())
        assert codes.dtype == (np.uint8 if shifted else np.int8)
        lo, hi = (0, 2**bits - 1) if shifted else (-(2 ** (bits - 1)) + 1, 2 ** (bits - 1) - 1)
        assert codes.min() >= lo and codes.max() <= hi
        layer.eval()


def test_mse_weight_search_clips_low_bit_channels():
    # The heavy-tailed 4-bit weights are where the search clips (< max|w|): the test
    # data would not tell MSE from max otherwise.
    w = ref.weight("conv")
    _, scale = ref.mse_weight(w, True, 4)
    clipped = scale.ravel() * 7 < np.abs(w).reshape(16, -1).max(axis=1) * (1 - 1e-6)
    assert clipped.sum() >= 4
    layer, _ = _layer("conv", quant.Int8WeightPerChannelFloatMSE, 4)
    np.testing.assert_allclose(
        np.asarray(layer.quant_weight().scale).ravel(), scale.ravel(), rtol=2e-6
    )


def _act_reference(name, steps, bits):
    kind = "interval"
    if "MSE" in name:
        kind = "shifted_mse" if name.startswith("Shifted") else "mse"
    return ref.RuntimeAct(kind, name.startswith("Int8"), steps, bits, pot="FixedPoint" in name)


@pytest.mark.parametrize("name, layer_kind, steps, bits", ref.ACT_CASES)
def test_activation_quantizer_matches_brevitas_through_training_and_eval(
    name, layer_kind, steps, bits
):
    cls = qnn.QuantReLU if layer_kind == "relu" else qnn.QuantIdentity
    act = cls(
        act_quant=getattr(quant, name),
        collect_stats_steps=steps,
        bit_width=bits,
        return_quant_tensor=True,
    )
    want = _act_reference(name, steps, bits)
    shifted = name.startswith("Shifted")
    xs = ref.act_batches(layer_kind)
    for i, x in enumerate(xs):
        training = i < len(xs) - 1
        act.train(training)
        q = act(jnp.asarray(x))
        value, scale, zp = want(np.maximum(x, 0) if layer_kind == "relu" else x, training)
        where = f"call {i} ({'train' if training else 'eval'})"
        assert q.scale.shape == () and q.zero_point.shape == () and q.bit_width.shape == ()
        assert float(q.bit_width) == bits and q.training is training
        np.testing.assert_allclose(float(q.scale), scale, rtol=2e-6, err_msg=where)
        assert float(q.zero_point) == zp, where
        assert np.all(np.abs(np.asarray(q.value, np.float64) - value) <= 1e-3 * scale), where
        assert q.is_valid, where
        codes = np.asarray(q.int())
        assert codes.dtype == (np.int8 if name.startswith("Int8") else np.uint8)
        if shifted:
            assert codes.min() >= 0 and codes.max() <= 2**bits - 1
    sd = act.state_dict()
    np.testing.assert_allclose(
        float(jnp.exp2(sd["act_quant.value"]) if "FixedPoint" in name else sd["act_quant.value"]),
        want.buffer,
        rtol=2e-6,
    )
    if shifted:  # the learned zero point is Brevitas' statistic (<= 0), not the integer
        np.testing.assert_allclose(
            float(sd["act_quant.zero_point_value"]), want.zp_buffer, rtol=2e-6
        )


def test_shifted_activation_identity_case_has_a_nonzero_zero_point():
    # The identity inputs reach below zero: the zero point really shifts the grid.
    want = ref.RuntimeAct("interval", False, 3)
    zps = [want(x, True)[2] for x in ref.act_batches("identity")[:3]]
    assert min(zps) > 0


def _chain():
    w = ref.weight("linear")
    act = qnn.QuantIdentity(
        act_quant=quant.ShiftedUint8ActPerTensorFloat,
        collect_stats_steps=2,
        return_quant_tensor=True,
    )
    lin = qnn.QuantLinear(20, 12, bias=True)
    lin.weight, lin.bias = jnp.asarray(w), jnp.asarray(ref.bias())
    return qnn.Sequential(act, lin)


def test_shifted_activation_feeding_a_quant_linear_gives_the_float64_result():
    model = _chain()
    batches = ref.linear_batches()
    for x in batches[:3]:
        model(jnp.asarray(x))
    model.eval()
    x = batches[3]
    qa = model[0](jnp.asarray(x))
    assert float(qa.zero_point) > 0 and qa.is_valid
    codes = np.asarray(qa.int())
    assert codes.dtype == np.uint8 and codes.min() >= 0 and codes.max() <= 255
    # float64: (codes - zp) * scale against the quantized weight, plus the bias
    xa = (codes.astype(np.float64) - float(qa.zero_point)) * float(qa.scale)
    wq = model[1].quant_weight()
    wv = np.asarray(wq.int(), np.float64) * float(wq.scale)
    want = xa @ wv.T + np.asarray(ref.bias(), np.float64)
    y = np.asarray(model(jnp.asarray(x)), np.float64)
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-5)
    # the same under jax.jit
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    jitted = jax.jit(lambda s, v: functional_call(model, s, v)[0])(state, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(jitted, np.float64), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("training", [False, True])
def test_layer_with_own_shifted_input_quant_takes_the_float_path(training):
    # The integer fast path (_int_op) multiplies codes and would ignore the zero point.
    lin = qnn.QuantLinear(
        20,
        12,
        bias=False,
        input_quant=quant.ShiftedUint8ActPerTensorFloat,
        input_collect_stats_steps=1,
    )
    lin.weight = jnp.asarray(ref.weight("linear"))
    x = jnp.asarray(ref.linear_batches()[0])
    lin(x)  # collects the statistics (one step), then learned
    lin.train(training)
    assert lin.input_quant is not None
    qa = lin.input_quant(x)
    assert float(qa.zero_point) > 0
    want = np.asarray(qa.value, np.float64) @ np.asarray(lin.quant_weight().value, np.float64).T
    np.testing.assert_allclose(np.asarray(lin(x), np.float64), want, rtol=0, atol=2e-5)


def test_layer_fed_a_zero_point_cannot_return_a_quant_tensor():
    # Brevitas raises too ("Computing zero point of output accumulator not supported yet").
    model = _chain()
    model[1].return_quant_tensor = True
    with pytest.raises(
        ValueError, match=r"zero point.*ShiftedUint8ActPerTensorFloat|zero point.*output_quant"
    ):
        model(jnp.asarray(ref.linear_batches()[0]))


def test_shifted_weight_layer_output_is_float_and_correct():
    lin = qnn.QuantLinear(
        20,
        12,
        bias=False,
        weight_quant=quant.ShiftedUint8WeightPerChannelFloat,
        input_quant=quant.Int8ActPerTensorFloat,
        input_collect_stats_steps=1,
    )
    lin.weight = jnp.asarray(ref.weight("linear"))
    x = jnp.asarray(ref.linear_batches()[0])
    lin(x)
    lin.eval()
    assert lin.input_quant is not None
    qa, wq = lin.input_quant(x), lin.quant_weight()
    want = np.asarray(qa.value, np.float64) @ np.asarray(wq.value, np.float64).T
    np.testing.assert_allclose(np.asarray(lin(x), np.float64), want, rtol=0, atol=2e-5)


def test_integer_state_dict_carries_the_zero_points():
    model = qnn.Sequential(
        qnn.QuantIdentity(act_quant=quant.ShiftedUint8ActPerTensorFloat, collect_stats_steps=2),
        qnn.QuantLinear(20, 12, bias=False, weight_quant=quant.ShiftedUint8WeightPerChannelFloat),
    )
    model[1].weight = jnp.asarray(ref.weight("linear"))
    for x in ref.linear_batches()[:3]:
        model(jnp.asarray(x))
    model.eval()
    sd = qtorchlike.integer_state_dict(model)
    w = sd["1"]
    assert w["weight_int"].dtype == np.uint8 and w["weight_zero_point"].shape == (12, 1)
    deq = (w["weight_int"].astype(np.float64) - w["weight_zero_point"]) * w["weight_scale"]
    np.testing.assert_allclose(deq, np.asarray(model[1].quant_weight().value), rtol=0, atol=1e-7)
    qa = model[0].act_quant(jnp.asarray(ref.linear_batches()[3]))
    a = sd["0"]
    assert float(a["act_zero_point"]) == float(qa.zero_point) > 0
    assert float(a["act_scale"]) == float(qa.scale)


def test_export_tflite_refuses_zero_points_naming_layer_and_quantizer(monkeypatch):
    # The refusal comes before qlitert is needed: without it the test runs the same.
    monkeypatch.setitem(sys.modules, "qlitert", None)
    model = _chain()
    for x in ref.linear_batches()[:3]:
        model(jnp.asarray(x))
    with pytest.raises(ValueError, match=r"'0'.*ShiftedUint8ActPerTensorFloat.*zero point"):
        qtorchlike.export_tflite(model, ref.linear_batches()[0])
    lin = qnn.Sequential(
        qnn.QuantLinear(20, 12, weight_quant=quant.ShiftedUint8WeightPerTensorFloat)
    )
    with pytest.raises(ValueError, match=r"'0'.*ShiftedUint8WeightPerTensorFloat.*zero point"):
        qtorchlike.export_tflite(lin, ref.linear_batches()[0])


def test_shifted_activation_trains_under_jit_like_eager():
    # Two copies: one stepped eagerly, one through a jitted functional call; the zero
    # point's statistics, hand-over and learned value follow the same path.
    def make():
        return qnn.QuantIdentity(
            act_quant=quant.ShiftedUint8ActPerTensorFloatMSE,
            collect_stats_steps=2,
            return_quant_tensor=True,
        )

    eager, traced = make(), make()
    step = jax.jit(lambda s, v: functional_call(traced, s, v))
    for x in ref.act_batches("identity")[:4]:
        want = eager(jnp.asarray(x))
        state = {**dict(traced.named_parameters()), **dict(traced.named_buffers())}
        got, new_state = step(state, jnp.asarray(x))
        set_state(traced, new_state)
        assert float(got.zero_point) == float(want.zero_point)
        np.testing.assert_allclose(float(got.scale), float(want.scale), rtol=1e-6)


def test_unsupported_mse_and_zero_point_settings_are_refused():
    from qtorchlike.solver import solve

    with pytest.raises(ValueError, match="mse_search_method"):
        solve(quant.Int8WeightPerTensorFloatMSE.let(mse_search_method="fibonacci"))
    with pytest.raises(ValueError, match="quantize_zero_point"):
        solve(quant.ShiftedUint8WeightPerTensorFloat.let(quantize_zero_point=False))
    with pytest.raises(ValueError, match="signed"):
        solve(quant.ShiftedUint8WeightPerTensorFloat.let(signed=True))
    with pytest.raises(ValueError, match="power"):
        solve(quant.Int8WeightPerTensorFixedPoint.let(scaling_stats_impl=qtorchlike.core.MSE))

"""calibration_mode, bias_correction_mode, disable_quant (and integer_state_dict) against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import nearest_rank

import qtorchlike
import qtorchlike.nn as qnn
from qtorchlike.func import functional_call, static_key
from qtorchlike.modes import jit_forward
from qtorchlike.nn.module import set_state
from qtorchlike.quant import (
    Int8ActPerTensorFloat,
    Int8WeightPerChannelFloat,
    Int32Bias,
    Uint8ActPerTensorFloat,
)

Q = 99.999


def batches(n=4, shape=(32, 6), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(0.3, 1.0 + i, size=shape).astype(np.float32) for i in range(n)]


def mlp():
    """identity (int8 act) -> linear -> relu (uint8 act) -> linear."""
    qtorchlike.manual_seed(0)
    return qnn.Sequential(
        qnn.QuantIdentity(),
        qnn.QuantLinear(6, 8, bias=True),
        qnn.QuantReLU(),
        qnn.QuantLinear(8, 3, bias=True, weight_quant=Int8WeightPerChannelFloat),
    )


def float_mlp(model, x):
    """The same network in numpy, float64, from the model's weights."""
    p = {k: np.asarray(v, np.float64) for k, v in model.state_dict().items()}
    h = np.maximum(x @ p["1.weight"].T + p["1.bias"], 0.0)
    return h @ p["3.weight"].T + p["3.bias"], h


def switches(model):
    """Every mode and quantizer switch of the model."""
    out = {}
    for name, m in model.named_modules():
        out[name, "training"] = m.training
        for attr in ("enabled", "calibrating", "return_quant_tensor"):
            if attr in m.__dict__:
                out[name, attr] = m.__dict__[attr]
    return out


def expected_thresholds(model, xs):
    """Mean over batches of each batch's 99.999th percentile (nearest rank), in numpy."""
    ident, relu = [], []
    for x in xs:
        _, h = float_mlp(model, x.astype(np.float64))
        ident.append(nearest_rank(x, Q))
        relu.append(nearest_rank(h, Q))
    return np.mean(ident), np.mean(relu)


# -- calibration_mode ----------------------------------------------------------------------


def test_activation_percentile_is_brevitas_nearest_rank_not_interpolated():
    # Heavy tails put the two largest order statistics far apart, so interpolating
    # (numpy's default) and Brevitas' nearest rank differ by a lot.
    x = np.random.default_rng(1).standard_t(2, size=(16, 4096)).astype(np.float32)
    ident = qnn.QuantIdentity(return_quant_tensor=True)
    out = ident(jnp.asarray(x))
    want = nearest_rank(x, Q)
    assert abs(np.percentile(np.abs(x), Q) - want) > 1e-3 * want  # the two rules differ here
    np.testing.assert_allclose(float(out.scale) * 128, want, rtol=1e-6)


@pytest.mark.parametrize("run", ["eager", "jit_forward"])
def test_calibration_threshold_is_the_mean_of_per_batch_percentiles(run):
    model = mlp().eval()
    xs = batches()
    before = switches(model)
    with qtorchlike.calibration_mode(model) as forward:
        for x in xs:
            out = model(x) if run == "eager" else forward(x)
            want, _ = float_mlp(model, x.astype(np.float64))
            # Inside the block the model computes in float.
            np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    ident, relu = expected_thresholds(model, xs)
    np.testing.assert_allclose(float(model[0].act_quant.value), ident, rtol=1e-6)
    np.testing.assert_allclose(float(model[2].act_quant.value), relu, rtol=1e-5)
    assert int(model[0].act_quant.counter) == Int8ActPerTensorFloat.collect_stats_steps
    assert switches(model) == before


def test_calibration_in_training_mode_keeps_the_mode_and_uses_the_calibrated_scale():
    model = mlp()  # training mode
    xs = batches()
    with qtorchlike.calibration_mode(model):
        for x in xs:
            model(x)
    assert all(m.training for m in model.modules())
    ident, _ = expected_thresholds(model, xs)
    # The statistics phase is over: training calls use the learned value, unchanged.
    model(xs[0])
    np.testing.assert_allclose(float(model[0].act_quant.value), ident, rtol=1e-6)


def test_after_calibration_the_forward_is_quantized_on_the_calibrated_grid():
    model = mlp().eval()
    xs = batches()
    with qtorchlike.calibration_mode(model):
        for x in xs:
            model(x)
    model[0].return_quant_tensor = True
    q = model[0](xs[0])
    ident, _ = expected_thresholds(model, xs)
    np.testing.assert_allclose(float(q.scale.reshape(())), ident / 128, rtol=1e-6)
    assert q.is_valid
    out = np.asarray(model(xs[0]))
    want, _ = float_mlp(model, xs[0].astype(np.float64))
    err = np.abs(out - want)
    assert err.max() > 1e-4  # quantized, not float
    assert err.max() < 0.1 * np.abs(want).max()


def test_calibration_through_a_hand_written_jitted_functional_call():
    model = mlp().eval()
    xs = batches()

    def run(key, state, x):
        return functional_call(model, state, x)

    step = jax.jit(run, static_argnums=0)
    with qtorchlike.calibration_mode(model):
        for x in xs:
            state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            _, new_state = step(static_key(model), state, x)
            set_state(model, new_state)  # the documented write-back
    ident, relu = expected_thresholds(model, xs)
    np.testing.assert_allclose(float(model[0].act_quant.value), ident, rtol=1e-6)
    np.testing.assert_allclose(float(model[2].act_quant.value), relu, rtol=1e-5)


def test_static_key_differs_inside_calibration_mode():
    model = mlp().eval()
    key = static_key(model)
    with pytest.warns(UserWarning, match="saw no batch"), qtorchlike.calibration_mode(model):
        assert static_key(model) != key
    assert static_key(model) == key


def test_return_quant_tensor_layers_calibrate_and_come_back():
    model = qnn.Sequential(
        qnn.QuantIdentity(return_quant_tensor=True),
        qnn.QuantLinear(6, 3, input_quant=None, bias_quant=None),
    )
    with qtorchlike.calibration_mode(model):
        y = model[0](batches()[0])
        assert not isinstance(y, qtorchlike.QuantTensor)
    assert model[0].return_quant_tensor
    assert isinstance(model.eval()[0](batches()[0]), qtorchlike.QuantTensor)


def test_an_exception_inside_calibration_mode_restores_switches_and_statistics():
    model = mlp().eval()
    with qtorchlike.calibration_mode(model):
        model(batches()[0])
    before_switches = switches(model)
    before_state = {k: np.asarray(v) for k, v in model.state_dict().items()}
    with pytest.raises(ZeroDivisionError), qtorchlike.calibration_mode(model):
        model(batches(seed=5)[1])
        model.train()
        1 / 0  # noqa: B018
    assert switches(model) == before_switches
    after = {k: np.asarray(v) for k, v in model.state_dict().items()}
    assert after.keys() == before_state.keys()
    for k in after:
        np.testing.assert_array_equal(after[k], before_state[k], err_msg=k)


class WithUnusedBranch(qnn.Module):
    def __init__(self):
        super().__init__()
        self.main = mlp()
        self.side = qnn.QuantIdentity()

    def forward(self, x):
        return self.main(x)


def test_a_quantizer_that_sees_no_batch_keeps_its_scale_with_a_warning():
    model = WithUnusedBranch().eval()
    unused = model.side.act_quant
    value = np.asarray(unused.value)
    warning = pytest.warns(UserWarning, match=r"'side.act_quant'.*saw no batch")
    with warning, qtorchlike.calibration_mode(model):
        model(batches()[0])
    np.testing.assert_array_equal(np.asarray(unused.value), value)
    assert int(unused.counter) == 0
    assert int(model.main[0].act_quant.counter) == Int8ActPerTensorFloat.collect_stats_steps


def test_modes_reject_a_non_module():
    for mode in (
        qtorchlike.calibration_mode,
        qtorchlike.bias_correction_mode,
        qtorchlike.disable_quant,
    ):
        with (
            pytest.raises(TypeError, match="model must be a qtorchlike.nn.Module"),
            mode(lambda x: x),
        ):
            pass


# -- disable_quant ----------------------------------------------------------------------------


def test_disable_quant_equals_the_float_model_and_restores():
    model = mlp().eval()
    xs = batches()
    with qtorchlike.calibration_mode(model):
        for x in xs:
            model(x)
    before = switches(model)
    quantized = np.asarray(model(xs[1]))
    with qtorchlike.disable_quant(model):
        out = np.asarray(model(xs[1]))
    want, _ = float_mlp(model, xs[1].astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert switches(model) == before
    np.testing.assert_array_equal(np.asarray(model(xs[1])), quantized)


def test_disable_quant_restores_on_an_exception():
    model = mlp()
    before = switches(model)
    with pytest.raises(RuntimeError, match="boom"), qtorchlike.disable_quant(model):
        raise RuntimeError("boom")
    assert switches(model) == before


# -- bias_correction_mode ------------------------------------------------------------------


def three_bit_linear(bias=True):
    qtorchlike.manual_seed(3)
    return qnn.QuantLinear(12, 5, bias=bias, weight_bit_width=3).eval()


def numpy_three_bit(w):
    """Int8WeightPerTensorFloat at 3 bits: narrow range [-3, 3], scale max|w| / 3."""
    w = np.asarray(w, np.float64)
    s = np.max(np.abs(w)) / 3
    return np.clip(np.round(w / s), -3, 3) * s


@pytest.mark.parametrize("bias", [True, False])
def test_bias_correction_equals_the_mean_output_error_and_removes_it(bias):
    layer = three_bit_linear(bias)
    rng = np.random.default_rng(0)
    xs = [rng.normal(1.0, 1.0, size=(512, 12)).astype(np.float32) for _ in range(3)]
    w = np.asarray(layer.weight, np.float64)
    wq = numpy_three_bit(w)
    np.testing.assert_allclose(np.asarray(layer.quant_weight().value), wq, rtol=1e-6)
    # Per batch: mean over the batch of (float - quantized) per output; then over batches.
    want = np.mean([np.mean(x @ (w - wq).T, axis=0) for x in xs], axis=0)
    b0 = np.asarray(layer.bias, np.float64) if bias else np.zeros(5)
    test = rng.normal(1.0, 1.0, size=(2048, 12)).astype(np.float32)
    err_before = np.abs(np.mean(test @ (w - wq).T, axis=0))
    with qtorchlike.bias_correction_mode(layer):
        for x in xs:
            out = np.asarray(layer(x))
            # The float output is passed on.
            np.testing.assert_allclose(out, x @ w.T + b0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(layer.bias) - b0, want, rtol=1e-4, atol=1e-6)
    assert layer.trainable_names() == ["weight", "bias"]
    with qtorchlike.disable_quant(layer):
        ref = np.asarray(layer(test)) - (np.asarray(layer.bias) - b0)  # the original float layer
    err_after = np.abs(np.mean(ref - np.asarray(layer(test)), axis=0))
    assert err_before.mean() > 0.03
    assert err_after.mean() < 0.25 * err_before.mean()


def test_bias_correction_skip_if_no_bias():
    layer = three_bit_linear(bias=False)
    with qtorchlike.bias_correction_mode(layer, skip_if_no_bias=True):
        layer(np.ones((4, 12), np.float32))
    assert layer.bias is None


def test_bias_correction_rejects_a_non_bool_skip_if_no_bias():
    model = three_bit_linear()
    with (
        pytest.raises(TypeError, match=r"skip_if_no_bias='yes'\): must be True or False"),
        qtorchlike.bias_correction_mode(model, skip_if_no_bias="yes"),
    ):
        pass


def test_bias_correction_per_channel_on_conv_nchw():
    qtorchlike.manual_seed(1)
    model = qnn.Sequential(
        qnn.QuantConv2d(2, 4, 3, bias=False, weight_bit_width=3),
        qnn.QuantReLU(),
        qnn.QuantConv2d(4, 3, 1, weight_bit_width=3),
    ).eval()
    rng = np.random.default_rng(2)
    xs = [rng.normal(0.5, 1.0, size=(8, 2, 6, 6)).astype(np.float32) for _ in range(2)]
    with qtorchlike.calibration_mode(model):
        for x in xs:
            model(x)
    conv = model[0]
    w = np.asarray(conv.weight)
    wq = np.asarray(conv.quant_weight().value)

    def conv_np(x, k):
        return np.asarray(
            jax.lax.conv_general_dilated(
                jnp.asarray(x), jnp.asarray(k, jnp.float32), (1, 1), "VALID"
            )
        )

    want = np.mean([np.mean(conv_np(x, w) - conv_np(x, wq), axis=(0, 2, 3)) for x in xs], axis=0)
    b2 = np.asarray(model[2].bias)
    with qtorchlike.bias_correction_mode(model):
        for x in xs:
            model(x)
    assert conv.bias.shape == (4,)
    np.testing.assert_allclose(np.asarray(conv.bias), want, rtol=1e-4, atol=1e-6)
    assert not np.allclose(np.asarray(model[2].bias), b2)  # the second conv is corrected too


def test_bias_correction_rejects_a_layer_called_twice_and_changes_nothing():
    layer = qnn.QuantLinear(4, 4, weight_bit_width=3)
    model = qnn.Sequential(layer, qnn.QuantReLU(), layer).eval()
    model[1].act_quant.enabled = False
    bias = np.asarray(layer.bias)
    before = switches(model)
    error = pytest.raises(RuntimeError, match=r"layer '0' \(QuantLinear\) was called more than")
    with error, qtorchlike.bias_correction_mode(model):
        model(np.ones((2, 4), np.float32))
    np.testing.assert_array_equal(np.asarray(layer.bias), bias)
    assert switches(model) == before
    assert not layer._forward_hooks and not model._forward_hooks


def test_bias_correction_measures_without_output_quant_and_restores_on_an_exception():
    qtorchlike.manual_seed(5)
    layer = qnn.QuantLinear(
        4,
        2,
        weight_bit_width=3,
        input_quant=Int8ActPerTensorFloat,
        output_quant=Int8ActPerTensorFloat,
        return_quant_tensor=True,
    )
    x = batches(1, (64, 4))[0]
    with qtorchlike.calibration_mode(layer):
        layer(x)
    layer.eval()
    before = switches(layer)
    bias = np.asarray(layer.bias)
    with pytest.raises(KeyError), qtorchlike.bias_correction_mode(layer):
        y = layer(x)
        # The float output, with the output quantizer's metadata.
        assert isinstance(y, qtorchlike.QuantTensor)
        with qtorchlike.disable_quant(layer):
            np.testing.assert_allclose(np.asarray(y.value), np.asarray(layer(x)), rtol=1e-6)
        raise KeyError("stop")
    assert switches(layer) == before
    np.testing.assert_array_equal(np.asarray(layer.bias), bias)
    # Without the exception: the correction is the mean error before output quantization.
    with qtorchlike.disable_quant(layer):
        ref = np.asarray(layer(x))
    layer.output_quant.enabled = False
    err = np.mean(ref - np.asarray(layer(x).value), axis=0)
    layer.output_quant.enabled = True
    with qtorchlike.bias_correction_mode(layer):
        layer(x)
    np.testing.assert_allclose(np.asarray(layer.bias) - bias, err, rtol=1e-4, atol=1e-7)


def test_bias_correction_under_jit_is_a_clear_error():
    layer = three_bit_linear()
    with qtorchlike.bias_correction_mode(layer), pytest.raises(RuntimeError, match="eagerly"):
        jit_forward(layer)(jnp.ones((2, 12)))


# -- integer_state_dict (export.py) ------------------------------------------------------------


def test_integer_state_dict_codes_times_scale_is_the_fake_quantized_weight():
    model = qnn.Sequential(
        qnn.QuantConv2d(
            1,
            4,
            3,
            weight_quant=Int8WeightPerChannelFloat,
            weight_bit_width=5,
            input_quant=Int8ActPerTensorFloat,
            bias_quant=Int32Bias,
        ),
        qnn.QuantReLU(),
        qnn.Flatten(),
        qnn.QuantLinear(4 * 4 * 4, 3, output_quant=Uint8ActPerTensorFloat),
    )
    x = np.random.default_rng(0).normal(size=(4, 1, 6, 6)).astype(np.float32)
    with qtorchlike.calibration_mode(model):
        model(x)
    sd = qtorchlike.integer_state_dict(model)
    assert set(sd) == {"0", "1", "3"}
    for name, bits in (("0", 5), ("3", 8)):
        layer = model[int(name)]
        e = sd[name]
        assert e["weight_bit_width"] == bits and e["weight_signed"] is True
        codes = e["weight_int"]
        assert np.issubdtype(codes.dtype, np.integer)
        lim = 2 ** (bits - 1) - 1  # narrow range
        assert codes.min() >= -lim and codes.max() <= lim
        assert codes.max() == lim or codes.min() == -lim  # max|w| maps to the end of the range
        w = (codes.astype(np.float32) - e["weight_zero_point"]) * e["weight_scale"]
        np.testing.assert_array_equal(w, np.asarray(layer.quant_weight().value))
    e = sd["0"]
    assert e["input_bit_width"] == 8 and e["input_signed"] is True
    t = float(model[0].input_quant.value)
    np.testing.assert_allclose(e["input_scale"], t / 128, rtol=1e-6)
    # Bias scale = input scale x weight scale; codes int32.
    np.testing.assert_allclose(
        e["bias_scale"].ravel(), (e["input_scale"] * e["weight_scale"]).ravel(), rtol=1e-6
    )
    assert e["bias_int"].dtype == np.int32 and e["bias_bit_width"] == 32
    bias_err = np.abs(e["bias_int"] * e["bias_scale"].ravel() - np.asarray(model[0].bias))
    assert np.all(bias_err <= e["bias_scale"].ravel() / 2 * (1 + 1e-5))
    assert sd["1"]["act_signed"] is False and sd["1"]["act_bit_width"] == 8
    assert set(sd["3"]) >= {"output_scale", "output_zero_point", "output_bit_width"}
    assert "bias_int" not in sd["3"]


def test_integer_state_dict_bias_needing_the_runtime_input_scale():
    model = qnn.Sequential(
        qnn.QuantIdentity(return_quant_tensor=True),
        qnn.QuantLinear(6, 3, bias_quant=Int32Bias),
    )
    x = batches()[0]
    with qtorchlike.calibration_mode(model):
        model(x)
    with pytest.raises(ValueError, match=r"layer '1' has bias_quant=Int32Bias.*example_input"):
        qtorchlike.integer_state_dict(model)
    sd = qtorchlike.integer_state_dict(model, example_input=x)
    s_in = float(sd["0"]["act_scale"])
    want = np.broadcast_to(s_in * sd["1"]["weight_scale"].ravel(), (3,))
    np.testing.assert_allclose(sd["1"]["bias_scale"].ravel(), want, rtol=1e-6)
    assert model.training  # the evaluation pass left the mode alone


def test_bias_correction_keeps_quant_tensors_flowing_to_input_scaled_biases():
    qtorchlike.manual_seed(4)
    model = qnn.Sequential(
        qnn.QuantIdentity(return_quant_tensor=True),
        qnn.QuantLinear(6, 8, weight_bit_width=3, bias_quant=Int32Bias, return_quant_tensor=True),
        qnn.QuantReLU(return_quant_tensor=True),
        qnn.QuantLinear(8, 3, weight_bit_width=3, bias_quant=Int32Bias),
    )
    xs = batches()
    with qtorchlike.calibration_mode(model):
        for x in xs:
            model(x)
    model.eval()
    b1, b3 = np.asarray(model[1].bias), np.asarray(model[3].bias)
    with qtorchlike.bias_correction_mode(model):
        for x in xs:
            model(x)
    assert not np.allclose(np.asarray(model[1].bias), b1)
    assert not np.allclose(np.asarray(model[3].bias), b3)
    assert model[1].return_quant_tensor
    assert isinstance(model[1](model[0](xs[0])), qtorchlike.QuantTensor)


def test_bias_correction_reruns_do_not_count_as_statistics_steps():
    layer = qnn.QuantLinear(4, 2, input_quant=Int8ActPerTensorFloat)  # training mode
    x = batches(1, (8, 4))[0]
    with qtorchlike.bias_correction_mode(layer):
        layer(x)
    assert int(layer.input_quant.counter) == 1  # the forward pass itself, not the re-runs


def test_integer_state_dict_covers_embeddings():
    emb = qnn.QuantEmbedding(10, 4, weight_bit_width=4)
    e = qtorchlike.integer_state_dict(emb)[""]
    assert e["weight_int"].shape == (10, 4) and np.abs(e["weight_int"]).max() == 7
    w = e["weight_int"].astype(np.float32) * e["weight_scale"]
    np.testing.assert_array_equal(w, np.asarray(emb.quant_weight().value))

"""Brevitas 0.13.4's rules that qtorchlike follows, each checked against a float64 reference.

The numbers themselves are compared with real Brevitas' recorded outputs in
test_brevitas_parity.py; these tests pin each rule on its own so a failure says which.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from reference import nearest_rank

import qtorchlike.nn as qnn
from qtorchlike.inject import DependencyError
from qtorchlike.quant import (
    Int8ActPerTensorFixedPoint,
    Int8ActPerTensorFloat,
    Int8WeightPerTensorFloat,
    SignedBinaryWeightPerTensorConst,
    Uint8ActPerTensorFixedPoint,
)

RNG = np.random.default_rng(22)
X = RNG.normal(size=(4, 3, 6, 6)).astype(np.float32)


def test_weight_scaling_per_output_channel_true_makes_a_per_tensor_quantizer_per_channel():
    # Brevitas: the boolean wins over the mixin's scaling_per_output_type.
    conv = qnn.QuantConv2d(
        3, 5, 3, weight_quant=Int8WeightPerTensorFloat, weight_scaling_per_output_channel=True
    )
    w = np.asarray(conv.weight, np.float64)
    want = np.abs(w).reshape(5, -1).max(axis=1).reshape(5, 1, 1, 1) / 127
    np.testing.assert_allclose(np.asarray(conv.quant_weight().scale), want, rtol=1e-6)


def test_scaling_per_output_channel_false_makes_a_per_channel_quantizer_per_tensor():
    lin = qnn.QuantLinear(6, 4, weight_scaling_per_output_channel=False)
    scale = lin.quant_weight().scale
    assert scale.shape == ()
    np.testing.assert_allclose(float(scale), np.abs(np.asarray(lin.weight)).max() / 127, rtol=1e-6)


def test_per_channel_activation_scales_take_each_channels_percentile():
    ident = qnn.QuantIdentity(
        scaling_per_output_channel=True,
        per_channel_broadcastable_shape=(1, 3, 1, 1),
        scaling_stats_permute_dims=(1, 0, 2, 3),
        return_quant_tensor=True,
    )
    out = ident(jnp.asarray(X))
    want = np.array([nearest_rank(X[:, c]) for c in range(3)]).reshape(1, 3, 1, 1) / 128
    np.testing.assert_allclose(np.asarray(out.scale), want, rtol=1e-6)
    codes = np.clip(np.round(X / want), -128, 127)
    np.testing.assert_allclose(np.asarray(out.value), codes * want, rtol=1e-6, atol=1e-7)


def test_per_channel_activation_scaling_without_its_shape_is_refused():
    with pytest.raises(DependencyError, match="per_channel_broadcastable_shape"):
        qnn.QuantIdentity(scaling_per_output_channel=True)
    with pytest.raises(ValueError, match="scaling_stats_permute_dims"):
        qnn.QuantIdentity(
            scaling_per_output_channel=True,
            per_channel_broadcastable_shape=(1, 3, 1, 1),
            scaling_stats_permute_dims=(0, 1, 2, 3),
        )


def test_per_channel_activation_on_an_input_of_another_shape_names_both_shapes():
    ident = qnn.QuantIdentity(
        scaling_per_output_channel=True, per_channel_broadcastable_shape=(1, 4, 1, 1)
    )
    with pytest.raises(ValueError, match=r"\(1, 4, 1, 1\).*\(4, 3, 6, 6\)"):
        ident(jnp.asarray(X))


@pytest.mark.parametrize(
    "quant, raw", [(Int8ActPerTensorFixedPoint, 128), (Uint8ActPerTensorFixedPoint, 256)]
)
def test_fixed_point_activation_scale_is_not_a_power_of_two_while_collecting(quant, raw):
    # Brevitas restricts only the learned value: a collecting batch's scale is its
    # statistic, not rounded to a power of two, over 2^(b-1) (2^b unsigned).
    ident = qnn.QuantIdentity(act_quant=quant, collect_stats_steps=2, return_quant_tensor=True)
    x = np.abs(X) if raw == 256 else X
    first = ident(jnp.asarray(x))
    np.testing.assert_allclose(float(first.scale), nearest_rank(x) / raw, rtol=1e-6)
    ident(jnp.asarray(x))
    learned = float(ident(jnp.asarray(x)).scale)  # the learned value: a power of two
    assert learned == 2.0 ** np.ceil(np.log2(nearest_rank(x))) / raw


def test_scale_and_zero_point_shapes_are_brevitas():
    conv = qnn.QuantConv2d(
        3, 4, 3, bias=False, input_quant=Int8ActPerTensorFloat, return_quant_tensor=True
    )
    lin = qnn.QuantLinear(3, 4, weight_quant=SignedBinaryWeightPerTensorConst)
    y = conv(jnp.asarray(X))
    assert conv.quant_weight().scale.shape == ()  # per tensor: 0-d
    assert lin.quant_weight().scale.shape == (1,)  # a binary constant: (1,)
    assert conv.input_quant(jnp.asarray(X)).scale.shape == ()
    assert (y.scale.shape, y.zero_point.shape) == ((1, 1, 1, 1), (1,))


def test_quant_delay_steps_passes_the_first_calls_through():
    ident = qnn.QuantIdentity(quant_delay_steps=2, return_quant_tensor=True)
    outs = [ident(jnp.asarray(X)) for _ in range(3)]
    np.testing.assert_array_equal(np.asarray(outs[0].value), X)
    np.testing.assert_array_equal(np.asarray(outs[1].value), X)
    assert not np.array_equal(np.asarray(outs[2].value), X)
    assert outs[2].is_valid


def test_const_scaling_from_max_val():
    relu = qnn.QuantReLU(max_val=6.0, scaling_impl_type="CONST", return_quant_tensor=True)
    y = relu(jnp.asarray(X * 4))
    assert float(y.scale) == np.float32(6.0 / 255)
    assert float(y.value.max()) == pytest.approx(6.0, rel=1e-6)


def test_he_scaling_for_weights_and_refused_for_activations():
    conv = qnn.QuantConv2d(3, 4, 3, weight_scaling_impl_type="HE")
    np.testing.assert_allclose(float(conv.quant_weight().scale), np.sqrt(2 / 27) / 127, rtol=1e-6)
    with pytest.raises(ValueError, match="HE is for weights"):
        qnn.QuantReLU(scaling_impl_type="HE")


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: qnn.QuantIdentity(foo_bar=1), ("QuantIdentity()", "'foo_bar'", "act_quant")),
        (
            lambda: qnn.QuantConv2d(1, 2, 3, weight_scaling_foo=1e-3),
            ("QuantConv2d()", "'weight_scaling_foo'", "weight_quant"),
        ),
        (
            lambda: qnn.QuantLinear(2, 2, output_foo=1),
            ("QuantLinear()", "'output_foo'", "output_quant"),
        ),
        (
            lambda: qnn.QuantEltwiseAdd(input_foo=1),
            ("QuantEltwiseAdd()", "'input_foo'", "input_quant"),
        ),
    ],
)
def test_an_unknown_quantizer_keyword_names_the_key_the_quantizer_and_the_layer(build, words):
    with pytest.raises(TypeError) as caught:
        build()
    for word in words:
        assert word in str(caught.value)


@pytest.mark.parametrize(
    "build, words",
    [
        (
            lambda: qnn.QuantIdentity(bit_width_impl_type="parameter"),
            ("QuantIdentity(): act_quant:", "bit_width_impl_type='parameter'", "'const'"),
        ),
        (
            lambda: qnn.QuantConv2d(1, 2, 3, weight_affine_rescaling=True),
            ("QuantConv2d(): weight_quant:", "affine_rescaling=True"),
        ),
        (
            lambda: qnn.QuantLinear(
                2, 2, bias_quant=Int8WeightPerTensorFloat.let(scaling_min_val=-1.0)
            ),
            ("QuantLinear(): bias_quant:", "scaling_min_val=-1.0"),
        ),
    ],
)
def test_a_brevitas_setting_qtorchlike_does_not_implement_is_refused_naming_key_and_layer(
    build, words
):
    with pytest.raises(ValueError) as caught:
        build()
    for word in words:
        assert word in str(caught.value)


def test_scaling_min_val_bounds_the_threshold():
    ident = qnn.QuantIdentity(scaling_min_val=0.5, return_quant_tensor=True)
    assert float(ident(jnp.linspace(-0.1, 0.1, 9)).scale) == 0.5 / 128
    plain = qnn.QuantIdentity(return_quant_tensor=True)
    assert float(plain(jnp.linspace(-0.1, 0.1, 9)).scale) == np.float32(0.1) / 128


def test_weight_quant_delay_steps_passes_the_first_calls_through():
    lin = qnn.QuantLinear(8, 3, weight_quant_delay_steps=2, weight_bit_width=2)
    same = [bool(jnp.all(lin.quant_weight().value == lin.weight)) for _ in range(3)]
    assert same == [True, True, False]


def test_const_scaling_takes_scaling_init_and_says_what_it_needs():
    ident = qnn.QuantIdentity(scaling_impl_type="const", scaling_init=0.5, return_quant_tensor=True)
    assert float(ident(jnp.ones(3)).scale) == 0.5 / 128
    lin = qnn.QuantLinear(3, 2, weight_scaling_impl_type="const", weight_scaling_init=0.05)
    assert float(lin.quant_weight().scale) == np.float32(0.05 / 127)
    with pytest.raises(DependencyError, match="CONST needs the constant: give scaling_init"):
        qnn.QuantIdentity(scaling_impl_type="const")


def test_power_of_two_scales_round_log2_to_nearest_except_fixed_point_quantizers():
    # Brevitas: restrict_scaling_type=POWER_OF_TWO rounds log2 of the threshold to
    # nearest (RoundSte); the *FixedPoint quantizers round it up (CeilSte).
    from qtorchlike.nn.module import Parameter
    from qtorchlike.quant import Int8WeightPerTensorFixedPoint

    w = jnp.array([[5.3, -1.0, 0.02, 2.0]])  # log2(5.3) = 2.41
    nearest = qnn.QuantLinear(4, 1, bias=False, weight_restrict_scaling_type="power_of_two")
    up = qnn.QuantLinear(4, 1, bias=False, weight_quant=Int8WeightPerTensorFixedPoint)
    for layer in (nearest, up):
        layer.weight = Parameter(w)
    assert float(nearest.quant_weight().scale) == 2.0**2 / 128
    assert float(up.quant_weight().scale) == 2.0**3 / 128
    assert nearest.quant_weight().int().tolist() == [[127, -32, 1, 64]]


def test_a_per_channel_input_computes_in_float_and_exports_only_what_it_can():
    # One scale per input channel: the sum over inputs has no single grid, so the layer
    # computes in float (no integer path, no accumulator QuantTensor), a bias at input
    # scale x weight scale is refused, and LiteRT export says why it cannot.
    import qtorchlike
    from qtorchlike.quant import Int32Bias

    class PerChannelInput(Int8ActPerTensorFloat):
        scaling_per_output_channel = True
        per_channel_broadcastable_shape = (1, 4)

    x = np.random.default_rng(5).normal(size=(8, 4)).astype(np.float32)
    x *= np.array([1, 10, 0.1, 3], np.float32)
    seq = qnn.Sequential(qnn.QuantLinear(4, 3, input_quant=PerChannelInput))
    lin = seq[0]
    lin(jnp.asarray(x))
    lin.eval()
    xq, wq = lin.input_quant(jnp.asarray(x)), lin.quant_weight()
    assert xq.scale.shape == (1, 4)
    want = np.asarray(xq.value, np.float64) @ np.asarray(wq.value, np.float64).T
    want += np.asarray(lin.bias, np.float64)
    np.testing.assert_allclose(np.asarray(lin(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)
    assert qtorchlike.integer_state_dict(seq)["0"]["input_scale"].shape == (1, 4)
    with pytest.raises(ValueError, match="4 scales .per channel."):
        qnn.QuantLinear(4, 3, input_quant=PerChannelInput, bias_quant=Int32Bias)(jnp.asarray(x))
    model = qnn.Sequential(qnn.QuantIdentity(act_quant=PerChannelInput), qnn.QuantLinear(4, 3))
    model(jnp.asarray(x))
    with pytest.raises(ValueError, match="per-channel scales of shape \\(1, 4\\); LiteRT"):
        qtorchlike.export_tflite(model.eval(), x)

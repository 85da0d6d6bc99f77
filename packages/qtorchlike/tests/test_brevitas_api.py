"""Brevitas' quantizer API as its "Anatomy of a Quantizer" tutorial uses it.

Quantizers as objects (``Q.tensor_quant(x)``), implementation classes built and called,
``module`` and ``this`` injection, proxies with Brevitas' methods (disabled ones where a
layer has no quantizer), ``proxy_class``, ``init_tensor_quant`` and IGNORE_MISSING_KEYS.
References are closed forms in float64 NumPy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtorchlike
import qtorchlike.nn as qnn
from qtorchlike import config
from qtorchlike.core import BinaryQuant, ClampedBinaryQuant, ParameterScaling, TernaryQuant
from qtorchlike.inject import DependencyError, ExtendedInjector, this, value
from qtorchlike.nn.module import Parameter
from qtorchlike.proxy import ActQuantProxyFromInjector, WeightQuantProxyFromInjector
from qtorchlike.quant import Int8ActPerTensorFloat

X = np.random.default_rng(3).normal(size=(4, 4)).astype(np.float32)


class MyBinaryQuantizer(ExtendedInjector):
    tensor_quant = BinaryQuant
    scaling_impl = ParameterScaling
    scaling_init = 0.1


class SignedBinaryWeight(MyBinaryQuantizer):
    proxy_class = WeightQuantProxyFromInjector
    signed = True


class ScaleFromMaxWeight(SignedBinaryWeight):
    @value
    def scaling_init(module):
        return jnp.abs(module.weight).max()


def one(a):
    """The single value of a 0-d or (1,) array."""
    return float(np.asarray(a).reshape(()))


def binary(x, scale):
    return np.where(np.asarray(x) >= 0, 1.0, -1.0) * scale


def test_implementation_classes_are_built_and_called():
    value, scale, zero_point, bit_width = BinaryQuant(
        scaling_impl=ParameterScaling(scaling_init=0.1)
    )(X)
    np.testing.assert_allclose(np.asarray(value), binary(X, 0.1), rtol=1e-7)
    assert (scale.shape, one(scale), float(zero_point), float(bit_width)) == (
        (1,),
        np.float32(0.1),
        0.0,
        1.0,
    )
    t, *_ = TernaryQuant(ParameterScaling(1.0), threshold=0.7)(jnp.array([0.69, 0.71, -0.8]))
    assert t.tolist() == [0.0, 1.0, -1.0]


def test_reading_tensor_quant_builds_it_from_the_quantizers_attributes():
    class Child(MyBinaryQuantizer):
        scaling_init = 1.0

    class Impl(ExtendedInjector):
        tensor_quant = BinaryQuant

    class Scaling(ExtendedInjector):
        scaling_impl = ParameterScaling
        scaling_init = 0.1

    class Composed(Impl, Scaling):
        pass

    for quant, scale in ((MyBinaryQuantizer, 0.1), (Child, 1.0), (Composed, 0.1)):
        value, s, *_ = quant.tensor_quant(X)
        np.testing.assert_allclose(np.asarray(value), binary(X, scale), rtol=1e-7)
        assert one(s) == np.float32(scale)
    assert MyBinaryQuantizer.tensor_quant is not MyBinaryQuantizer.tensor_quant  # built per read


def test_an_enum_quantizers_tensor_quant_is_callable_with_its_numbers():
    value, scale, zero_point, bit_width = Int8ActPerTensorFloat.tensor_quant(X)
    want = np.sort(np.abs(X).ravel())[-1] / 128  # nearest rank of 16 values: the max
    np.testing.assert_allclose(float(scale), want, rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(value), np.clip(np.round(X / want), -128, 127) * want, rtol=1e-6
    )
    assert (float(zero_point), float(bit_width)) == (0.0, 8.0)


def test_proxies_have_brevitas_methods_and_layers_without_quantizers_hold_disabled_ones():
    conv = qnn.QuantConv2d(3, 2, 3, weight_quant=SignedBinaryWeight)
    assert conv.weight_quant.is_quant_enabled
    assert one(conv.weight_quant.scale()) == np.float32(0.1)
    assert (float(conv.weight_quant.zero_point()), float(conv.weight_quant.bit_width())) == (
        0.0,
        1.0,
    )
    for proxy in (conv.bias_quant, conv.input_quant, conv.output_quant):
        assert not proxy.is_quant_enabled
        assert proxy.scale() is None and proxy.bit_width() is None
    assert list(conv.state_dict()) == ["weight", "bias", "weight_quant.value"]
    ident = qnn.QuantIdentity(act_quant=MySignedBinaryAct, return_quant_tensor=True)
    assert isinstance(ident.act_quant, ActQuantProxyFromInjector)
    assert one(ident.act_quant.scale()) == np.float32(0.1)


class MySignedBinaryAct(MyBinaryQuantizer):
    proxy_class = ActQuantProxyFromInjector
    signed = True


def test_a_proxy_class_of_the_wrong_kind_is_refused():
    with pytest.raises(TypeError, match="proxy_class='ActQuantProxy'.*weight_quant"):
        qnn.QuantConv2d(3, 2, 3, weight_quant=MySignedBinaryAct)


def test_scaling_init_can_ask_for_the_module():
    conv = qnn.QuantConv2d(3, 2, 3, weight_quant=ScaleFromMaxWeight)
    assert one(conv.weight_quant.scale()) == float(jnp.abs(conv.weight).max())
    np.testing.assert_allclose(
        np.asarray(conv.quant_weight().value),
        binary(conv.weight, float(jnp.abs(conv.weight).max())),
        rtol=1e-7,
    )


def test_a_shared_proxy_gives_module_as_a_tuple_and_reinitialises():
    class SharedMean(SignedBinaryWeight):
        @value
        def scaling_init(module):
            if isinstance(module, tuple):
                return jnp.abs(jnp.concatenate([m.weight.ravel() for m in module])).mean()
            return jnp.abs(module.weight).mean()

    conv1 = qnn.QuantConv2d(3, 2, 3, weight_quant=SharedMean)
    old = one(conv1.weight_quant.scale())
    conv2 = qnn.QuantConv2d(3, 2, 3, weight_quant=conv1.weight_quant)
    both = np.concatenate([np.ravel(conv1.weight), np.ravel(conv2.weight)])
    assert old == pytest.approx(np.abs(np.asarray(conv1.weight, np.float64)).mean(), rel=1e-6)
    assert one(conv2.weight_quant.scale()) == pytest.approx(
        np.abs(both.astype(np.float64)).mean(), rel=1e-6
    )


def test_init_tensor_quant_takes_the_new_weights():
    conv = qnn.QuantConv2d(3, 2, 3, weight_quant=ScaleFromMaxWeight)
    conv.weight = Parameter(jax.random.uniform(jax.random.key(1), conv.weight.shape))
    assert one(conv.weight_quant.scale()) != float(jnp.abs(conv.weight).max())
    conv.weight_quant.init_tensor_quant()
    assert one(conv.weight_quant.scale()) == float(jnp.abs(conv.weight).max())


def test_value_functions_may_return_this_and_per_channel_scaling_init():
    class Common(ExtendedInjector):
        scaling_impl = ParameterScaling
        signed = True

        @value
        def tensor_quant(is_clamped):
            return ClampedBinaryQuant if is_clamped else BinaryQuant

        @value
        def scaling_shape(scaling_per_output_channel):
            return this.per_channel_broadcastable_shape if scaling_per_output_channel else ()

    class Weight(Common):
        @value
        def per_channel_broadcastable_shape(module):
            return (module.weight.shape[0], 1, 1, 1)

        @value
        def scaling_init(module, scaling_per_output_channel):
            w = jnp.abs(module.weight)
            if scaling_per_output_channel:
                return w.reshape(w.shape[0], -1).max(axis=1).reshape(-1, 1, 1, 1)
            return w.max()

    conv = qnn.QuantConv2d(
        3,
        2,
        3,
        weight_quant=Weight,
        weight_is_clamped=False,
        weight_scaling_per_output_channel=True,
    )
    assert Weight.let(module=conv, scaling_per_output_channel=True).scaling_shape == (2, 1, 1, 1)
    w = np.asarray(conv.weight)
    scale = np.abs(w).reshape(2, -1).max(axis=1).reshape(2, 1, 1, 1)
    np.testing.assert_allclose(np.asarray(conv.quant_weight().scale), scale, rtol=1e-7)
    np.testing.assert_allclose(np.asarray(conv.quant_weight().value), binary(w, scale), rtol=1e-7)

    class Act(Common):
        scaling_init = 0.01

    ident = qnn.QuantIdentity(
        act_quant=Act,
        is_clamped=True,
        scaling_per_output_channel=True,
        per_channel_broadcastable_shape=(4, 1),
        return_quant_tensor=True,
    )
    out = ident(jnp.asarray(X))
    assert out.scale.shape == (4, 1)
    np.testing.assert_allclose(np.asarray(out.value), binary(X, 0.01), rtol=1e-6)
    with pytest.raises(DependencyError, match="per_channel_broadcastable_shape"):
        qnn.QuantIdentity(act_quant=Act, is_clamped=True, scaling_per_output_channel=True)


def test_clamped_binary_has_no_gradient_beyond_the_scale():
    class Clamped(SignedBinaryWeight):
        tensor_quant = ClampedBinaryQuant

    plain = qnn.QuantIdentity(act_quant=MySignedBinaryAct, return_quant_tensor=True)
    clamped = qnn.QuantIdentity(
        act_quant=Clamped.let(proxy_class=ActQuantProxyFromInjector), return_quant_tensor=True
    )
    x = jnp.array([-0.3, -0.05, 0.05, 0.3])
    for layer, want in ((plain, [1.0, 1.0, 1.0, 1.0]), (clamped, [0.0, 1.0, 1.0, 0.0])):
        grad = jax.grad(lambda v, layer=layer: jnp.sum(layer(v).value))(x)
        np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6)  # straight-through
    np.testing.assert_array_equal(np.asarray(plain(x).value), np.asarray(clamped(x).value))


def test_ignore_missing_keys_reports_no_missing_quantizer_keys(monkeypatch):
    conv = qnn.QuantConv2d(3, 2, 3, weight_quant=ScaleFromMaxWeight)
    float_sd = {"weight": np.zeros((2, 3, 3, 3), np.float32) + 0.5, "bias": np.zeros(2, np.float32)}
    with pytest.raises(RuntimeError, match="weight_quant.value"):  # also a KeyError
        conv.load_state_dict(float_sd)
    monkeypatch.setattr(config, "IGNORE_MISSING_KEYS", True)
    result = conv.load_state_dict(float_sd)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])


def test_jnp_functions_take_a_quant_tensor():
    qt = qnn.QuantIdentity(return_quant_tensor=True)(jnp.asarray(X))
    np.testing.assert_allclose(np.asarray(jnp.tanh(qt)), np.tanh(np.asarray(qt.value)), rtol=1e-6)


def test_markers_for_layers_only_say_what_to_use_instead():
    from qtorchlike.core import IntQuant

    with pytest.raises(TypeError, match="Int8ActPerTensorFloat.tensor_quant"):
        IntQuant()
    assert qtorchlike.core.BinaryQuant.kind.name == "BINARY"


def test_quant_tensor_transpose_and_permute_are_torchs():
    qt = qnn.QuantIdentity(return_quant_tensor=True)(jnp.ones((4, 3, 2)))
    assert qt.transpose(0, 1).shape == (3, 4, 2)
    assert qt.transpose(1, 2).shape == (4, 2, 3)
    assert qt.permute(2, 0, 1).shape == (2, 4, 3)
    assert qt.permute((2, 0, 1)).shape == (2, 4, 3)
    assert float(qt.transpose(0, 1).scale) == float(qt.scale)


def test_proxies_say_whether_codes_are_signed_and_narrow():
    lin = qnn.QuantLinear(3, 2, input_quant=Int8ActPerTensorFloat)
    assert (lin.weight_quant.is_signed, lin.weight_quant.is_narrow_range) == (True, True)
    assert (lin.input_quant.is_signed, lin.input_quant.is_narrow_range) == (True, False)
    assert (lin.output_quant.is_signed, lin.output_quant.is_narrow_range) == (None, None)

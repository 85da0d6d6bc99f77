"""QuantLinear / QuantConv2d (int8 per-channel weights, int8 inputs) against qcore's ops."""

import jax
import jax.numpy as jnp
import numpy as np

import qcore
import qtorchlike.nn as qnn
from qtorchlike import quant

PER_CHANNEL = qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,), narrow_range=True)


def _calibrated(layer, x):
    layer(x)  # one training step: the input quantizer's statistics
    return layer.eval()


def test_quant_linear_matches_qcore_dot_general():
    layer = qnn.QuantLinear(
        16, 8, weight_quant=quant.Int8WeightPerChannelFloat, input_quant=quant.Int8ActPerTensorFloat
    )
    x = jax.random.normal(jax.random.key(0), (4, 16))
    _calibrated(layer, x)
    s_in = layer.input_quant.threshold() / 128
    xq = qcore.quantize_with_scale_zero_point(x, "int8", jnp.reshape(s_in, (1, 1)))
    wq = qcore.quantize(layer.weight, PER_CHANNEL)
    want = qcore.dot_general(xq, wq, (((1,), (1,)), ((), ()))) + layer.bias[None]
    np.testing.assert_allclose(layer(x), want, rtol=1e-6, atol=1e-6)
    # The fake-quant (training) path computes the same numbers in float.
    deq = (
        np.asarray(qcore.dequantize(xq), np.float64)
        @ np.asarray(qcore.dequantize(wq), np.float64).T
    )
    np.testing.assert_allclose(layer(x), deq + np.asarray(layer.bias)[None], rtol=1e-5, atol=1e-5)


def test_quant_conv2d_matches_qcore_conv():
    conv = qnn.QuantConv2d(
        3,
        5,
        3,
        padding=1,
        stride=2,
        weight_quant=quant.Int8WeightPerChannelFloat,
        input_quant=quant.Int8ActPerTensorFloat,
    )
    x = jax.random.normal(jax.random.key(1), (2, 3, 9, 9))
    _calibrated(conv, x)
    s_in = conv.input_quant.threshold() / 128
    xq = qcore.quantize_with_scale_zero_point(x, "int8", jnp.reshape(s_in, (1, 1, 1, 1)))
    wq = qcore.quantize(conv.weight, PER_CHANNEL)
    want = qcore.conv_general_dilated(
        xq, wq, (2, 2), [(1, 1), (1, 1)], dimension_numbers=("NCHW", "OIHW", "NCHW")
    ) + conv.bias.reshape(1, 5, 1, 1)
    np.testing.assert_allclose(conv(x), want, rtol=1e-6, atol=1e-6)

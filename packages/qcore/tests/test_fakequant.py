"""fake_quant: forward equals quantize/dequantize, gradients are straight-through."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qcore import HowToQuantize, dequantize, fake_quant, quantize

HOWS = [
    HowToQuantize(qtype="int8", channelwise_axes=(1,)),
    HowToQuantize(qtype="int4", tiled_axes={0: 4}, calibration="mse"),
    HowToQuantize(qtype="uint4", symmetric=False, calibration="minmax"),
    HowToQuantize(qtype="nf4", channelwise_axes=(1,)),
    HowToQuantize(qtype="float8_e4m3fn"),
    HowToQuantize(qtype="mxfp4", tiled_axes={0: 32}),
]


@pytest.mark.parametrize("how", HOWS, ids=lambda h: h.resolved_qtype.name)
def test_forward_is_quantize_then_dequantize(how):
    x = jax.random.normal(jax.random.key(0), (32, 6))
    np.testing.assert_array_equal(fake_quant(x, how), dequantize(quantize(x, how)))
    np.testing.assert_array_equal(jax.jit(fake_quant, static_argnums=1)(x, how), fake_quant(x, how))


@pytest.mark.parametrize("how", HOWS, ids=lambda h: h.resolved_qtype.name)
def test_ste_gradient_is_identity(how):
    x = jax.random.normal(jax.random.key(1), (32, 6))
    w = jax.random.normal(jax.random.key(2), (32, 6))
    g = jax.grad(lambda x: jnp.sum(w * fake_quant(x, how)))(x)
    np.testing.assert_array_equal(g, w)


def _surrogate_fd(f, x, eps=1e-3):
    """Central finite differences of sum(f(x)), one element at a time (float64 numpy)."""
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += eps
        down[i] -= eps
        out[i] = (np.sum(f(up)) - np.sum(f(down))) / (2 * eps)
    return out


@pytest.mark.parametrize(
    ("symmetric", "clip", "lo", "hi"),
    # With a fixed range [-1, 2] the straight-through surrogate is clip(x, -1, 2)
    # for an asymmetric spec, clip(x, -2, 2) for a symmetric one, and the identity
    # without gradient clipping.
    [(False, True, -1.0, 2.0), (True, True, -2.0, 2.0), (True, False, -np.inf, np.inf)],
)
def test_gradient_matches_finite_differences_of_the_surrogate(symmetric, clip, lo, hi):
    x = jnp.array([-3.0, -1.5, -0.7, 0.0, 0.4, 1.9, 2.5, 7.0])
    w = np.linspace(0.5, 2.0, 8)
    how = HowToQuantize(qtype="int8", calibration="fixed,-1,2", symmetric=symmetric)

    def loss(x):
        return jnp.sum(jnp.asarray(w, jnp.float32) * fake_quant(x, how, clip_gradient=clip))

    fd = _surrogate_fd(lambda v: w * np.clip(v, lo, hi), x)
    np.testing.assert_allclose(jax.grad(loss)(x), fd, atol=1e-6)


def test_clipped_gradient_with_percentile_calibration():
    x = jnp.concatenate([jnp.linspace(-1, 1, 99), jnp.array([50.0])])
    how = HowToQuantize(qtype="int8", calibration="percentile,99")
    g = jax.grad(lambda x: jnp.sum(fake_quant(x, how, clip_gradient=True)))(x)
    assert float(g[-1]) == 0.0 and np.all(np.asarray(g[:-1]) == 1.0)


def test_bf16_gradient_dtype_and_stochastic_key():
    x = jax.random.normal(jax.random.key(3), (64,), jnp.bfloat16)
    how = HowToQuantize(qtype="int4", rounding="stochastic")
    key = jax.random.key(4)
    g = jax.grad(lambda x: jnp.sum(fake_quant(x, how, key=key).astype(jnp.float32)))(x)
    assert g.dtype == jnp.bfloat16 and np.all(np.asarray(g, np.float32) == 1.0)
    a, b = fake_quant(x, how, key=key), fake_quant(x, how, key=jax.random.key(5))
    assert not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_stochastic_fake_quant_is_unbiased():
    x = jnp.full((50_000,), 0.37)
    how = HowToQuantize(
        qtype="int8", calibration="fixed,-127,127", narrow_range=True, rounding="stochastic"
    )
    y = fake_quant(x, how, key=jax.random.key(6))
    assert abs(float(jnp.mean(y)) - 0.37) < 0.01

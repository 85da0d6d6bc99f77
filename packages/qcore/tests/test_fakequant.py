"""fake_quant: forward equals quantize/dequantize, gradients are straight-through."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qcore import (
    HowToQuantize,
    dequantize,
    fake_quant,
    fake_quant_with_scale,
    quantize,
    quantize_with_scale_zero_point,
)

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


# -- fake_quant_with_scale: given (learned) scales, LSQ gradients ---------------------

SCALED = [
    ("int8", (1, 6), False, False),
    ("int4", (4, 1), True, False),
    ("uint8", (1, 1), False, True),
    ("int2", (1, 6), True, False),  # narrow int2 is ternary {-1, 0, 1}
    ("int1", (1, 6), False, False),
    ("nf4", (1, 6), False, False),
    ("float8_e4m3fn", (8, 1), False, False),
]


@pytest.mark.parametrize(("qtype", "sshape", "narrow", "asym"), SCALED, ids=lambda v: str(v))
def test_with_scale_forward_equals_quantize_with_scale(qtype, sshape, narrow, asym):
    x = 2 * jax.random.normal(jax.random.key(3), (32, 6))
    x = x.at[0, 0].set(jnp.inf).at[1, 1].set(jnp.nan)
    scale = 0.05 + jax.random.uniform(jax.random.key(4), sshape)
    zp = jnp.full(sshape, 7.0) if asym else None
    want = dequantize(quantize_with_scale_zero_point(x, qtype, scale, zp, narrow_range=narrow))
    got = fake_quant_with_scale(x, qtype, scale, zp, narrow_range=narrow)
    np.testing.assert_array_equal(got, want)
    jitted = jax.jit(fake_quant_with_scale, static_argnums=1, static_argnames="narrow_range")
    np.testing.assert_array_equal(jitted(x, qtype, scale, zp, narrow_range=narrow), want)


def test_with_scale_lsq_gradients_closed_form():
    # int8 narrow: codes in [-127, 127]. Inside the range d/ds = round(x/s) - x/s,
    # saturated d/ds = ±127; d/dx = 1 inside, 0 saturated (float64 reference).
    x = jnp.array([0.26, -0.74, 100.0, -100.0, 0.0])
    s = jnp.array([0.5])
    ds = jax.grad(lambda s: fake_quant_with_scale(x, "int8", s, narrow_range=True).sum())(s)
    v = np.array([0.26, -0.74], np.float64) / 0.5
    want = np.sum(np.round(v) - v) + 127 - 127
    np.testing.assert_allclose(ds, [want], rtol=1e-6)
    dx = jax.grad(lambda x: fake_quant_with_scale(x, "int8", s, narrow_range=True).sum())(x)
    np.testing.assert_array_equal(dx, [1, 1, 0, 0, 1])


def test_with_scale_zero_point_gradient_and_finite_differences():
    # The surrogate (clip(round_ste(x/s + z)) - z) * s is piecewise linear in s
    # between rounding boundaries: compare with a central difference of the
    # surrogate evaluated with the rounding held fixed.
    x = jax.random.normal(jax.random.key(5), (64,))
    s, z = jnp.array([0.03]), jnp.array([3.0])

    def loss(s, z):
        return jnp.sum(jnp.sin(fake_quant_with_scale(x, "uint8", s, z)))

    gs, gz = jax.grad(loss, argnums=(0, 1))(s, z)
    xs = np.asarray(x, np.float64)
    codes = np.clip(np.round(xs / 0.03 + 3.0), 0, 255)
    inside = (xs / 0.03 + 3.0 >= 0) & (xs / 0.03 + 3.0 <= 255)

    def surrogate(s64, z64):
        v = np.where(inside, xs / s64 + z64, 0.0)
        c = codes + (v - (xs / 0.03 + 3.0)) * inside  # round held fixed
        return np.sum(np.sin((c - z64) * s64))

    eps = 1e-6
    fs = (surrogate(0.03 + eps, 3.0) - surrogate(0.03 - eps, 3.0)) / (2 * eps)
    fz = (surrogate(0.03, 3.0 + eps) - surrogate(0.03, 3.0 - eps)) / (2 * eps)
    np.testing.assert_allclose(gs, [fs], rtol=1e-3)
    np.testing.assert_allclose(gz, [fz], rtol=1e-3, atol=1e-3)


def test_with_scale_rejects_bad_input():
    x = jnp.ones((4, 6))
    with pytest.raises(ValueError, match="scale"):
        fake_quant_with_scale(x, "int8", jnp.ones((3, 1)))
    with pytest.raises(ValueError, match="zero_point given but qtype='int1'"):
        fake_quant_with_scale(x, "int1", jnp.ones((1, 1)), jnp.zeros((1, 1)))
    with pytest.raises(ValueError, match="block-scaled"):
        fake_quant_with_scale(x, "mxfp4", jnp.ones((1, 1)))

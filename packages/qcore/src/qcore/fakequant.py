"""Fake quantization: quantize-then-dequantize with a straight-through gradient.

``fake_quant(x, how)`` returns ``dequantize(quantize(x, how))`` in the forward
pass. Its gradient is the straight-through estimator (STE): the rounding is
treated as the identity, so ``d fake_quant / dx = 1``. With
``clip_gradient=True`` the gradient is zero where ``x`` lies outside the
calibrated range ``[lo, hi]`` (the surrogate is ``clip(x, lo, hi)``), which is
the usual choice when the range is fixed or learned separately. Scales are
computed from ``x`` but treated as constants (no gradient flows through
calibration).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from qcore import HowToQuantize, fake_quant
    >>> how = HowToQuantize(qtype="int4", calibration="fixed,-1,1", narrow_range=True)
    >>> x = jnp.array([0.11, 0.6, 3.0])
    >>> fake_quant(x, how)
    Array([0.14285715, 0.5714286 , 1.        ], dtype=float32)
    >>> jax.grad(lambda x: fake_quant(x, how).sum())(x)
    Array([1., 1., 1.], dtype=float32)
    >>> jax.grad(lambda x: fake_quant(x, how, clip_gradient=True).sum())(x)
    Array([1., 1., 0.], dtype=float32)
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from qcore import qarray
from qcore.qarray import HowToQuantize


def _forward(x, how, key):
    scale, zero_point, tensor_scale, lo, hi = qarray.calibrate(x, how)
    q = qarray.quantize_with_scale_zero_point(
        x,
        how.resolved_qtype,
        scale,
        zero_point,
        tensor_scale=tensor_scale,
        rounding=how.rounding,
        narrow_range=how.narrow_range,
        key=key,
    )
    return qarray.dequantize(q), (lo, hi)


def in_calibrated_range(x: jax.Array, how: HowToQuantize) -> jax.Array:
    """True where ``x`` lies inside the range ``how``'s calibration gives ``x``.

    This is where the straight-through gradient passes when gradients are clipped
    (outside it values saturate). Symmetric signed specs cover ``[-b, b]`` with
    ``b = max(|lo|, |hi|)``, symmetric unsigned ``[0, hi]``, asymmetric
    ``[min(lo, 0), max(hi, 0)]``.
    """
    x = jnp.asarray(x)
    *_, lo, hi = qarray.calibrate(x, how)
    return _range_mask(x, lo, hi, how)


def _range_mask(x, lo, hi, how):
    if how.symmetric and how.resolved_qtype.signed:
        bound = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
        lo, hi = -bound, bound
    elif how.symmetric:
        lo, hi = jnp.zeros_like(hi), hi
    else:
        lo, hi = jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)

    def inside(xb, lob, hib):
        return (xb >= lob) & (xb <= hib)

    return qarray._apply(x.astype(jnp.float32), inside, lo, hi)


@partial(jax.custom_vjp, nondiff_argnums=(1, 3))
def _fake_quant(x, how, key, clip_gradient):
    return _forward(x, how, key)[0]


def _fake_quant_fwd(x, how, key, clip_gradient):
    y, (lo, hi) = _forward(x, how, key)
    mask = _range_mask(x, lo, hi, how) if clip_gradient else None
    return y, mask


def _fake_quant_bwd(how, clip_gradient, mask, g):
    if mask is not None:
        g = jnp.where(mask, g, jnp.zeros_like(g))
    return g, None


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def fake_quant(
    x: jax.Array,
    how: HowToQuantize,
    *,
    key: jax.Array | None = None,
    clip_gradient: bool = False,
) -> jax.Array:
    """Quantizes and dequantizes ``x``, with a straight-through gradient.

    Args:
        x: A floating-point array.
        how: The quantization spec.
        key: PRNG key for stochastic rounding.
        clip_gradient: Zero the gradient outside the calibrated range.

    Returns:
        An array like ``x`` holding only representable values.
    """
    x = jnp.asarray(x)
    return _fake_quant(x, how, key, clip_gradient)

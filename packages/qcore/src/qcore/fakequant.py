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

from qcore import numerics, qarray, qtypes
from qcore.qarray import HowToQuantize
from qcore.qtypes import QType


def _forward(x, how, key):
    scale, zero_point, tensor_scale, lo, hi = qarray.calibrate(x, how)
    qtype, rounding, narrow_range = how.resolved_qtype, how.rounding, how.narrow_range
    # Calibrated scales are NaN for non-finite blocks already: no scale checks here.
    q = qarray._encode(x, scale, zero_point, tensor_scale, key, qtype, rounding, narrow_range)
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
        An array like ``x`` holding only representable values; a block holding a
        ``NaN`` or ``±inf`` comes back as ``NaN`` (as :func:`qcore.quantize`).

    Raises:
        TypeError: If ``how`` is not a :class:`~qcore.HowToQuantize`.
        ValueError: For a non-float ``x`` or axes and tiles that do not fit it.
    """
    qarray._check_how(how)
    x = jnp.asarray(x)
    qarray._check_float(x)
    how.scale_shape(x.shape)
    return _fake_quant(x, how, key, clip_gradient)


def fake_quant_with_scale(
    x: jax.Array,
    qtype: QType | str,
    scale: jax.Array,
    zero_point: jax.Array | None = None,
    *,
    narrow_range: bool = False,
    rounding: str = "nearest_even",
    key: jax.Array | None = None,
) -> jax.Array:
    """Quantizes and dequantizes ``x`` with given scales, differentiable in all of them.

    The forward pass equals ``dequantize(quantize_with_scale_zero_point(x, qtype,
    scale, zero_point, ...))`` bit for bit. The backward pass differentiates the
    surrogate ``(clip(round(x / s + z), qmin, qmax) - z) · s`` with a
    straight-through rounding, which gives the LSQ gradients (Esser et al.,
    2020, arXiv:1902.08153) of a learned scale: ``round(x/s) - x/s`` inside the
    range and ``qmin - z`` / ``qmax - z`` where ``x`` saturates. The gradient in
    ``x`` is 1 inside the range and 0 where ``x`` saturates. ``int1`` (sign ×
    scale) passes the gradient in ``x`` straight through; float and codebook
    types pass it inside their range. Zero points get gradients too (an
    asymmetric range can be learned).

    Args:
        x: A floating-point array.
        qtype: Target type (a :class:`~qcore.qtypes.QType` or its name);
            block-scaled types (mx, nvfp4) are not accepted here.
        scale: Scales following the generic broadcast rule for ``x``'s shape.
        zero_point: Zero points shaped like ``scale`` (uniform integer types), or None.
        narrow_range: See :func:`qcore.numerics.int_range`.
        rounding: See :func:`qcore.numerics.round_values`.
        key: PRNG key for stochastic rounding.

    Returns:
        An array like ``x`` holding only representable values; a block (the
        values sharing one scale) holding a ``NaN`` or ``±inf`` comes back as
        ``NaN``.

    Raises:
        ValueError: For a non-float ``x`` or scale, shapes that do not fit, or
            (when concrete) a scale that is not finite and > 0.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x, s = jnp.array([0.26, 0.4, 9.0]), jnp.array([0.5])
        >>> fake_quant_with_scale(x, "int4", s)
        Array([0.5, 0.5, 3.5], dtype=float32)
        >>> jax.grad(lambda s: fake_quant_with_scale(x, "int4", s).sum())(s)
        Array([7.6800003], dtype=float32)
    """
    x = jnp.asarray(x)
    qarray._check_float(x)
    qtype = qtypes.get(qtype)
    numerics.check_rounding(rounding, qtype)
    if qtype.block_size is not None:
        raise ValueError(
            f"qtype={qtype.name!r} is block-scaled; fake_quant_with_scale takes types "
            "with one scale per block of the generic broadcast rule (int*, uint*, int1, "
            "nf4, float8_*, float4_e2m1fn)"
        )
    if zero_point is not None and not qtype.supports_asymmetric:
        raise ValueError(
            f"zero_point given but qtype={qtype.name!r} (kind {qtype.kind!r}) cannot hold "
            "a zero point; allowed: uniform integer qtypes"
        )
    scale = jnp.asarray(scale)
    qarray._check_float(scale, "scale")
    qarray._check_scale_shape(x.shape, scale.shape, "scale")
    qarray._check_scale_values(scale)
    if zero_point is not None:
        zero_point = jnp.asarray(zero_point)
        qarray._check_zero_point_shape(zero_point.shape, scale.shape)
    x = qarray._exact_input(x)
    finite = qarray._block_all_finite(x, scale.shape)

    def fq(xb, sb, zb, ok):
        # A block holding NaN or ±inf gets a NaN scale (as quantize_with_scale_zero_point).
        s32 = jnp.where(ok, sb.astype(jnp.float32), jnp.nan)
        v = numerics.divide(xb, s32)
        if zb is not None:
            v = v + zb.astype(jnp.float32)
        v = jnp.where(jnp.isnan(v), jnp.zeros_like(v), v)  # NaN encodes as 0, as in encode
        codes = numerics.encode(
            jax.lax.stop_gradient(v), qtype, rounding=rounding, narrow_range=narrow_range, key=key
        )
        levels = numerics.decode(codes, qtype)
        if qtype.kind == "binary":
            # sign with an identity straight-through gradient (±inf: no gradient)
            surrogate = jnp.where(jnp.isfinite(v), v, levels)
        else:
            lo, hi = (
                numerics.int_range(qtype, narrow_range)
                if qtype.kind == "int"
                else (
                    qtype.qmin,
                    qtype.qmax,
                )
            )
            surrogate = jnp.clip(v, lo, hi)
        # Forward value: the decoded level; gradient: that of the clipped surrogate.
        v_hat = surrogate + jax.lax.stop_gradient(levels - surrogate)
        if zb is not None:
            v_hat = v_hat - zb.astype(jnp.float32)
        return v_hat * s32

    return qarray._apply(x, fq, scale, zero_point, finite).astype(x.dtype)

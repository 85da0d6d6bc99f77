"""Element-wise quantization arithmetic: rounding, saturation, scales, codes.

Everything here acts on arrays that are already aligned with their scales; the
tiling and calibration logic lives in :mod:`qcore.qarray`. All arithmetic is done
in float32 whatever the input dtype, so bf16 inputs round the same way as f32.

Rules for values that are not finite (the same in every qtype; the project's
policy, see ``docs/concepts.md``): quantization never turns a non-finite value
into a finite one. Values that share one scale form a block.

* a block holding a ``NaN`` or ``±inf`` gets a ``NaN`` scale (and zero point), so
  the whole block dequantizes to ``NaN``: calibrators return a ``NaN`` range for
  it and :func:`scale_from_range` turns any non-finite range end into a ``NaN``
  scale;
* codes themselves are always valid: ``NaN`` encodes as the code of ``0.0``
  (``int1``, which has no zero, gives ``+1``) and ``±inf`` saturate, but their
  block's ``NaN`` scale makes them ``NaN`` again on dequantization;
* a finite degenerate block (all zeros, or empty) gets scale ``1.0`` (``int1``,
  which has no zero, the smallest normal float32, so it dequantizes to
  ``±1.2e-38``); a scale that would be subnormal is raised to the smallest normal
  float32, and scales never overflow: values up to float32's maximum quantize
  within half a step.

Example:
    >>> import jax.numpy as jnp
    >>> from qcore import numerics, qtypes
    >>> numerics.round_values(jnp.array([0.5, 1.5, -2.5]), "nearest_even")
    Array([ 0.,  2., -2.], dtype=float32)
    >>> numerics.round_values(jnp.array([0.5, 1.5, -2.5]), "away_from_zero")
    Array([ 1.,  2., -3.], dtype=float32)
    >>> int8 = qtypes.get("int8")
    >>> numerics.encode(jnp.array([1.2, 3.5, -127.5, 129.0, -1300.0]), int8)
    Array([   1,    4, -128,  127, -128], dtype=int8)
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

from qcore.qtypes import QType

Rounding = Literal["nearest_even", "away_from_zero", "stochastic"]
ROUNDING_MODES: tuple[str, ...] = get_args(Rounding)

# Scales below this are treated as degenerate: dividing by them overflows f32 for
# ordinary inputs. It is the smallest normal float32.
_TINY = float(jnp.finfo(jnp.float32).tiny)
_MAX = float(jnp.finfo(jnp.float32).max)


def check_rounding(rounding: str, qtype: QType | None = None) -> None:
    """Raises ValueError unless ``rounding`` is a known mode usable with ``qtype``.

    Args:
        rounding: One of :data:`ROUNDING_MODES`.
        qtype: If given, also checks that the mode applies to this type
            (stochastic rounding applies to integer kinds only).
    """
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding={rounding!r} is not supported; allowed: {ROUNDING_MODES}")
    if rounding == "stochastic" and qtype is not None and qtype.kind != "int":
        raise ValueError(
            f"rounding='stochastic' is supported for integer qtypes only, not "
            f"qtype={qtype.name!r} (kind {qtype.kind!r}); use 'nearest_even'"
        )


def round_values(
    x: jax.Array, rounding: str = "nearest_even", *, key: jax.Array | None = None
) -> jax.Array:
    """Rounds to integers with the given rule.

    Args:
        x: Values to round.
        rounding: ``"nearest_even"`` (IEEE default, as ``jnp.round``),
            ``"away_from_zero"`` (ties away from zero, TFLite's kernels' rule) or
            ``"stochastic"`` (``floor(x + u)``, ``u ~ U[0, 1)``: unbiased,
            ``E[round(x)] = x``).
        key: PRNG key, required for ``"stochastic"``.

    Returns:
        Rounded values with the dtype of ``x``.
    """
    check_rounding(rounding)
    if rounding == "nearest_even":
        return jax.lax.round(x, jax.lax.RoundingMethod.TO_NEAREST_EVEN)
    if rounding == "away_from_zero":
        return jnp.sign(x) * jnp.floor(jnp.abs(x) + 0.5)
    if key is None:
        raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...)")
    u = jax.random.uniform(key, x.shape, dtype=jnp.float32).astype(x.dtype)
    return jnp.floor(x + u)


def saturate(x: jax.Array, lo: float | jax.Array, hi: float | jax.Array) -> jax.Array:
    """Clips to ``[lo, hi]``; ``±inf`` saturate to the bounds, ``NaN`` stays ``NaN``."""
    # jnp.clip's arithmetic without its nested jit: each nested call is one more
    # computation for XLA to inline, per quantization in a model.
    return jnp.minimum(jnp.maximum(x, lo), hi)


def _select(condition: jax.Array, x: jax.Array | float, y: jax.Array | float) -> jax.Array:
    """``jnp.where(condition, x, y)`` for float32 operands, without a nested jit.

    The quantization arithmetic runs once per quantized op of a model; ``jnp.where``
    traces a nested ``jit`` call each time, which XLA must inline again.
    """
    if _split_explicitly(condition, x, y):
        # jnp.broadcast_to would make the broadcast operands unsharded, and select
        # refuses operands of different shardings; jnp.where gives them the sharding
        # of the others.
        return jnp.where(condition, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
    shape = jnp.broadcast_shapes(jnp.shape(condition), jnp.shape(x), jnp.shape(y))
    x, y = (jnp.broadcast_to(jnp.asarray(a, jnp.float32), shape) for a in (x, y))
    return jax.lax.select(jnp.broadcast_to(condition, shape), x, y)


def _split_explicitly(*arrays: jax.Array | float) -> bool:
    """Whether any of ``arrays`` is split across devices by an explicit-axes mesh.

    Under ``jax.sharding.AxisType.Explicit`` an array's type carries its sharding,
    and some of qcore's fast formulations (which broadcast or accumulate in unsharded
    arrays) give way to ones XLA places itself.

    Example:
        >>> import jax.numpy as jnp
        >>> _split_explicitly(jnp.ones((2, 3)), 1.0)
        False
    """
    for a in arrays:
        spec = getattr(getattr(jax.typeof(a), "sharding", None), "spec", None)
        if spec is not None and any(p is not None for p in spec):
            return True
    return False


def repeat(a: jax.Array, times: int, axis: int) -> jax.Array:
    """``jnp.repeat(a, times, axis)`` as a broadcast and a reshape.

    ``jnp.repeat`` builds its index with a scatter, a cumsum and a gather, even for a
    static count; scales repeated up to a tiled weight's shape on every call made a
    small int4 ResNet's step 2.7x float's. The broadcast is a view XLA fuses.

    Example:
        >>> import jax.numpy as jnp
        >>> repeat(jnp.array([[1.0, 2.0]]), 2, axis=1)
        Array([[1., 1., 2., 2.]], dtype=float32)
    """
    if times == 1:
        return a
    axis %= a.ndim
    shape = a.shape[: axis + 1] + (times,) + a.shape[axis + 1 :]
    out = jnp.broadcast_to(jnp.expand_dims(a, axis + 1), shape)
    return out.reshape(a.shape[:axis] + (a.shape[axis] * times,) + a.shape[axis + 1 :])


@jax.custom_jvp
def round_ste(x: jax.Array) -> jax.Array:
    """Round half to even with a straight-through (identity) gradient."""
    return jnp.round(x)


@round_ste.defjvp
def _round_ste_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple:
    (x,), (dx,) = primals, tangents
    return jnp.round(x), dx


def int_range(qtype: QType, narrow_range: bool) -> tuple[float, float]:
    """The codes an integer qtype may use.

    ``narrow_range`` drops the most negative code of a signed type so that the
    range is symmetric (``int8`` → ``[-127, 127]``, TFLite's weight range).
    """
    qmin = qtype.qmin
    if narrow_range and qtype.signed and qtype.kind == "int":
        qmin = -qtype.qmax
    return qmin, qtype.qmax


def symmetric_denominator(qtype: QType, narrow_range: bool) -> float:
    """The scaled value that the calibrated bound maps to, for symmetric scales.

    Signed integer types that are not narrow map the bound to ``qmax + 0.5``:
    every one of the ``2**bits`` codes is used and ``±bound`` still round to
    within half a step (``+bound`` saturates from ``qmax + 0.5`` to ``qmax``).
    Narrow signed ranges and unsigned types (range ``[0, bound]``, so that e.g.
    ``k / 255`` is exact in uint8) map it to ``qmax`` exactly. Other kinds map it
    to their largest level.
    """
    if qtype.kind == "int" and qtype.signed and not narrow_range:
        return qtype.qmax + 0.5
    return qtype.qmax


def _scale(width: jax.Array, denominator: float | jax.Array, qtype: QType) -> jax.Array:
    """``width / denominator`` as a usable scale: see the module docstring.

    ``width`` is zero only for a degenerate block (it is tested rather than the
    quotient, which XLA:CPU flushes to zero when subnormal); ``NaN`` stays ``NaN``.
    """
    return _scale_of_quotient(width, width / denominator, qtype)


def _scale_of_quotient(width: jax.Array, quotient: jax.Array, qtype: QType) -> jax.Array:
    """:func:`_scale` given ``width / denominator`` already."""
    # int1 has no zero level: a degenerate (e.g. all-zero) block gets the
    # smallest normal scale, so it dequantizes to ±1.2e-38 rather than ±1.
    fallback = _TINY if qtype.kind == "binary" else 1.0
    return _select(width == 0, fallback, saturate(quotient, _TINY, _MAX))


def divide(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` in float32, exact also for scales above ``2**126``.

    XLA computes a division by a broadcast scale as a multiplication by its
    reciprocal, which is subnormal, hence flushed to zero on CPU, for scales
    above ``2**126`` (e.g. nf4 or int2 blocks near float32's maximum). Such scales
    and ``x`` are first multiplied by ``2**-64`` (exact).
    """
    scale = jnp.asarray(scale, jnp.float32)
    shrink = _select(scale > 2.0**64, 2.0**-64, 1.0)
    return (jnp.asarray(x, jnp.float32) * shrink) / (scale * shrink)


def scale_from_range(
    lo: jax.Array,
    hi: jax.Array,
    qtype: QType,
    *,
    symmetric: bool = True,
    narrow_range: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Turns calibrated ranges into float32 scales (and integer zero points).

    Args:
        lo: Lower ends of the calibrated ranges (any shape).
        hi: Upper ends, same shape.
        qtype: Target type.
        symmetric: Zero point fixed at 0. Signed types use
            ``max(|lo|, |hi|)``; unsigned types use ``max(hi, 0)`` and clip
            negatives to zero.
        narrow_range: See :func:`int_range`.

    Returns:
        ``(scale, zero_point)``; ``zero_point`` is ``None`` when symmetric,
        otherwise a float32 array of integral values within the code range.
        Block-scaled types with power-of-two (e8m0) scales get their scale
        rounded up to a power of two so the calibrated range is never clipped.
        Where ``lo`` or ``hi`` is not finite (a block holding ``NaN`` or
        ``±inf``), scale and zero point are ``NaN``.
    """
    lo, hi = (jnp.asarray(a, jnp.float32) for a in (lo, hi))
    bad = ~(jnp.isfinite(lo) & jnp.isfinite(hi))
    nan = jnp.float32(jnp.nan)
    if symmetric:
        bound = jnp.maximum(jnp.abs(lo), jnp.abs(hi)) if qtype.signed else jnp.maximum(hi, 0.0)
        return _select(bad, nan, scale_from_bound(bound, qtype, narrow_range)), None
    if not qtype.supports_asymmetric:
        raise ValueError(
            f"symmetric=False needs a uniform integer qtype; qtype={qtype.name!r} "
            f"(kind {qtype.kind!r}) cannot hold a zero point"
        )
    qmin, qmax = int_range(qtype, narrow_range)
    lo = jnp.minimum(lo, 0.0)
    hi = jnp.maximum(hi, 0.0)
    # A range wider than float32's maximum ([-3e38, 3e38]) overflows hi - lo: it
    # takes hi / n - lo / n instead (only for uint1, n = 1, is that clipped to the
    # maximum). Narrow ranges keep hi - lo, as hi / n may be flushed to zero.
    n = qmax - qmin
    wide = jnp.isinf(hi - lo)
    width = jnp.where(wide, hi / n - lo / n, hi - lo)
    scale = jnp.where(bad, nan, _scale(width, jnp.where(wide, 1.0, n), qtype))
    zero_point = jnp.clip(jnp.round(qmin - divide(lo, scale)), qmin, qmax)
    return scale, zero_point


def scale_from_bound(bound: jax.Array, qtype: QType, narrow_range: bool = False) -> jax.Array:
    """The symmetric float32 scale of blocks whose calibrated bound is ``bound``.

    Args:
        bound: ``max(|lo|, |hi|)`` per block (``max(hi, 0)`` for unsigned types),
            finite or ``NaN``.
        qtype: Target type.
        narrow_range: See :func:`int_range`.

    Returns:
        ``bound / symmetric_denominator(...)`` made usable as in
        :func:`scale_from_range` (which calls this; it also maps an infinite range
        end to ``NaN``, which this leaves to the caller). ``NaN`` stays ``NaN``.

    Example:
        >>> import jax.numpy as jnp
        >>> from qcore import qtypes
        >>> scale_from_bound(jnp.array([127.5, 0.0, jnp.nan]), qtypes.get("int8"))
        Array([ 1.,  1., nan], dtype=float32)
    """
    denominator = symmetric_denominator(qtype, narrow_range)
    scale = bound / denominator
    if denominator != qtype.qmax:
        # qmin · bound / (qmax + 0.5) overflows for bounds within half a step of
        # float32's maximum: such blocks map the bound to qmax, as narrow ranges do.
        near_max = bound > _MAX * (denominator / -qtype.qmin)
        scale = _select(near_max, bound / qtype.qmax, scale)
    scale = _scale_of_quotient(bound, scale, qtype)
    if qtype.scale_dtype == "float8_e8m0fnu":
        scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
    return scale


def encode(
    v: jax.Array,
    qtype: QType,
    *,
    rounding: str = "nearest_even",
    narrow_range: bool = False,
    key: jax.Array | None = None,
) -> jax.Array:
    """Encodes already-scaled values (``x / scale + zero_point``) as codes.

    Args:
        v: Scaled values.
        qtype: Target type.
        rounding: Rounding mode for integer kinds (see :func:`round_values`);
            float kinds round to nearest even by the cast, codebooks to the
            nearest level (ties to the lower level).
        narrow_range: See :func:`int_range`.
        key: PRNG key for stochastic rounding.

    Returns:
        Codes in ``qtype.storage_dtype``: integer codes, ``±1`` for ``int1``,
        float elements for float kinds, level indices for codebooks.
    """
    check_rounding(rounding, qtype)
    v = jnp.asarray(v, jnp.float32)
    v = _select(jnp.isnan(v), 0.0, v)
    dtype = qtype.storage_dtype
    if qtype.kind == "int":
        qmin, qmax = int_range(qtype, narrow_range)
        if rounding != "stochastic" and qmax + 0.5 == symmetric_denominator(qtype, narrow_range):
            v = _lowest_tie_to_qmin(v, qmin)
        return saturate(round_values(v, rounding, key=key), qmin, qmax).astype(dtype)
    if qtype.kind == "binary":
        return jnp.where(v >= 0, 1, -1).astype(dtype)
    if qtype.kind == "float":
        # Clip first: casting an out-of-range value to e4m3fn gives NaN.
        return saturate(v, qtype.qmin, qtype.qmax).astype(dtype)
    levels = jnp.asarray(qtype.codebook, jnp.float32)
    midpoints = (levels[1:] + levels[:-1]) / 2
    return jnp.searchsorted(midpoints, saturate(v, qtype.qmin, qtype.qmax)).astype(dtype)


def _lowest_tie_to_qmin(v: jax.Array, qmin: float) -> jax.Array:
    """Values within 32 float32 ulps above the tie ``qmin + 0.5`` take the tie's code.

    A symmetric scale of a signed, not narrow, type maps the bound to ``qmax + 0.5``
    (:func:`symmetric_denominator`), so ``-bound / scale`` is the tie ``qmin + 0.5``
    up to float32 rounding of the scale and the division. It rounded to ``qmin`` or
    to ``qmin + 1`` (both half a step away) depending on the bound's last bits, so an
    ulp's change of a model's values (XLA fuses float ops differently eagerly and
    under ``jax.jit``) moved a block's largest value by a whole step. Both rounding
    modes send the exact tie to ``qmin``; so do these values now, at a cost of at
    most 32 ulps of extra error (``2.4e-4`` of a step in int8).
    """
    edge = qmin + 0.5
    near = (v >= edge) & (v < edge + abs(edge) * 2.0**-19)
    return _select(near, qmin, v)


def decode(codes: jax.Array, qtype: QType) -> jax.Array:
    """The float32 value of each code, before scaling (inverse of :func:`encode`)."""
    if qtype.kind == "codebook":
        return jnp.take(jnp.asarray(qtype.codebook, jnp.float32), codes.astype(jnp.int32))
    return codes.astype(jnp.float32)

"""``take``: table lookup on a QArray (e.g. a quantized embedding table).

Only the requested slices' codes and scales (and zero points) are gathered and
dequantized; the whole table is never dequantized. The result equals
``jnp.take(qcore.dequantize(q), indices, axis)`` exactly, out-of-range indices
included: they follow ``jnp.take``'s ``mode`` (default ``"fill"``: the slice is
``fill_value``, NaN for float results; ``"clip"`` and ``"wrap"`` as in
``jnp.take``). Codes packed along another axis stay packed until the gathered
rows are unpacked; codes packed along the gathered axis are gathered by their
packing groups (one byte holds two int4 codes).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qcore import packing as packing_lib
from qcore.qarray import Packing, QArray, _axis, dequantize, storage_codes

Array = jax.Array

_MODES = (None, "fill", "clip", "wrap")  # the modes jnp.take accepts


def take(
    q: QArray,
    indices: Any,
    axis: int = 0,
    *,
    mode: str | None = None,
    fill_value: Any = None,
    dtype: Any = None,
) -> Array:
    """``jnp.take(dequantize(q), indices, axis)`` without dequantizing all of ``q``.

    Args:
        q: The quantized table, any qtype, scale shape or packing.
        indices: Integer indices (any shape) into ``axis``.
        axis: The axis to gather along (an int; negative counts from the end).
        mode: ``jnp.take``'s out-of-range rule: None or ``"fill"`` (the default:
            ``fill_value``), ``"clip"`` or ``"wrap"``.
        fill_value: The value of out-of-range slices in ``"fill"`` mode; default
            NaN (float results).
        dtype: Result dtype; default ``q.dtype``.

    Returns:
        ``q``'s shape with ``axis`` replaced by ``indices.shape``.

    Raises:
        ValueError: For non-integer indices, a bad ``axis`` or ``mode``.

    Example:
        >>> import jax.numpy as jnp
        >>> import qcore
        >>> table = jnp.arange(24.0).reshape(6, 4) / 7
        >>> how = qcore.HowToQuantize(qtype="int4", channelwise_axes=(0,), pack=True)
        >>> q = qcore.quantize(table, how)
        >>> ids = jnp.array([[5, 0], [2, 2]])
        >>> rows = qcore.take(q, ids)
        >>> rows.shape
        (2, 2, 4)
        >>> bool(jnp.array_equal(rows, jnp.take(qcore.dequantize(q), ids, axis=0)))
        True
        >>> qcore.take(q, jnp.array([6]))  # out of range: NaN, as jnp.take
        Array([[nan, nan, nan, nan]], dtype=float32)
    """
    if not isinstance(q, QArray):
        raise ValueError(f"q must be a QArray, got {type(q).__name__}; use jnp.take for arrays")
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r}; allowed: {', '.join(map(repr, _MODES))}")
    if not isinstance(axis, int | np.integer):
        raise ValueError(f"axis={axis!r}; allowed: a static int")
    a = _axis("axis", int(axis), q.ndim)
    indices = jnp.asarray(indices)
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"indices must be integers, got dtype {indices.dtype}")
    out_dtype = jnp.dtype(dtype if dtype is not None else q.dtype)
    d = q.shape[a]
    if d == 0:
        raise ValueError(f"axis {a} of q (shape {q.shape}) is empty: nothing to take from")
    # Where jnp.take itself would read each index from (-1: out of range, filled).
    rows = jnp.take(jnp.arange(d, dtype=jnp.int32), indices, mode=mode, fill_value=-1)
    safe = jnp.clip(rows, 0, d - 1)
    tile = d // q.scale.shape[a]  # d for one scale along the axis: every row reads block 0

    # The gathers below get in-range indices; "clip" spares them jnp.take's fill mask.
    def gather(x: Array | None) -> Array | None:
        return None if x is None else jnp.take(x, safe // tile, axis=a, mode="clip")

    k = indices.ndim
    out_ndim = q.ndim - 1 + k
    packed = q.packing
    if packed is not None and packed.axis % q.ndim == a:
        codes, packed = _take_packed_axis(q, safe, a), None
    else:
        codes = jnp.take(q.qvalue, safe, axis=a, mode="clip")
        if packed is not None:
            p = packed.axis % q.ndim
            packed = Packing((p if p < a else p + k - 1) - out_ndim, packed.length)
    tensor_scale = q.tensor_scale
    if tensor_scale is not None:
        tensor_scale = tensor_scale.reshape((1,) * out_ndim)
    part = QArray._from_parts(
        codes, gather(q.scale), gather(q.zero_point), tensor_scale, q.qtype, q.dtype, packed
    )
    values = dequantize(part, out_dtype)
    if mode in (None, "fill"):
        fill = jnp.asarray(jnp.nan if fill_value is None else fill_value, out_dtype)
        inside = (rows >= 0).reshape((1,) * a + rows.shape + (1,) * (q.ndim - a - 1))
        values = jnp.where(inside, values, fill)
    return values


def _take_packed_axis(q: QArray, rows: Array, a: int) -> Array:
    """Codes at ``rows`` along ``a`` when ``a`` is the packed axis (unpacked, one per row)."""
    assert q.packing is not None
    bits = q.qtype.bits
    per_group, bytes_per_group = packing_lib._group_shape(bits)
    x = jnp.moveaxis(q.qvalue, a, -1)
    groups = x.reshape(x.shape[:-1] + (x.shape[-1] // bytes_per_group, bytes_per_group))
    picked = jnp.take(groups, rows // per_group, axis=-2, mode="clip")  # (..., *idx, bpg)
    signed = q.qtype.kind == "int" and q.qtype.signed
    codes = packing_lib.unpack(picked, bits, per_group, axis=-1, signed=signed)
    within = (rows % per_group)[..., None]
    codes = jnp.take_along_axis(codes, jnp.broadcast_to(within, codes.shape[:-1] + (1,)), -1)
    codes = codes[..., 0]  # (..., *idx): the gathered axis last
    codes = jnp.moveaxis(codes, tuple(range(-rows.ndim, 0)), tuple(range(a, a + rows.ndim)))
    return storage_codes(codes, q.qtype)

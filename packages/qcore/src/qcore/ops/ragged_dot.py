"""``ragged_dot`` (grouped matmul, as in mixture-of-experts layers) with QArrays.

``lhs`` is ``(m, k)``, ``rhs`` is ``(groups, k, n)`` and ``group_sizes[g]``
consecutive rows of ``lhs`` are multiplied by ``rhs[g]``. Scales may vary along
``m`` (lhs), along ``groups`` and ``n`` (rhs), and along ``k`` on either side in
tiles: each ``k`` tile is a separate ragged contraction whose result is scaled and
summed. Codes are contracted directly (int8 × int8 → int32 when both operands are
integer QArrays) and zero points are corrected on the result.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qcore.ops.operand import Operand, as_input, expand, operand, preferred_dtype, promote
from qcore.qarray import QArray

Array = jax.Array


def ragged_dot(
    lhs: Array | QArray,
    rhs: Array | QArray,
    group_sizes: Array,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Array:
    """``lax.ragged_dot`` where either operand may be a QArray.

    Args:
        lhs: ``(m, k)`` array or QArray.
        rhs: ``(groups, k, n)`` array or QArray.
        group_sizes: ``(groups,)`` integers summing to ``m`` (checked when concrete).
        precision: Passed to the float contraction.
        preferred_element_type: Result dtype (see :func:`qcore.dot_general`); with a
            QArray operand None or a floating-point dtype.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import qcore
        >>> x = jax.random.normal(jax.random.key(0), (6, 32))
        >>> experts = qcore.quantize(
        ...     jax.random.normal(jax.random.key(1), (2, 32, 4)),
        ...     qcore.HowToQuantize(qtype="int8", channelwise_axes=(0, 2)),
        ... )
        >>> qcore.ragged_dot(x, experts, jnp.array([2, 4])).shape
        (6, 4)
    """
    lhs = as_input(lhs, "lhs")
    rhs = as_input(rhs, "rhs")
    group_sizes = check_ragged(tuple(lhs.shape), tuple(rhs.shape), group_sizes)
    if not isinstance(lhs, QArray) and not isinstance(rhs, QArray):
        return lax.ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type)
    return _ragged_dot(lhs, rhs, group_sizes, precision, preferred_dtype(preferred_element_type))


def check_ragged(lshape: tuple[int, ...], rshape: tuple[int, ...], group_sizes: Any) -> Array:
    """``group_sizes`` as int32, checked against operands of shapes ``lshape``, ``rshape``.

    Raises:
        ValueError: Unless lhs is ``(m, k)``, rhs ``(groups, k, n)`` and group_sizes
            ``groups`` integers (summing to ``m`` when concrete).
    """
    if len(lshape) != 2 or len(rshape) != 3 or lshape[1] != rshape[1]:
        raise ValueError(
            f"ragged_dot needs lhs (m, k) and rhs (groups, k, n) with the same k; got shapes "
            f"{lshape} and {rshape}"
        )
    group_sizes = jnp.asarray(group_sizes)
    if group_sizes.shape != (rshape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be {rshape[0]} integers (one per group of rhs); got shape "
            f"{group_sizes.shape} and dtype {group_sizes.dtype}"
        )
    try:
        total = int(np.sum(np.asarray(group_sizes)))
    except jax.errors.TracerArrayConversionError:
        total = None  # traced under jit: cannot be checked here
    if total is not None and total != lshape[0]:
        raise ValueError(
            f"group_sizes {np.asarray(group_sizes).tolist()} sum to {total}, but lhs has "
            f"{lshape[0]} rows; they must sum to the number of rows"
        )
    return group_sizes.astype(jnp.int32)


# One compiled computation per call, so eager results are bit-identical to jitted ones.
@partial(jax.jit, static_argnums=(3, 4))
def _ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type) -> Array:
    a, b = operand(lhs), operand(rhs)
    out_dtype = preferred_element_type or promote(a.dtype, b.dtype)
    return _scaled_ragged_dot(a, b, group_sizes, precision).astype(out_dtype)


def _scaled_ragged_dot(a: Operand, b: Operand, group_sizes: Array, precision) -> Array:
    integer = a.integer and b.integer
    if not integer:
        a, b = a.as_float(), b.as_float()
    acc_dtype = jnp.int32 if integer else jnp.float32
    m, k = a.shape
    t_a = 1 if a.scale is None else a.scale.shape[1]
    t_b = 1 if b.scale is None else b.scale.shape[1]
    tiles = max(t_a, t_b)
    if tiles % t_a or tiles % t_b:
        raise ValueError(
            f"incompatible tiles along k (size {k}): lhs has {t_a} scale tiles and rhs has "
            f"{t_b}; one tile size must be a multiple of the other"
        )
    # Row -> group index, to gather each row's rhs scales and zero points.
    ends = jnp.cumsum(group_sizes)
    row_group = jnp.clip(jnp.searchsorted(ends, jnp.arange(m), side="right"), 0, b.shape[0] - 1)

    def per_row(x: Array | None, tile: int) -> Array | None:
        """lhs-side (m, tiles) or rhs-side (groups, tiles, n) -> (m, n) for one tile."""
        if x is None:
            return None
        if x.ndim == 2:  # lhs: (m or 1, t_a)
            return x[:, (tile * x.shape[1]) // tiles][:, None]
        x = x[:, (tile * x.shape[1]) // tiles, :]  # (groups or 1, n or 1)
        return x[row_group] if x.shape[0] > 1 else x

    kt = k // tiles
    out = jnp.zeros((m, b.shape[2]), jnp.float32)
    for t in range(tiles):
        va = a.values[:, t * kt : (t + 1) * kt]
        vb = b.values[:, t * kt : (t + 1) * kt, :]
        acc = lax.ragged_dot(
            va,
            vb,
            group_sizes,
            precision=None if integer else precision,
            preferred_element_type=acc_dtype,
        )
        za, zb = per_row(a.zero_point, t), per_row(b.zero_point, t)
        if za is not None:
            colsum = jnp.sum(vb, axis=1, dtype=acc_dtype)[row_group]  # (m, n)
            acc = acc - za * colsum
        if zb is not None:
            acc = acc - zb * jnp.sum(va, axis=1, keepdims=True, dtype=acc_dtype)
        if za is not None and zb is not None:
            acc = acc + za * zb * kt
        part = acc.astype(jnp.float32)
        for s in (per_row(a.scale, t), per_row(b.scale, t)):
            if s is not None:
                part = part * expand(
                    s, tuple(d if e != 1 else 1 for e, d in zip(s.shape, part.shape, strict=True))
                )
        out = out + part
    # Rows past the last group are zero in lax.ragged_dot; keep them zero.
    return jnp.where((jnp.arange(m) < ends[-1])[:, None], out, 0.0)

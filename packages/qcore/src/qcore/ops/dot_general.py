"""``dot_general`` on arrays and QArrays, with an integer path.

Each operand is ``(values - zero_point) * scale`` (see :mod:`qcore.ops.operand`).
The contraction is rewritten so that scales never multiply the inputs:

1. A contracting axis along which either scale varies (sub-channel tiles) is
   split into ``(groups, rest)``; the groups become an extra batch axis, so within
   a group both scales are constant along every contracted axis.
2. The values are contracted: int8 × int8 → int32 when both operands are integer
   QArrays (the *integer path*), float32 otherwise.
3. Zero points are corrected for on the (small) result:
   ``Σ(a - za)(b - zb) = Σab - za·Σb - zb·Σa + za·zb·K``.
4. The result is multiplied by both scales (broadcast along batch and free axes)
   and the group axes are summed.

When the groups would make that intermediate result large (fine scale tiles along
the contraction, such as one activation scale per input channel; with a symbolic
batch, when they could), the operands are dequantized and contracted in float32
instead. On the CPU, so is a weight-only product (one float operand) with many rows
(at least 32, or 1024 for weights over 16 MiB as float32; a symbolic ``jax.export``
batch counts as many): it is compute-bound, and one float dot on the dequantized
weight runs as fast as the float model, where the blocked kernels of
:mod:`qcore.ops.kernels` and the grouped path above cost up to several times more.
Weight-only products with fewer rows (decoding) take the kernels, which never
materialise the weight.

Those row thresholds and kernels were measured on XLA:CPU and apply only to products
traced for the CPU (the default device's platform, else ``jax.default_backend()``).
Traced for any other backend (GPU, TPU), every product takes the general path above,
steps 1-4, and leaves fusing the codes' conversion into the dot to XLA.

This equals dequantize-then-contract up to float rounding; apart from the two
dequantizing cases above, it never materialises a scaled copy of either operand.

Result dtype: ``preferred_element_type`` if given, else the promotion of the
operands' dtypes, where a QArray counts with its scale's dtype (or, for block
scales such as e8m0, its dequantized dtype). So bf16 × (int8, bf16 scale) → bf16
and bf16 × (int8, f32 scale) → f32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qcore import numerics
from qcore.ops import _backend, kernels
from qcore.ops.operand import Operand, as_input, expand, operand, preferred_dtype, promote
from qcore.qarray import QArray

Array = jax.Array
DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def dot_general(
    lhs: Array | QArray,
    rhs: Array | QArray,
    dimension_numbers: DimensionNumbers,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Array:
    """``lax.dot_general`` where either operand may be a :class:`~qcore.QArray`.

    Args:
        lhs: An array or QArray.
        rhs: An array or QArray.
        dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch,
            rhs_batch))`` as in ``lax.dot_general``.
        precision: Passed to the float contraction.
        preferred_element_type: Result dtype (see the module docstring); with a
            QArray operand None or a floating-point dtype.

    Returns:
        The contraction, laid out as ``lax.dot_general`` lays it out (batch, lhs
        free, rhs free).

    Raises:
        ValueError: For malformed ``dimension_numbers``, mismatched contracting or
            batch dims, a non-float ``preferred_element_type`` with a QArray operand,
            or scales whose tiles along a contracting axis cannot be aligned.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import qcore
        >>> x = jax.random.normal(jax.random.key(0), (2, 64))
        >>> w = jax.random.normal(jax.random.key(1), (64, 8))
        >>> how = qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,))
        >>> y = qcore.dot_general(x, qcore.quantize(w, how), (((1,), (0,)), ((), ())))
        >>> ref = x @ w
        >>> float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref))) < 0.01
        True
    """
    lhs = as_input(lhs, "lhs")
    rhs = as_input(rhs, "rhs")
    dims = check_dims(tuple(lhs.shape), tuple(rhs.shape), dimension_numbers)
    if not isinstance(lhs, QArray) and not isinstance(rhs, QArray):
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    return _dot_general(lhs, rhs, dims, precision, preferred_dtype(preferred_element_type))


# One compiled computation per call, so eager results are bit-identical to jitted ones.
# (Whether its products call qkernels is part of jax.jit's cache key: kernels._MODE.)
@partial(jax.jit, static_argnums=(2, 3, 4))
def _dot_general(lhs, rhs, dims, precision, preferred) -> Array:
    a, b = operand(lhs), operand(rhs)
    out_dtype = preferred or promote(a.dtype, b.dtype)
    if _dequantize_first(lhs, rhs, dims):
        y = lax.dot_general(
            a.dequantized(), b.dequantized(), dims, precision, preferred_element_type=jnp.float32
        )
        return y.astype(out_dtype)
    y = kernels.fast_dot_general(lhs, rhs, dims, precision)
    if y is None:
        y = scaled_dot_general(a, b, dims, precision)
    return y.astype(out_dtype)


# Weight-only products with many activation rows are compute-bound: one float dot on
# the dequantized weight then costs what the float model costs, while the kernels'
# blocked loops and the grouped general path add 20-500 % (measured on 2-core Zen 5:
# (4096, 384) x (384, 1536) int8 per-channel 59 ms, nf4 tile 64 176 ms, float 26 ms,
# dequantize-then-dot 26 ms). A weight's float copy is a fresh temporary each call,
# cheap while it stays below glibc's 32 MiB mmap threshold; larger weights pay page
# faults (~30 ms for 64 MiB), which only many rows amortise.
_DEQUANTIZE_ROWS = 32
_DEQUANTIZE_ROWS_LARGE = 1024
_LARGE_WEIGHT_BYTES = 16 * 2**20


def _dequantize_first(lhs: Any, rhs: Any, dims) -> bool:
    """Whether a weight-only product should dequantize its QArray and run one float dot.

    Never off the CPU: the thresholds below were measured on XLA:CPU.
    """
    if isinstance(lhs, QArray) == isinstance(rhs, QArray) or _backend.platform() != "cpu":
        return False
    (lc, rc), (lb, rb) = dims
    x, contracting, batch = (rhs, rc, rb) if isinstance(lhs, QArray) else (lhs, lc, lb)
    w = lhs if isinstance(lhs, QArray) else rhs
    rows = math.prod(d for i, d in enumerate(x.shape) if i not in contracting and i not in batch)
    large = _may_exceed(4 * math.prod(w.shape), _LARGE_WEIGHT_BYTES)
    return _may_exceed(rows, (_DEQUANTIZE_ROWS_LARGE if large else _DEQUANTIZE_ROWS) - 1)


def _may_exceed(size: Any, limit: int) -> bool:
    """``size > limit``, also for a symbolic (shape-polymorphic) size.

    A symbolic size that its constraints do not bound counts as exceeding: the path
    chosen must then suit any size (``jax.export`` with a symbolic batch).
    """
    try:
        return bool(size > limit)
    except jax.errors.InconclusiveDimensionOperation:
        return True


def _axes(axes: Sequence[int], ndim: int, name: str) -> tuple[int, ...]:
    out = []
    for a in axes:
        if not isinstance(a, int | np.integer) or isinstance(a, bool | np.bool_):
            raise ValueError(
                f"dimension_numbers: {name} axis {a!r} is not an int; allowed: axes in "
                f"{-ndim}..{ndim - 1}"
            )
        if not -ndim <= a < ndim:
            raise ValueError(
                f"dimension_numbers: {name}: axis {a} is out of range for rank {ndim}; "
                f"allowed: axes in {-ndim}..{ndim - 1}"
            )
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(
            f"dimension_numbers: {name}={tuple(axes)} repeats an axis; allowed: each axis once"
        )
    return tuple(out)


def check_dims(
    lshape: tuple[int, ...], rshape: tuple[int, ...], dimension_numbers: DimensionNumbers
) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]:
    """``dimension_numbers`` checked against the operand shapes, axes made non-negative.

    Raises:
        ValueError: Naming what is wrong: the structure, an axis, or sizes that differ.
    """
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(a) for a in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise ValueError(
            f"dimension_numbers={dimension_numbers!r}; allowed: ((lhs_contracting, "
            "rhs_contracting), (lhs_batch, rhs_batch)), each a sequence of axes"
        ) from None
    lc, lb = _axes(lc, len(lshape), "lhs contracting"), _axes(lb, len(lshape), "lhs batch")
    rc, rb = _axes(rc, len(rshape), "rhs contracting"), _axes(rb, len(rshape), "rhs batch")
    for kind, la, ra in (("contracting", lc, rc), ("batch", lb, rb)):
        if len(la) != len(ra):
            raise ValueError(
                f"dimension_numbers: lhs {kind} axes {la} and rhs {kind} axes {ra} differ in "
                "number; allowed: as many lhs as rhs axes"
            )
        sizes_l, sizes_r = [lshape[i] for i in la], [rshape[i] for i in ra]
        if sizes_l != sizes_r:
            raise ValueError(
                f"{kind} dims do not match: lhs axes {la} have sizes {sizes_l}, rhs axes {ra} "
                f"have sizes {sizes_r} (lhs shape {lshape}, rhs shape {rshape}); they must be "
                "equal"
            )
    if set(lc) & set(lb) or set(rc) & set(rb):
        raise ValueError(
            f"dimension_numbers={dimension_numbers!r}: an axis cannot be both contracting and batch"
        )
    return (lc, rc), (lb, rb)


def _canonical(x: Operand, contracting, batch, groups) -> tuple[Operand, int, int]:
    """Transposes to (batch, groups, contracting-rest, free) with contracting axes split.

    Returns the operand and the numbers of free axes and of contracting axes.
    """
    free = [i for i in range(x.ndim) if i not in contracting and i not in batch]
    perm = (*batch, *contracting, *free)
    nb, nc = len(batch), len(contracting)

    def arrange(a: Array, is_values: bool) -> Array:
        a = jnp.transpose(a, perm)
        split = []
        for j, g in enumerate(groups):
            d = a.shape[nb + j]
            if is_values:
                split.append((g, d // g))
            else:
                # A scale (or zero point) dim of t tiles, t dividing g: repeat to g.
                a = expand_axis(a, nb + j, g)
                split.append((g, 1))
        new_shape = (
            *a.shape[:nb],
            *(s for s, _ in split),
            *(r for _, r in split),
            *a.shape[nb + nc :],
        )
        # Reshape (g0, r0, g1, r1, ...) then move the g's before the r's.
        inter = (*a.shape[:nb], *(v for pair in split for v in pair), *a.shape[nb + nc :])
        a = a.reshape(inter)
        order = (
            *range(nb),
            *(nb + 2 * j for j in range(nc)),
            *(nb + 2 * j + 1 for j in range(nc)),
            *range(nb + 2 * nc, len(inter)),
        )
        return jnp.transpose(a, order).reshape(new_shape)

    values = arrange(x.values, True)
    scale = None if x.scale is None else arrange(x.scale, False)
    zp = None if x.zero_point is None else arrange(x.zero_point, False)
    return Operand(values, scale, zp, x.integer, x.dtype), len(free), nc


def expand_axis(a: Array, axis: int, size: int) -> Array:
    """Repeats ``a`` along ``axis`` from a divisor of ``size`` up to ``size``."""
    s = a.shape[axis]
    return numerics.repeat(a, size // s, axis)


def _groups(a: Operand, b: Operand, lc, rc) -> list[int]:
    groups = []
    for i, j in zip(lc, rc, strict=True):
        t_a = 1 if a.scale is None else a.scale.shape[i]
        t_b = 1 if b.scale is None else b.scale.shape[j]
        g = max(t_a, t_b)
        if g % t_a or g % t_b:
            k = a.shape[i]
            raise ValueError(
                f"incompatible tiles along contracting axes lhs {i} / rhs {j} (size {k}): "
                f"lhs has {t_a} scale tiles (tile {k // t_a}) and rhs has {t_b} (tile "
                f"{k // t_b}); one tile size must be a multiple of the other"
            )
        groups.append(g)
    return groups


# Above this many elements in the per-group result (output size x groups), fine scale
# tiles along a contracting axis (e.g. one activation scale per input channel) are
# cheaper to apply by dequantizing than as a group axis: 2**26 f32 = 256 MiB.
_MAX_GROUPED_ELEMENTS = 2**26


def scaled_dot_general(a: Operand, b: Operand, dims, precision: Any = None) -> Array:
    """The contraction of two normalised operands in float32 (see the module docstring)."""
    (lc, rc), (lb, rb) = dims
    groups = _groups(a, b, lc, rc)
    out_size = math.prod(a.shape[i] for i in range(a.ndim) if i not in lc)
    out_size *= math.prod(b.shape[i] for i in range(b.ndim) if i not in rc and i not in rb)
    if math.prod(groups) > 1 and _may_exceed(out_size * math.prod(groups), _MAX_GROUPED_ELEMENTS):
        return lax.dot_general(
            a.dequantized(), b.dequantized(), dims, precision, preferred_element_type=jnp.float32
        )
    a, nfa, nc = _canonical(a, lc, lb, groups)
    b, nfb, _ = _canonical(b, rc, rb, groups)
    integer = a.integer and b.integer
    if not integer:
        a, b = a.as_float(), b.as_float()
    nb, ng = len(lb), nc
    # Canonical layout: (batch nb, groups ng, rest nc, free).
    contract = tuple(range(nb + ng, nb + ng + nc))
    batch = tuple(range(nb + ng))
    acc_dtype = jnp.int32 if integer else jnp.float32
    acc = lax.dot_general(
        a.values,
        b.values,
        ((contract, contract), (batch, batch)),
        precision=None if integer else precision,
        preferred_element_type=acc_dtype,
    )
    # acc: (batch, groups, a free, b free)

    def to_out(x: Array, side: str) -> Array:
        """A per-side array in canonical layout (rest dims of size 1) -> output layout.

        Tiled dims are repeated up to the output's size; size-1 dims broadcast.
        """
        x = x.reshape(x.shape[: nb + ng] + x.shape[nb + ng + nc :])
        if side == "a":
            x = x.reshape(x.shape + (1,) * nfb)
        else:
            x = x.reshape(x.shape[: nb + ng] + (1,) * nfa + x.shape[nb + ng :])
        return expand(x, tuple(d if s != 1 else 1 for s, d in zip(x.shape, acc.shape, strict=True)))

    def sum_rest(x: Operand) -> Array:
        return jnp.sum(x.values, axis=contract, keepdims=True, dtype=acc_dtype)

    if a.zero_point is not None:
        acc = acc - to_out(a.zero_point, "a") * to_out(sum_rest(b), "b")
    if b.zero_point is not None:
        acc = acc - to_out(b.zero_point, "b") * to_out(sum_rest(a), "a")
    if a.zero_point is not None and b.zero_point is not None:
        k = math.prod(a.values.shape[nb + ng : nb + ng + nc])
        acc = acc + to_out(a.zero_point, "a") * to_out(b.zero_point, "b") * k

    def scaled(out: Array, sa: Array | None, sb: Array | None) -> Array:
        if sa is not None:
            out = out * to_out(sa, "a")
        if sb is not None:
            out = out * to_out(sb, "b")
        return jnp.sum(out, axis=tuple(range(nb, nb + ng))) if ng else out

    out = acc.astype(jnp.float32)
    grouped = math.prod(groups) > 1
    if grouped and _backend.platform() == "cpu" and not numerics._split_explicitly(out):
        # Each group's sums are scaled, then the groups added. With a scale that is a
        # constant of the jit (a weight closed over by the jitted function) XLA:CPU
        # compiled that multiply-and-sum differently (the constant inside the fusion)
        # and the outputs moved by float32 rounding: 690 of 2560 for int4 tiles with
        # int8 activations at 40 rows. As a conditional's branch it gets the scales
        # as operands either way (a barrier alone did not keep the constant out).
        # (Not under explicit sharding: there the conditional's untaken branch could not
        # give the taken one's sharded type, and XLA places the contraction itself.)
        shape = out.shape[:nb] + out.shape[nb + ng :]
        return kernels._opaque(scaled, shape, out, a.scale, b.scale)
    return scaled(out, a.scale, b.scale)

"""``conv_general_dilated`` with QArray operands, with an integer path.

The scaled path applies when the activation (lhs) scale varies at most along the
batch axis and the kernel (rhs) scale at most along the output-feature axis —
per-tensor, per-example and per-output-channel quantization, which is what
models use. Codes are then convolved directly (int8 × int8 → int32 when both are
integer QArrays), zero points are corrected with convolutions of ones (which
respect padding and dilation), and both scales multiply the output.

Any other scale layout (for example sub-channel tiles along the input features)
and ``batch_group_count > 1`` take the dequantize path: both operands are
dequantized to float32 and convolved with ``lax.conv_general_dilated``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from functools import partial
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import lax

from qcore.ops.operand import Operand, as_input, operand, preferred_dtype, promote
from qcore.qarray import QArray

Array = jax.Array


def conv_general_dilated(
    lhs: Array | QArray,
    rhs: Array | QArray,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Array:
    """``lax.conv_general_dilated`` where either operand may be a QArray.

    Arguments are those of ``lax.conv_general_dilated``, in every form it accepts
    (strides, dilations and padding pairs as lists, tuples or NumPy arrays of Python
    or NumPy integers; padding names in any case); the result dtype follows
    :func:`qcore.dot_general`'s rule.

    Raises:
        ValueError: Before any computation, naming the argument, its value and what
            is allowed: operands of different ranks, ``dimension_numbers`` that do not
            fit them, strides, padding, dilations or group counts of the wrong form,
            count or sign, lhs features that do not match the kernel's input features
            times ``feature_group_count``, or (with a QArray operand) a non-float
            ``preferred_element_type``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import qcore
        >>> x = jax.random.normal(jax.random.key(0), (1, 8, 8, 3))
        >>> k = jax.random.normal(jax.random.key(1), (3, 3, 3, 4))
        >>> kq = qcore.quantize(k, qcore.HowToQuantize(qtype="int8", channelwise_axes=(3,)))
        >>> y = qcore.conv_general_dilated(
        ...     x, kq, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        ... )
        >>> y.shape
        (1, 8, 8, 4)
    """
    lhs = as_input(lhs, "lhs")
    rhs = as_input(rhs, "rhs")
    conv = check_conv(
        tuple(lhs.shape),
        tuple(rhs.shape),
        window_strides,
        padding,
        lhs_dilation,
        rhs_dilation,
        dimension_numbers,
        feature_group_count,
        batch_group_count,
    )
    dn = conv.pop("dimension_numbers")
    if not isinstance(lhs, QArray) and not isinstance(rhs, QArray):
        return lax.conv_general_dilated(
            lhs,
            rhs,
            dimension_numbers=dn,
            precision=precision,
            preferred_element_type=preferred_element_type,
            **conv,
        )
    static = tuple(sorted(conv.items()))
    return _conv(lhs, rhs, dn, static, precision, preferred_dtype(preferred_element_type))


_PADDINGS = ("SAME", "SAME_LOWER", "VALID")


def check_conv(
    lshape: tuple[int, ...],
    rshape: tuple[int, ...],
    window_strides: Any,
    padding: Any,
    lhs_dilation: Any,
    rhs_dilation: Any,
    dimension_numbers: Any,
    feature_group_count: Any,
    batch_group_count: Any,
) -> dict[str, Any]:
    """The arguments of a convolution of these shapes, checked and made hashable.

    Accepts what ``lax.conv_general_dilated`` accepts: sequences (lists, tuples,
    NumPy arrays) of Python or NumPy integers, padding names in any case.

    Returns:
        The keyword arguments of ``lax.conv_general_dilated`` (tuples of ints, an
        upper-case padding name, ``ConvDimensionNumbers``).

    Raises:
        ValueError: Naming the argument, its value and what is allowed.
    """
    if len(lshape) != len(rshape) or len(rshape) < 2:
        raise ValueError(
            f"lhs of shape {lshape} (rank {len(lshape)}) and rhs of shape {rshape} (rank "
            f"{len(rshape)}); allowed: operands of the same rank >= 2"
        )
    try:
        dn = lax.conv_dimension_numbers(lshape, rshape, dimension_numbers)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"dimension_numbers={dimension_numbers!r} does not fit lhs {lshape} and rhs "
            f"{rshape}: {e} Allowed: None or (lhs, rhs, out) specs such as "
            "('NHWC', 'HWIO', 'NHWC')"
        ) from None
    n = len(rshape) - 2
    conv: dict[str, Any] = dict(
        window_strides=_ints("window_strides", window_strides, n, f"{n} integers >= 1"),
        padding=_padding(padding, n),
        lhs_dilation=_dilation("lhs_dilation", lhs_dilation, n),
        rhs_dilation=_dilation("rhs_dilation", rhs_dilation, n),
        dimension_numbers=dn,
        feature_group_count=_count("feature_group_count", feature_group_count),
        batch_group_count=_count("batch_group_count", batch_group_count),
    )
    features, per_group = lshape[dn.lhs_spec[1]], rshape[dn.rhs_spec[1]]
    groups = conv["feature_group_count"]
    if features != per_group * groups:
        raise ValueError(
            f"lhs has {features} input features (axis {dn.lhs_spec[1]} of shape {lshape}), "
            f"but rhs takes {per_group} per group (axis {dn.rhs_spec[1]} of shape {rshape}) "
            f"with feature_group_count={groups}; allowed: {per_group * groups} features"
        )
    return conv


def _index(v: Any) -> int | None:
    """``v`` as an int if it is an integer (Python, NumPy, 0-d array), else None."""
    try:
        return operator.index(v)
    except TypeError:
        return None


def _ints(name: str, value: Any, n: int, allowed: str, minimum: int = 1) -> tuple[int, ...]:
    try:
        items = [_index(v) for v in value]
    except TypeError:  # not iterable
        items = []
    if len(items) != n or any(v is None or v < minimum for v in items):
        raise ValueError(f"{name}={value!r}; allowed: {allowed}")
    return tuple(cast(list[int], items))


def _dilation(name: str, value: Any, n: int) -> tuple[int, ...] | None:
    return None if value is None else _ints(name, value, n, f"None or {n} integers >= 1")


def _count(name: str, value: Any) -> int:
    count = _index(value)
    if count is None or count < 1:
        raise ValueError(f"{name}={value!r}; allowed: an integer >= 1")
    return count


def _padding(padding: Any, n: int) -> str | tuple[tuple[int, int], ...]:
    allowed = (
        f"one of {', '.join(map(repr, _PADDINGS))} (any case) or {n} (low, high) pairs of integers"
    )
    if isinstance(padding, str):
        if padding.upper() not in _PADDINGS:
            raise ValueError(f"padding={padding!r}; allowed: {allowed}")
        return padding.upper()
    try:
        pairs = [_ints("padding", p, 2, allowed, minimum=-(2**62)) for p in padding]
    except (TypeError, ValueError):
        pairs = []
    if len(pairs) != n:
        raise ValueError(f"padding={padding!r}; allowed: {allowed}")
    return tuple(cast(tuple[int, int], p) for p in pairs)


# One compiled computation per call, so eager results are bit-identical to jitted ones.
@partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _conv(lhs, rhs, dn, static, precision, preferred_element_type) -> Array:
    conv = dict(static)
    batch_group_count = conv["batch_group_count"]
    a, b = operand(lhs), operand(rhs)
    out_dtype = jnp.dtype(preferred_element_type or promote(a.dtype, b.dtype))
    lhs_batch, rhs_out = dn.lhs_spec[0], dn.rhs_spec[0]
    scaled = (
        batch_group_count == 1
        and _varies_only_along(a, lhs_batch)
        and _varies_only_along(b, rhs_out)
    )
    if not scaled:
        y = lax.conv_general_dilated(
            a.dequantized(),
            b.dequantized(),
            dimension_numbers=dn,
            precision=precision,
            preferred_element_type=jnp.float32,
            **conv,
        )
        return y.astype(out_dtype)
    return _scaled_conv(a, b, dn, conv, precision).astype(out_dtype)


def _varies_only_along(x: Operand, axis: int) -> bool:
    if x.scale is None:
        return True
    return all(s == 1 for i, s in enumerate(x.scale.shape) if i != axis)


def _scaled_conv(a: Operand, b: Operand, dn, conv: dict[str, Any], precision) -> Array:
    integer = a.integer and b.integer
    if not integer:
        a, b = a.as_float(), b.as_float()
    acc_dtype = jnp.int32 if integer else jnp.float32
    groups = conv["feature_group_count"]

    def run(x: Array, k: Array) -> Array:
        return lax.conv_general_dilated(
            x,
            k,
            dimension_numbers=dn,
            precision=None if integer else precision,
            preferred_element_type=acc_dtype,
            **conv,
        )

    acc = run(a.values, b.values)
    lhs_feat, rhs_in = dn.lhs_spec[1], dn.rhs_spec[1]
    in_per_group = b.shape[rhs_in]
    # Ones with one feature per group, and kernels with one input feature: the
    # window sums of these convolutions see exactly the padding and dilation of
    # the main one (under jit they are dropped when no zero point needs them).
    ones_shape = list(a.shape)
    ones_shape[lhs_feat] = groups
    ones_lhs = jnp.ones(ones_shape, acc_dtype)
    kernel_shape = list(b.shape)
    kernel_shape[rhs_in] = 1
    ones_rhs = jnp.ones(kernel_shape, acc_dtype)
    if a.zero_point is not None:
        ksum = jnp.sum(b.values, axis=rhs_in, keepdims=True, dtype=acc_dtype)
        acc = acc - _to_out(a.zero_point, dn.lhs_spec[0], dn.out_spec[0], acc.ndim) * run(
            ones_lhs, ksum
        )
    if b.zero_point is not None:
        # Sum the activations within each feature group, then window-sum them.
        x = jnp.moveaxis(a.values, lhs_feat, -1)
        x = x.reshape(x.shape[:-1] + (groups, -1)).sum(axis=-1, dtype=acc_dtype)
        x = jnp.moveaxis(x, -1, lhs_feat)
        acc = acc - _to_out(b.zero_point, dn.rhs_spec[0], dn.out_spec[1], acc.ndim) * run(
            x, ones_rhs
        )
    if a.zero_point is not None and b.zero_point is not None:
        count = run(ones_lhs, ones_rhs) * in_per_group
        za = _to_out(a.zero_point, dn.lhs_spec[0], dn.out_spec[0], acc.ndim)
        zb = _to_out(b.zero_point, dn.rhs_spec[0], dn.out_spec[1], acc.ndim)
        acc = acc + za * zb * count
    out = acc.astype(jnp.float32)
    if a.scale is not None:
        out = out * _to_out(a.scale, dn.lhs_spec[0], dn.out_spec[0], out.ndim)
    if b.scale is not None:
        out = out * _to_out(b.scale, dn.rhs_spec[0], dn.out_spec[1], out.ndim)
    return out


def _to_out(x: Array, axis: int, out_axis: int, ndim: int) -> Array:
    """A scale / zero point varying only along ``axis`` -> broadcastable to the output."""
    v = x.reshape(x.shape[axis])
    shape = [1] * ndim
    shape[out_axis] = v.shape[0]
    return v.reshape(shape)

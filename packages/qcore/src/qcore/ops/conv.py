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

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qcore.ops.operand import Operand, as_input, operand, promote
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

    Arguments are those of ``lax.conv_general_dilated``; the result dtype follows
    :func:`qcore.dot_general`'s rule.

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
    conv: dict[str, Any] = dict(
        window_strides=window_strides,
        padding=padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
    )
    if not isinstance(lhs, QArray) and not isinstance(rhs, QArray):
        return lax.conv_general_dilated(
            lhs,
            rhs,
            dimension_numbers=dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
            **conv,
        )
    dn = lax.conv_dimension_numbers(tuple(lhs.shape), tuple(rhs.shape), dimension_numbers)
    static = tuple(sorted((k, _hashable(v)) for k, v in conv.items()))
    preferred = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
    return _conv(lhs, rhs, dn, static, precision, preferred)


def _hashable(v: Any) -> Any:
    if isinstance(v, str) or v is None or isinstance(v, int):
        return v
    return tuple(_hashable(e) for e in v)


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

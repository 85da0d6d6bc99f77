"""``dot`` and ``matmul`` (the ``@`` operator) with QArray operands."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qcore.ops.dot_general import dot_general
from qcore.ops.operand import as_input, operand, preferred_dtype, promote
from qcore.qarray import QArray, unpack

Array = jax.Array


def dot(
    a: Array | QArray,
    b: Array | QArray,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Array:
    """``jnp.dot`` semantics: contracts ``a``'s last axis with ``b``'s second-to-last.

    Example:
        >>> import jax.numpy as jnp
        >>> import qcore
        >>> how = qcore.HowToQuantize(qtype="int8", narrow_range=True)
        >>> w = qcore.quantize(jnp.eye(3), how)
        >>> qcore.dot(jnp.array([1.0, 2.0, 3.0]), w)
        Array([1., 2., 3.], dtype=float32)
    """
    a = as_input(a, "a")
    b = as_input(b, "b")
    if a.ndim == 0 or b.ndim == 0:
        x, y = operand(a), operand(b)
        quantized = isinstance(a, QArray) or isinstance(b, QArray)
        preferred = preferred_dtype(preferred_element_type) if quantized else preferred_element_type
        out_dtype = jnp.dtype(preferred or promote(x.dtype, y.dtype))
        return (x.dequantized() * y.dequantized()).astype(out_dtype)
    axis_b = 0 if b.ndim == 1 else b.ndim - 2
    return dot_general(
        a, b, (((a.ndim - 1,), (axis_b,)), ((), ())), precision, preferred_element_type
    )


def matmul(
    a: Array | QArray,
    b: Array | QArray,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Array:
    """``jnp.matmul`` semantics (``a @ b``): leading axes are batch axes.

    Batch axes must be equal, or one operand must be 1-D or 2-D; batch axes that
    need broadcasting are supported for plain arrays only.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import qcore
        >>> w = qcore.quantize(
        ...     jax.random.normal(jax.random.key(0), (5, 16, 8)),
        ...     qcore.HowToQuantize(qtype="int8", channelwise_axes=(0, 2)),
        ... )
        >>> qcore.matmul(jnp.ones((5, 2, 16)), w).shape
        (5, 2, 8)
    """
    a = as_input(a, "a")
    b = as_input(b, "b")
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul needs operands of rank >= 1, got ranks {a.ndim} and {b.ndim}")
    squeeze = []
    # Adding a unit axis to a packed vector would cut its packing: unpack it.
    a = unpack(a) if isinstance(a, QArray) and a.ndim == 1 else a
    b = unpack(b) if isinstance(b, QArray) and b.ndim == 1 else b
    if a.ndim == 1:
        a = a.reshape(1, a.shape[0])
        squeeze.append(-2)
    if b.ndim == 1:
        b = b.reshape(b.shape[0], 1)
        squeeze.append(-1)
    if b.ndim == 2:
        y = dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), precision, preferred_element_type)
    elif a.ndim == 2:
        # (M, K) x (..., K, N): dot_general gives (M, ..., N); move M next to N.
        y = dot_general(a, b, (((1,), (b.ndim - 2,)), ((), ())), precision, preferred_element_type)
        y = jnp.moveaxis(y, 0, -2)
    else:
        batch_a, batch_b = tuple(a.shape[:-2]), tuple(b.shape[:-2])
        if batch_a != batch_b:
            if isinstance(a, QArray) or isinstance(b, QArray):
                raise ValueError(
                    f"matmul of a QArray needs equal batch dims or a 2-D operand; got shapes "
                    f"{tuple(a.shape)} and {tuple(b.shape)}"
                )
            batch = jnp.broadcast_shapes(batch_a, batch_b)
            a = jnp.broadcast_to(a, batch + tuple(a.shape[-2:]))
            b = jnp.broadcast_to(b, batch + tuple(b.shape[-2:]))
        nb = a.ndim - 2
        dims = (((a.ndim - 1,), (b.ndim - 2,)), (tuple(range(nb)), tuple(range(nb))))
        y = dot_general(a, b, dims, precision, preferred_element_type)
    for axis in squeeze:
        y = jnp.squeeze(y, axis)
    return y

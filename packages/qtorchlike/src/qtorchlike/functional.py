"""Functions on arrays and QuantTensors, in ``torch.nn.functional``'s shape (NCHW).

Ops that keep every value on its quantization grid keep a QuantTensor's
metadata: ``relu``, ``hardtanh`` (when the bounds are on the grid it stays
valid), ``max_pool2d``, ``flatten``, ``reshape``, ``pad`` (with zeros),
``dropout`` in eval, nearest ``interpolate`` and ``cat`` of tensors on one grid.
``avg_pool2d`` returns the sum's grid: scale ``s / k²`` and a wider bit width,
as Brevitas does. Every other op gives a plain array (:func:`value` extracts it).

Example:
    >>> import jax.numpy as jnp
    >>> import qtorchlike.functional as F
    >>> from qtorchlike import QuantTensor
    >>> q = QuantTensor(jnp.array([[-1.0, 0.5]]), jnp.array(0.5), jnp.array(0.0), 8.0, True, False)
    >>> F.relu(q).int()
    Array([[0, 1]], dtype=int8)
    >>> F.cat([q, q], dim=1).shape
    (1, 4)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer

from qtorchlike import random
from qtorchlike.quant_tensor import QuantTensor


def value(x: Any) -> Any:
    """The plain array behind ``x`` (``x.value`` for a QuantTensor)."""
    return x.value if isinstance(x, QuantTensor) else x


def _keep(x: Any, out: jax.Array) -> Any:
    """``out`` as a QuantTensor on ``x``'s grid when ``x`` is one with a per-tensor scale."""
    if isinstance(x, QuantTensor) and x.is_per_tensor:
        return x._like(out)
    return out


def relu(x: Any) -> Any:
    """``max(x, 0)``; a QuantTensor stays on its grid (0 is a code)."""
    return _keep(x, jax.nn.relu(value(x)))


def hardtanh(x: Any, min_val: float = -1.0, max_val: float = 1.0) -> Any:
    """Clamps to ``[min_val, max_val]`` (plain array out)."""
    return jnp.clip(value(x), min_val, max_val)


def _pair(v: Any, name: str, lowest: int = 1) -> tuple[int, int]:
    out = (v, v) if isinstance(v, int) else tuple(v) if isinstance(v, tuple | list) else ()
    if len(out) != 2 or any(
        isinstance(i, bool) or not isinstance(i, int) or i < lowest for i in out
    ):
        raise ValueError(f"{name}={v!r} must be an int >= {lowest} or a pair of them")
    return out  # type: ignore[return-value]


def _check_nchw(x: jax.Array, fn: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"{fn} expects NCHW input (rank 4), got shape {tuple(x.shape)}")


def max_pool2d(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0) -> Any:
    """Max pooling over the last two axes of NCHW input; keeps a QuantTensor's grid."""
    v = value(x)
    _check_nchw(v, "max_pool2d")
    k = _pair(kernel_size, "kernel_size")
    s = _pair(stride if stride is not None else kernel_size, "stride")
    p = _pair(padding, "padding", lowest=0)
    pads = ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1]))
    out = lax.reduce_window(v, -jnp.inf, lax.max, (1, 1, *k), (1, 1, *s), pads)
    return _keep(x, out)


def avg_pool2d(x: Any, kernel_size: Any, stride: Any = None) -> Any:
    """Average pooling (no padding) over NCHW input.

    A per-tensor QuantTensor comes out on the grid of the window *sum*: scale
    ``s / k²`` and bit width ``ceil(log2((2^b - 1) k²))`` (the integer average
    is what :class:`~qtorchlike.nn.TruncAvgPool2d` computes from it).
    """
    v = value(x)
    _check_nchw(v, "avg_pool2d")
    k = _pair(kernel_size, "kernel_size")
    s = _pair(stride if stride is not None else kernel_size, "stride")
    summed = lax.reduce_window(v, 0.0, lax.add, (1, 1, *k), (1, 1, *s), "VALID")
    n = k[0] * k[1]
    out = summed / n
    if isinstance(x, QuantTensor) and x.is_per_tensor:
        bits = jnp.ceil(jnp.log2((jnp.exp2(x.bit_width) - 1) * n))
        return QuantTensor(out, x.scale / n, x.zero_point * n, bits, x.signed, x.training)
    return out


def flatten(x: Any, start_dim: int = 0, end_dim: int = -1) -> Any:
    """Flattens dims ``start_dim..end_dim``; keeps a per-tensor QuantTensor."""
    shape = value(x).shape
    n = len(shape)
    for name, d in (("start_dim", start_dim), ("end_dim", end_dim)):
        if not -n <= d < n:
            raise ValueError(
                f"flatten({name}={d}) is out of range for an input of rank {n}; "
                f"allowed: {-n}..{n - 1}"
            )
    start_dim %= n
    if isinstance(x, QuantTensor):
        return x.flatten(start_dim, end_dim)
    end = end_dim % n
    new = (*shape[:start_dim], int(np.prod(shape[start_dim : end + 1])), *shape[end + 1 :])
    return jnp.reshape(x, new)


def reshape(x: Any, shape: Sequence[int]) -> Any:
    """Reshapes; keeps a per-tensor QuantTensor."""
    if isinstance(x, QuantTensor):
        return x.reshape(tuple(shape))
    return jnp.reshape(x, tuple(shape))


def pad(x: Any, pad: Sequence[int], value_: float = 0.0) -> Any:
    """Pads the last dims, PyTorch order ``(left, right, top, bottom, ...)``, with a constant.

    A QuantTensor padded with 0 (a code when the zero point is 0) stays one.
    """
    v = value(x)
    if len(pad) % 2 or len(pad) // 2 > v.ndim:
        raise ValueError(f"pad={tuple(pad)} must hold (before, after) pairs for the last dims")
    pairs = [(0, 0)] * v.ndim
    for i in range(len(pad) // 2):
        pairs[v.ndim - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]))
    out = jnp.pad(v, pairs, constant_values=value_)
    return _keep(x, out) if value_ == 0 else out


def dropout(x: Any, p: float = 0.5, training: bool = True) -> Any:
    """Zeroes elements with probability ``p`` and scales the rest by ``1/(1-p)`` in training.

    In eval (or ``p=0``) it returns ``x`` unchanged (a QuantTensor stays one).
    """
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p < 1:
        raise ValueError(f"dropout(p={p!r}): p must be a number in [0, 1)")
    if not training or p == 0:
        return x
    v = value(x)
    keep = jax.random.bernoulli(random.next_key(), 1 - p, v.shape)
    return jnp.where(keep, v / (1 - p), jnp.zeros_like(v))


def cat(tensors: Sequence[Any], dim: int = 0) -> Any:
    """Concatenates along ``dim``.

    QuantTensors stay one when they share bit width and sign (always checked)
    and, in eval, scale and zero point. In training the output takes the mean
    scale (Brevitas' rule). Any plain array among the inputs gives a plain array.

    Raises:
        ValueError: On mismatched QuantTensors (the message says which field).
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat() needs at least one tensor")
    out = jnp.concatenate([value(t) for t in tensors], axis=dim)
    if not all(isinstance(t, QuantTensor) and t.is_per_tensor for t in tensors):
        return out
    first = tensors[0]
    training = any(t.training for t in tensors)
    for t in tensors[1:]:
        for field in ("bit_width", "signed") + (() if training else ("scale", "zero_point")):
            a, b = getattr(first, field), getattr(t, field)
            if isinstance(a, Tracer) or isinstance(b, Tracer):
                continue
            if not np.array_equal(np.asarray(a), np.asarray(b)):
                raise ValueError(
                    f"cat: QuantTensors have different {field} ({np.asarray(a).ravel()[:3]} vs "
                    f"{np.asarray(b).ravel()[:3]}); quantize the inputs with one shared "
                    "quantizer (QuantCat does) or concatenate the .value arrays"
                )
    if training:
        scale = sum(t.scale for t in tensors) / len(tensors)
        zp = sum(t.zero_point for t in tensors) / len(tensors)
        return QuantTensor(out, scale, zp, first.bit_width, first.signed, True)
    return first._like(out)


def interpolate(x: Any, scale_factor: Any = None, size: Any = None) -> Any:
    """Nearest-neighbour resizing of NCHW input by an integer factor or to ``size``.

    Output pixel ``i`` takes input pixel ``floor(i * in / out)``, PyTorch's
    ``mode="nearest"``. Nearest keeps every value, so a QuantTensor stays one.
    """
    v = value(x)
    _check_nchw(v, "interpolate")
    h, w = v.shape[2:]
    if size is not None:
        th, tw = _pair(size, "size")
    elif scale_factor is not None:
        fh, fw = _pair(scale_factor, "scale_factor")
        th, tw = h * fh, w * fw
    else:
        raise ValueError("interpolate needs scale_factor= or size=")
    rows = (np.arange(th) * h) // th
    cols = (np.arange(tw) * w) // tw
    out = jnp.take(jnp.take(v, jnp.asarray(rows), axis=2), jnp.asarray(cols), axis=3)
    return _keep(x, out)

"""Fake quantizations and quantized constants, marked in a JAX function for export.

A function traced by :func:`qort.export_function` is lowered op by op; a fake
quantization written as JAX arithmetic (divide, round, clip, multiply) would become
those float ops, which ONNX Runtime cannot run with integer kernels. The two
functions here mark such places instead. Each runs its arithmetic in JAX as one
``jax.jit`` call named ``qort_qdq_...`` or ``qort_dq_...``, so the function computes
what it computed before, and the converter writes the ONNX *QDQ format*:

- :func:`quantize_dequantize` becomes ``QuantizeLinear`` → (``Clip`` of the codes
  for ranges narrower than the 8-bit container, as Brevitas' QCDQ export writes
  them) → ``DequantizeLinear``;
- :func:`dequantize` of constant integer codes becomes ``DequantizeLinear`` of an
  integer initializer: the file holds the codes (weights, int32 biases).

Activation codes, and int8 constants without a zero point (weights), are stored as
uint8, signed ones as ``code + 128`` with the zero point moved by 128 (the same
values): fused with uint8 activations, ONNX
Runtime's x86 uint8 x int8 kernels add pairs of products in 16 bits and saturate on
CPUs without VNNI, where uint8 x uint8 is exact (measured on this project's AVX2
machine: ``QLinearConv`` off by up to 8.6 output units with int8 weights, exact
with uint8; ``benchmarks/qdq_fusion.py``); and ONNX Runtime leaves a ``Conv`` or
``Gemm`` unfused when a ``Clip`` sits between int8 ``QuantizeLinear`` and
``DequantizeLinear``.

A bias added to a ``Conv`` or a 2-D product after it (JAX's ``add``) is moved
into the ``Conv`` / a ``Gemm``, and ``max(x, 0)`` is written as ``Relu``: the forms
ONNX Runtime fuses into ``QLinearConv`` and ``QGemm``.

ONNX Runtime's graph optimizer fuses ``DequantizeLinear`` → ``Conv`` / ``MatMul`` /
``Gemm`` (→ ``QuantizeLinear``) into integer kernels (``QLinearConv``,
``QLinearMatMul``, ``MatMulIntegerToFloat``, ``QGemm``...); the validation report
says which products it fused (``qdq_products``, ``unfused_products``).

Rounding: ``QuantizeLinear`` divides in float32 and rounds half to even. A
``reference`` function that computes the quotient otherwise (XLA multiplies by
``fl(1/scale)``; qcore sends values within 32 ulps above ``-127.5`` to ``-128``)
can give a code one step away where the quotient is a rounding tie up to float32
rounding; validation allows exactly those steps and counts them (``qdq_steps``).

Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> import qort
    >>> from qort import qdq
    >>> w = np.array([[2, -3], [1, 127]], np.int8)
    >>> def f(x):
    ...     xq = qdq.quantize_dequantize(x, np.float32(0.5), qmin=-8, qmax=7)  # 4-bit
    ...     return xq @ qdq.dequantize(w, np.array([0.25, 0.125], np.float32), axis=1)
    >>> exported = qort.export_function(f, jnp.zeros((1, 2)))
    >>> [n.op_type for n in exported.model.graph.node][:5]  # then a Reshape, an Identity
    ['QuantizeLinear', 'Clip', 'DequantizeLinear', 'DequantizeLinear', 'MatMul']
    >>> qort.Session(exported)(np.array([[1.2, -9.0]], np.float32)).tolist()
    [[-0.5, -63.875]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from qort._errors import ExportError

__all__ = ["Mark", "dequantize", "mark_of", "quantize_dequantize"]

PREFIX = "qort_qdq_"
DQ_PREFIX = "qort_dq_"
# Integer types a dequantized constant may be stored as (ONNX DequantizeLinear, opset 21).
CODE_DTYPES = ("int8", "uint8", "int16", "uint16", "int32")


@dataclasses.dataclass(frozen=True)
class Mark:
    """What a marked call computes (kept under its jit name; see :func:`mark_of`).

    Attributes:
        kind: ``"quantize_dequantize"`` or ``"dequantize"``.
        qmin: The smallest code.
        qmax: The largest code.
        axis: The axis the scale runs along (None: one scale).
        storage: The codes' integer dtype name (``"int8"``, ``"uint8"``, ...).
    """

    kind: str
    qmin: int
    qmax: int
    axis: int | None
    storage: str


_MARKS: dict[str, Mark] = {}


def mark_of(name: str) -> Mark | None:
    """The :class:`Mark` of a jit call named ``name``, or None if it is not a mark."""
    return _MARKS.get(name) if name.startswith((PREFIX, DQ_PREFIX)) else None


def _register(mark: Mark) -> str:
    prefix = PREFIX if mark.kind == "quantize_dequantize" else DQ_PREFIX
    name = f"{prefix}{mark.storage}_{mark.qmin}_{mark.qmax}_{mark.axis}"
    _MARKS.setdefault(name, mark)
    return name


def _concrete(value: Any, what: str, fn: str) -> np.ndarray:
    if isinstance(value, Tracer):
        raise ExportError(
            f"{fn}: {what} is traced (computed inside jax.jit); allowed: a concrete array "
            "(NumPy or JAX) known when the function is traced, e.g. a calibrated scale"
        )
    return np.asarray(value)


def _axis(x_shape: tuple[int, ...], shape: tuple[int, ...], what: str, fn: str) -> int | None:
    """The axis of ``x`` a scale of ``shape`` (broadcast against ``x``) runs along."""
    rank = len(x_shape)
    big = [i for i, n in enumerate(shape) if n != 1]
    aligned = len(shape) <= rank and all(
        n in (1, x_shape[rank - len(shape) + i]) for i, n in enumerate(shape)
    )
    if len(big) > 1 or not aligned:
        raise ExportError(
            f"{fn}: {what} of shape {shape} for values of shape {x_shape}; allowed: one "
            "value, or one per index of a single axis, broadcasting against the values "
            "(e.g. (1, C, 1, 1) for NCHW)"
        )
    return rank - len(shape) + big[0] if big else None


def _scale(scale: Any, fn: str) -> np.ndarray:
    s = _concrete(scale, "scale", fn)
    if not np.issubdtype(s.dtype, np.floating) or not np.all(np.isfinite(s) & (s > 0)):
        raise ExportError(
            f"{fn}: scale of dtype {s.dtype} with values {s.ravel()[:4].tolist()}...; allowed: "
            "finite float values > 0"
        )
    return s.astype(np.float32)


def _zero_point(zero_point: Any, scale: np.ndarray, lo: int, hi: int, fn: str) -> np.ndarray:
    if zero_point is None:
        return np.zeros(scale.shape, np.float32)
    z = _concrete(zero_point, "zero_point", fn)
    if z.size not in (1, scale.size) or not np.all(z == np.round(z)):
        raise ExportError(
            f"{fn}: zero_point {z.ravel()[:4].tolist()} of shape {z.shape}; allowed: integer "
            f"values shaped like the scale {scale.shape}"
        )
    if np.any(z < lo) or np.any(z > hi):
        raise ExportError(
            f"{fn}: zero_point in [{z.min()}, {z.max()}] outside the codes' range [{lo}, {hi}]"
        )
    return np.broadcast_to(z.astype(np.float32), scale.shape).copy()


def quantize_dequantize(
    x: Any,
    scale: Any,
    zero_point: Any = None,
    *,
    qmin: int,
    qmax: int,
    reference: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """``(clip(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale``, marked.

    Exported as ``QuantizeLinear`` → (``Clip``) → ``DequantizeLinear`` (see the
    module). The codes are uint8, signed ones stored as ``code + 128`` with zero
    point ``zero_point + 128`` (the same values; ONNX Runtime's x86 kernels take
    uint8 activations); a range narrower than the 8-bit container (4-bit, narrow
    int8) adds a ``Clip`` of the codes. It marks a model for export: without a
    ``reference``, its gradient is that of the rounding, zero (no straight-through
    estimator).

    Args:
        x: The float values.
        scale: Concrete float32 scale(s): one value, or one per index of one axis of
            ``x`` in a shape that broadcasts against it (``(1, C, 1, 1)``).
        zero_point: Concrete integer-valued zero point(s) shaped like ``scale``
            (default 0).
        qmin: The smallest code (-128 <= qmin; 0 <= qmin for unsigned codes).
        qmax: The largest code (qmax <= 127 for signed, 255 for unsigned codes).
        reference: Computes the value in JAX instead of the formula above, as
            ``reference(x, scale, zero_point)`` with ``scale`` and ``zero_point``
            broadcastable to ``x``: the model's own fake quantization, so the
            function's result is the model's. Validation compares ONNX Runtime's
            codes with the ones it implies.

    Returns:
        The fake-quantized ``x`` (float32).

    Raises:
        qort.ExportError: A range that fits neither int8 nor uint8, a traced or
            non-positive scale, or a scale or zero point of another shape.

    Example:
        >>> import numpy as np
        >>> from qort import qdq
        >>> qdq.quantize_dequantize(
        ...     np.array([0.3, 9.0], np.float32), np.float32(0.25), qmin=0, qmax=15
        ... ).tolist()
        [0.25, 3.75]
    """
    fn = "quantize_dequantize"
    ok = isinstance(qmin, int) and isinstance(qmax, int) and qmin < qmax
    signed, unsigned = qmin >= -128 and qmax <= 127, qmin >= 0 and qmax <= 255
    if not ok or not (signed or unsigned):
        raise ExportError(
            f"{fn}(qmin={qmin!r}, qmax={qmax!r}); allowed: integers qmin < qmax within "
            "int8 [-128, 127] or uint8 [0, 255] (the codes' 8-bit container)"
        )
    s = _scale(scale, fn)
    xs = tuple(np.shape(x))
    axis = _axis(xs, tuple(s.shape), "scale", fn)
    z = _zero_point(zero_point, s, qmin, qmax, fn)
    storage = "int8" if qmin < 0 else "uint8"
    name = _register(Mark("quantize_dequantize", qmin, qmax, axis, storage))

    def body(x: jax.Array, s: jax.Array, z: jax.Array) -> jax.Array:
        x = jnp.asarray(x, jnp.float32)
        if reference is not None:
            return jnp.asarray(reference(x, s, z), jnp.float32)
        return (jnp.clip(jnp.round(x / s) + z, qmin, qmax) - z) * s

    body.__name__ = body.__qualname__ = name
    return jax.jit(body)(x, s, z)


def dequantize(codes: Any, scale: Any, zero_point: Any = None, *, axis: int | None = None) -> Any:
    """``(codes - zero_point) * scale`` of constant integer codes, marked.

    Exported as ``DequantizeLinear`` of an initializer holding the codes in their own
    integer type (weights in int8, biases in int32).

    Args:
        codes: Concrete integer codes (int8, uint8, int16, uint16 or int32).
        scale: Concrete float32 scale(s): one value, one per index of ``axis`` (1-D,
            ONNX's layout), or a shape broadcasting against ``codes`` with one axis
            of length > 1 (``(C, 1, 1, 1)``).
        zero_point: Integer zero point(s) shaped like ``scale`` (default 0).
        axis: The axis of a 1-D ``scale``.

    Returns:
        The float32 values.

    Raises:
        qort.ExportError: Codes that are traced or not integers, or scales that do not
            fit them.

    Example:
        >>> import numpy as np
        >>> from qort import qdq
        >>> qdq.dequantize(
        ...     np.array([[1, -2]], np.int8), np.array([0.5, 2.0], np.float32), axis=1
        ... ).tolist()
        [[0.5, -4.0]]
    """
    fn = "dequantize"
    c = _concrete(codes, "codes", fn)
    if c.dtype.name not in CODE_DTYPES:
        raise ExportError(
            f"{fn}: codes of dtype {c.dtype}; allowed: integer codes of dtype "
            + ", ".join(CODE_DTYPES)
        )
    s = _scale(scale, fn)
    if s.ndim == 1 and axis is not None:
        if not -c.ndim <= axis < c.ndim or c.shape[axis] != s.size:
            raise ExportError(
                f"{fn}: axis={axis} with {s.size} scales for codes of shape {c.shape}; "
                "allowed: an axis of that length"
            )
        axis %= c.ndim
        s = s.reshape([-1 if a == axis else 1 for a in range(c.ndim)])
    found = _axis(tuple(c.shape), tuple(s.shape), "scale", fn)
    info = np.iinfo(c.dtype)
    z = _zero_point(zero_point, s, int(info.min), int(info.max), fn)
    name = _register(Mark("dequantize", int(info.min), int(info.max), found, c.dtype.name))

    def body(c: jax.Array, s: jax.Array, z: jax.Array) -> jax.Array:
        return (c.astype(jnp.float32) - z) * s

    body.__name__ = body.__qualname__ = name
    return jax.jit(body)(c, s, z)

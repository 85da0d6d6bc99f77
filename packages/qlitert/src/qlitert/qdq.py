"""Quantize/dequantize annotations that the LiteRT converter turns into integer kernels.

:func:`fake_quant` returns ``x`` quantized and dequantized with fixed (numpy)
parameters, as a ``jax.lax.composite`` named ``quant.fake_quant``: JAX runs its
decomposition, and litert-converter (strict QDQ mode) reads the attributes —
``scale`` (f32, 1-D), ``zero_point`` (i64, 1-D), ``dtype`` (TFLite's ``"i8"``,
``"i16"``, ``"i4"``), ``narrow_range`` and, for per-channel scales,
``quantization_dimension`` — and makes the tensor a quantized one.
:func:`quantize` / :func:`dequantize` (``quant.quantize`` / ``quant.dequantize``)
at a function's boundary give a model with integer inputs and outputs.

The decompositions mirror TFLite's kernels, so each op of a converted model agrees
with JAX within one step (:mod:`qlitert.validation`): values are rounded half away
from zero (TFLite's ``QUANTIZE`` uses ``std::round``) and clipped to the code
range; weights are
symmetric and narrow-range (``[-127, 127]``) per output channel; activations are
asymmetric with zero exactly representable (:func:`activation_params`).

Rounding, clipping and the code ranges are qcore's
(:func:`qcore.numerics.round_values` with ``"away_from_zero"``,
:func:`qcore.numerics.saturate`, :mod:`qcore.qtypes`); this module keeps what is
TFLite's: which parameters each tensor kind gets, the order of rounding and zero
point, average pooling's integer rounding, and the composites the converter
reads. The scales stay computed here (:func:`range_params`).

Types are named as in qcore: ``qtype="int8"`` (the default), ``"int16"`` or
``"int4"``, or a :class:`qcore.QType` of those. The former ``dtype="i8"`` /
``"i16"`` / ``"i4"`` (TFLite's codes) still work, with a ``DeprecationWarning``.

Example:
    >>> import numpy as np, jax.numpy as jnp
    >>> from qlitert import qdq
    >>> scale, zp = qdq.activation_params(-1.0, 3.0)
    >>> float(scale[0]), int(zp[0])
    (0.01568627..., -64)
    >>> qdq.fake_quant(jnp.array([0.0, 0.5, 10.0]), scale, zp).tolist()
    [0.0, 0.50196..., 3.0]
    >>> scale, zp = qdq.activation_params(-1.0, 3.0, qtype="int16")  # symmetric
    >>> float(scale[0]) * 32767, int(zp[0])
    (3.0..., 0)
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qcore import numerics, qtypes

# LiteRT's quantized types: qcore's name -> TFLite's code (the composites' ``dtype``
# attribute, which the converter reads, and qlitert's former, deprecated spelling).
CODES = {"int8": "i8", "int16": "i16", "int4": "i4"}
QTYPES = {name: qtypes.get(name) for name in CODES}
RANGES = {name: (int(q.qmin), int(q.qmax)) for name, q in QTYPES.items()}
STORAGE = {"int8": jnp.int8, "int16": jnp.int16, "int4": jnp.int4}
_QTypeArg = str | qtypes.QType | None
# Set by qlitert.validation while it replays a model layer by layer: called with
# each per-tensor activation fake quantization (result, scale, zero point, qtype,
# site name), it returns the value the model goes on with.
_TAP: contextvars.ContextVar[Callable[..., jax.Array] | None] = contextvars.ContextVar(
    "qlitert_tap", default=None
)


def qtype_name(
    qtype: _QTypeArg = None, *, dtype: Any = None, arg: str = "qtype", stacklevel: int = 2
) -> str:
    """The qcore name of a LiteRT type: ``"int8"``, ``"int16"`` or ``"int4"``.

    How every qlitert function reads its ``qtype`` argument. TFLite's codes
    (``"i8"``, ``"i16"``, ``"i4"``) and the keyword ``dtype=``, qlitert's former
    spelling, still work, with a ``DeprecationWarning`` naming the new spelling.

    Args:
        qtype: A name, a :class:`qcore.QType` of one, or None for ``"int8"``.
        dtype: qlitert's former keyword for ``qtype`` (deprecated).
        arg: The argument's name, for messages.
        stacklevel: Where deprecations warn: 1 at the caller of this function, 2
            (the default) at its caller's caller (where a function taking
            ``qtype`` was called).

    Raises:
        ValueError: For another type (naming ``arg``, the value and the allowed
            names) or both ``qtype`` and ``dtype``.

    Example:
        >>> import qcore
        >>> from qlitert import qdq
        >>> qdq.qtype_name("int16"), qdq.qtype_name(qcore.qtypes.get("int4")), qdq.qtype_name()
        ('int16', 'int4', 'int8')
    """
    if dtype is not None and qtype is not None:
        raise ValueError(
            f"dtype={dtype!r} and qtype={qtype!r} were both given; pass qtype= only "
            "(dtype= is its deprecated spelling)"
        )
    if dtype is not None:
        name, _ = _name(dtype, "dtype")
        message = f"dtype={dtype!r} is deprecated; use qtype={name!r}"
    elif qtype is None:
        return "int8"
    else:
        name, code = _name(qtype, arg)
        if not code:
            return name
        message = f"{arg}={qtype!r} is deprecated; use {arg}={name!r}"
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)
    return name


def _name(value: Any, arg: str) -> tuple[str, bool]:
    """The qcore name of ``value`` and whether it was a (deprecated) TFLite code."""
    old = {code: name for name, code in CODES.items()}
    if isinstance(value, str) and value in old:
        return old[value], True
    try:
        name = qtypes.get(value).name
    except ValueError:
        name = value
    if not (isinstance(name, str) and name in CODES):
        raise ValueError(
            f"{arg}={name!r} is not a LiteRT quantized type; allowed: {list(CODES)} "
            f"or a qcore.QType of those (deprecated: TFLite's codes {list(old)})"
        )
    return name, False


@contextlib.contextmanager
def _untapped() -> Iterator[None]:
    """Fake quantizations inside are not replayed by the layer-by-layer validation."""
    token = _TAP.set(None)
    try:
        yield
    finally:
        _TAP.reset(token)


def round_half_away(v: jax.Array) -> jax.Array:
    """Rounds to nearest, ties away from zero (C's ``round``, as TFLite rounds).

    qcore's :func:`~qcore.numerics.round_values` with ``"away_from_zero"``.
    """
    return numerics.round_values(v, "away_from_zero")


def activation_params(
    lo: Any, hi: Any, qtype: _QTypeArg = None, *, dtype: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """TFLite's ``(scale, zero_point)`` for activations in the range ``[lo, hi]``.

    int8 (and int4) activations are asymmetric: the range is widened to contain 0,
    and the zero point is rounded to an integer code so that 0.0 is exactly
    representable (TFLite's nudging). int16 activations are symmetric with zero
    point 0 (TFLite's 16x8 kernels require it). ``qtype``: see :func:`qtype_name`
    (``dtype``: deprecated). Returns 1-element float32 / int64 arrays.
    """
    lo, hi = float(np.min(lo)), float(np.max(hi))
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise ValueError(f"lo={lo}, hi={hi}: the range is not finite; allowed: finite bounds")
    scale, zero_point = range_params(lo, hi, qtype_name(qtype, dtype=dtype), np)
    return np.array([scale], np.float32), np.array([zero_point], np.int64)


def range_params(
    lo: Any, hi: Any, qtype: _QTypeArg = None, xp: Any = jnp, *, dtype: str | None = None
) -> tuple[Any, Any]:
    """:func:`activation_params` as scalars, with numpy (``xp=np``) or traced (``jnp``).

    QAT computes the parameters from ranges that change during training. A NaN
    or inf bound gives a NaN scale.

    Not :func:`qcore.numerics.scale_from_range`, on purpose: that computes in
    float32 (``xp=np`` here in float64) and can differ by a unit in the last place
    of the scale, which moves tie zero points (``[-2, 2]`` gets -1, not 0).
    """
    name = qtype_name(qtype, dtype=dtype)
    qmin, qmax = RANGES[name]
    lo, hi = xp.minimum(lo, 0.0), xp.maximum(hi, 0.0)
    finite = xp.isfinite(hi - lo)  # a NaN or inf range gives a NaN scale (the NaN policy)
    if name == "int16":
        absmax = xp.maximum(-lo, hi)
        scale = xp.where(absmax > 0, absmax / qmax, 1.0)
        return xp.where(finite, scale, np.nan), xp.zeros_like(absmax)
    scale = xp.where(finite, xp.where(hi > lo, (hi - lo) / (qmax - qmin), 1.0), np.nan)
    return scale, xp.clip(xp.round(qmin - lo / scale), qmin, qmax)


def weight_scales(
    w: Any, axis: int, qtype: _QTypeArg = None, *, dtype: str | None = None
) -> np.ndarray:
    """Symmetric narrow-range scales, one per index of ``axis`` (``absmax / qmax``).

    A channel holding NaN or inf gets a NaN scale (qlitert's NaN policy). In
    numpy: :func:`qcore.numerics.scale_from_range` rounds some scales differently
    by a unit in the last place (see :func:`range_params`). ``qtype``: see
    :func:`qtype_name` (``dtype``: deprecated).
    """
    _, qmax = RANGES[qtype_name(qtype, dtype=dtype)]
    w = np.asarray(w, np.float32)
    reduce = tuple(a for a in range(w.ndim) if a != axis % w.ndim)
    absmax = np.max(np.abs(w), axis=reduce)
    scale = np.where(absmax > 0, absmax / qmax, 1.0)
    return np.where(np.isfinite(absmax), scale, np.nan).astype(np.float32)  # the NaN policy


def _params(scale: Any, zero_point: Any, axis: int | None, ndim: int) -> dict[str, Any]:
    scale = np.asarray(scale, np.float32).reshape(-1)
    zp = np.zeros_like(scale, np.int64) if zero_point is None else np.asarray(zero_point)
    zp = zp.astype(np.int64).reshape(-1)
    if zp.size != scale.size:
        raise ValueError(f"zero_point has {zp.size} entries, scale {scale.size}")
    if not np.all(scale > 0) or not np.all(np.isfinite(scale)):
        raise ValueError(f"scale={scale.tolist()}; allowed: scales that are finite and > 0")
    attrs: dict[str, Any] = {"scale": scale, "zero_point": zp}
    if scale.size > 1:
        if axis is None:
            raise ValueError(f"{scale.size} scales need axis= (the quantized dimension)")
        attrs["quantization_dimension"] = int(axis % ndim)
    return attrs


def _broadcast(v: np.ndarray, x: jax.Array, axis: int | None) -> jax.Array:
    shape = [1] * x.ndim
    if v.size > 1 and axis is not None:
        shape[axis % x.ndim] = v.size
    return jnp.asarray(v, jnp.float32).reshape(shape)


def quantize_dequantize(
    x: jax.Array,
    scale: Any,
    zero_point: Any,
    qmin: int,
    qmax: int,
    *,
    pool_count: int | None = None,
) -> jax.Array:
    """The numerics of :func:`fake_quant` with broadcastable, possibly traced parameters.

    No annotation: QAT uses it with parameters computed from moving ranges.
    """
    if pool_count is not None:
        q = _pooled_codes(x, scale, zero_point, pool_count)
    else:
        q = round_half_away(x.astype(jnp.float32) / scale) + zero_point
    q = numerics.saturate(q, qmin, qmax)
    return nan_blocks(x, (q - zero_point) * scale, jnp.shape(scale)).astype(x.dtype)


_quantize_dequantize_jit = jax.jit(
    quantize_dequantize, static_argnums=(3, 4), static_argnames=("pool_count",)
)


def nan_blocks(x: jax.Array, y: jax.Array, scale_shape: tuple[int, ...]) -> jax.Array:
    """``y`` with NaN in every block of ``x`` that holds a NaN or inf.

    A block is the values that share one scale (of shape ``scale_shape``,
    broadcastable to ``x``): the whole tensor for a per-tensor scale, a channel
    for per-channel ones. qlitert's NaN policy: quantization never turns a
    non-finite value into a finite one.
    """
    full = (1,) * (x.ndim - len(scale_shape)) + tuple(scale_shape)
    axes = tuple(a for a in range(x.ndim) if full[a] == 1)
    bad = jnp.any(~jnp.isfinite(x), axis=axes, keepdims=True)
    return jnp.where(bad, jnp.nan, y)


def _pooled_codes(mean: jax.Array, scale: Any, zero_point: Any, n: int) -> jax.Array:
    """The code TFLite's average pooling gives for the mean of ``n`` codes.

    Its int8 kernel (reference and optimized; XNNPACK does not take int8 average
    pooling) sums the window's codes, zero point included, and divides in
    integers, rounding half away from zero: ``(acc ± n/2) / n`` truncated. Ties
    are common (a quarter of 2x2 windows), so the sum is recovered exactly from
    the mean of the fake-quantized inputs and divided in integers: a float
    division lands ties on either side (and XLA turns ``/ 6`` into ``* (1/6)``).
    """
    acc = (jnp.round(mean.astype(jnp.float32) * n / scale) + n * zero_point).astype(jnp.int32)
    half = n // 2
    q = jnp.where(acc > 0, (acc + half) // n, -((half - acc) // n))
    return q.astype(jnp.float32)


def fake_quant(
    x: jax.Array,
    scale: Any,
    zero_point: Any = None,
    *,
    narrow_range: bool = False,
    axis: int | None = None,
    qtype: _QTypeArg = None,
    pool_count: int | None = None,
    composite: bool = True,
    dtype: str | None = None,
    site: str | None = None,
) -> jax.Array:
    """``x`` quantized and dequantized, annotated as ``quant.fake_quant``.

    Quantization never turns a non-finite value into a finite one: every block
    of values that share a scale (all of ``x`` for one scale, an index of
    ``axis`` for per-channel scales) holding a NaN or inf comes back all NaN.

    Args:
        x: A floating-point array.
        scale: One scale, or one per index of ``axis``.
        zero_point: Integer zero point(s) like ``scale``; None for 0.
        narrow_range: Skip the most negative code (symmetric weights).
        axis: The quantized dimension of per-channel scales.
        qtype: ``"int8"`` (the default), ``"int16"`` or ``"int4"``, or a
            :class:`qcore.QType` of those (:func:`qtype_name`).
        pool_count: ``x`` is the average of this many values already quantized
            with the same parameters (``AVERAGE_POOL_2D``, which keeps its input's
            scale): round as that kernel does. Only JAX's numerics change; the
            annotation is the same.
        composite: False returns the same numerics without the annotation
            (differentiable by ``jax.grad``, which composites are not).
        dtype: Deprecated spelling of ``qtype`` (TFLite's ``"i8"``, ``"i16"``, ``"i4"``).
        site: A name for this quantization in the layer-by-layer validation's
            reports (:func:`qlitert.compare_layers`); no effect on the model.

    Raises:
        TypeError: For an integer or boolean ``x``: such tensors are not quantized.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        # An integer tensor (indices, an argmax) has no scale: a fake quant on it
        # crashed litert-converter 0.5.0 with a segmentation fault.
        raise TypeError(f"x has dtype {x.dtype}; allowed: a floating-point array")
    name = qtype_name(qtype, dtype=dtype)
    qmin, qmax = RANGES[name]
    qmin += int(narrow_range)
    attrs = _params(scale, zero_point, axis, x.ndim)
    attrs |= {"dtype": CODES[name], "narrow_range": bool(narrow_range)}

    def decomposition(x: jax.Array, **a: Any) -> jax.Array:
        s = _broadcast(a["scale"], x, axis)
        z = _broadcast(a["zero_point"].astype(np.float32), x, axis)
        return quantize_dequantize(x, s, z, qmin, qmax, pool_count=pool_count)

    tap = _TAP.get()
    if tap is not None:
        # The same numerics, compiled once per shape: run eagerly, the decomposition
        # compiles a dozen ops per shape and a composite compiles anew per scale.
        s = _broadcast(attrs["scale"], x, axis)
        z = _broadcast(attrs["zero_point"].astype(np.float32), x, axis)
        y = _quantize_dequantize_jit(x, s, z, qmin, qmax, pool_count=pool_count)
    elif not composite:
        y = decomposition(x, **attrs)
    elif x.ndim > 4 and axis is None:
        # litert-converter 0.5.0 fails to legalize the quantization of a tensor of more
        # than 4 dimensions (nnx.MultiHeadAttention makes 5): the annotation is on a
        # 4-d view, between reshapes (scale-preserving in LiteRT).
        flat = jnp.reshape(x, (-1, *x.shape[-3:]))
        fq = jax.lax.composite(decomposition, name="quant.fake_quant")(flat, **attrs)
        y = jnp.reshape(fq, x.shape)
    else:
        y = jax.lax.composite(decomposition, name="quant.fake_quant")(x, **attrs)
    if tap is None or narrow_range or attrs["scale"].size != 1:
        return y  # weights (narrow range, per channel) are constants of the model
    return tap(y, attrs["scale"][0], attrs["zero_point"][0], name, site)


def quantize(
    x: jax.Array,
    scale: Any,
    zero_point: Any = None,
    *,
    qtype: _QTypeArg = None,
    dtype: str | None = None,
) -> jax.Array:
    """Float → integer codes, annotated as ``quant.quantize`` (a model's int input).

    Codes cannot hold NaN: the codes of an ``x`` with NaN or inf are meaningless
    (:class:`qlitert.LiteRTModel` refuses such inputs for integer outputs).
    ``qtype``: see :func:`qtype_name` (``dtype``: deprecated).
    """
    name = qtype_name(qtype, dtype=dtype)
    qmin, qmax = RANGES[name]
    attrs = _params(scale, zero_point, None, x.ndim) | {"dtype": CODES[name], "narrow_range": False}
    if attrs["scale"].size != 1:
        raise ValueError("quantize() takes one scale (model inputs are quantized per tensor)")

    # Python scalars, not arrays: the converter does not recognise a boundary
    # composite whose decomposition multiplies by a broadcast array constant.
    def decomposition(x: jax.Array, **a: Any) -> jax.Array:
        s, z = float(a["scale"][0]), float(a["zero_point"][0])
        q = numerics.saturate(round_half_away(x.astype(jnp.float32) / s) + z, qmin, qmax)
        return q.astype(STORAGE[name])

    return jax.lax.composite(decomposition, name="quant.quantize")(x, **attrs)


def dequantize(
    q: jax.Array,
    scale: Any,
    zero_point: Any = None,
    *,
    qtype: _QTypeArg = None,
    dtype: str | None = None,
) -> jax.Array:
    """Integer codes → float, annotated as ``quant.dequantize`` (a model's int output).

    ``qtype``: see :func:`qtype_name` (``dtype``: deprecated).
    """
    code = CODES[qtype_name(qtype, dtype=dtype)]
    attrs = _params(scale, zero_point, None, q.ndim) | {"dtype": code, "narrow_range": False}
    if attrs["scale"].size != 1:
        raise ValueError("dequantize() takes one scale (model outputs are quantized per tensor)")

    def decomposition(q: jax.Array, **a: Any) -> jax.Array:
        s, z = float(a["scale"][0]), float(a["zero_point"][0])  # scalars: see quantize
        return (q.astype(jnp.float32) - z) * s

    return jax.lax.composite(decomposition, name="quant.dequantize")(q, **attrs)

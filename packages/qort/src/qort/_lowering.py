"""Float and integer jaxpr primitives as ONNX nodes.

Each lowering takes the graph, the equation and its input values (at least one a
:class:`~qort._graph.Tensor`; equations on constants only are folded by the
converter) and returns the names of its outputs. The table :data:`LOWERINGS` maps
primitive names to lowerings; :func:`lower` raises :class:`~qort.ExportError` for
the rest, naming the primitive.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from qort._errors import ExportError
from qort._graph import Const, Graph, Tensor, Value, onnx_dtype

Lowering = Callable[[Graph, Any, list[Value]], list[str]]


# A folded constant larger than this is stored without its repeated axes (see name).
_REPEAT_CHECK_BYTES = 1 << 16


def name(g: Graph, v: Value) -> str:
    """The graph name of ``v``; a constant becomes an initializer.

    A constant whose values are all equal (a folded mask fill, ``ones`` scales) is
    stored as one value and an ``Expand`` where that is smaller, whatever its size,
    so the file does not grow with the example's shapes. A large constant that
    repeats along some axes (a folded ``zeros_like(ids)`` lookup, a broadcast scale)
    is stored once per distinct slice and expanded likewise.
    """
    if not isinstance(v, Const):
        return v.name
    value = v.value
    if _splat_saves_bytes(value):
        return g.op("Expand", g.const(value.reshape(-1)[0]), ints(g, value.shape))
    if value.nbytes <= _REPEAT_CHECK_BYTES:
        return g.const(value)
    small = value
    for axis, size in enumerate(value.shape):
        if size > 1 and np.array_equal(small, np.take(small, [0], axis=axis).repeat(size, axis)):
            small = np.take(small, [0], axis=axis)
    if small.size == value.size:
        return g.const(value)
    return g.op("Expand", g.const(small), ints(g, value.shape))


# What an Expand node and its shape initializer cost in the file, roughly (bytes).
_EXPAND_BYTES = 64


def _splat_saves_bytes(value: np.ndarray) -> bool:
    """All values equal, and one value + shape + Expand is smaller than all of them."""
    if value.size < 2 or value.nbytes <= value.itemsize + 8 * value.ndim + _EXPAND_BYTES:
        return False
    first = value.reshape(-1)[:1]
    if np.all(value == first):
        return True
    return np.issubdtype(value.dtype, np.floating) and bool(np.all(np.isnan(value)))


def ints(g: Graph, values: Sequence[int]) -> str:
    """An int64 initializer (shapes, axes, pads)."""
    return g.const(np.asarray(list(values), np.int64), "i")


def _out_aval(eqn: Any, i: int = 0) -> Any:
    return eqn.outvars[i].aval


def _elementwise(op: str) -> Lowering:
    def lower(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
        return [g.op(op, *(name(g, v) for v in ins))]

    return lower


def _max(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """``max``; ``max(x, 0)`` of floats is ``Relu`` (which ONNX Runtime's QDQ fusions know)."""
    zero = [
        isinstance(v, Const) and np.issubdtype(v.dtype, np.floating) and not np.any(v.value)
        for v in ins
    ]
    if any(zero) and not all(zero):
        x = ins[zero.index(False)]
        if tuple(_out_aval(eqn).shape) == tuple(x.shape):
            return [g.op("Relu", name(g, x))]
    return [g.op("Max", *(name(g, v) for v in ins))]


def _compare(op: str, negate: bool = False) -> Lowering:
    def lower(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
        out = g.op(op, name(g, ins[0]), name(g, ins[1]))
        return [g.op("Not", out) if negate else out]

    return lower


def _fmod(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """``lax.rem``: the remainder with the dividend's sign, as C's fmod.

    For integers XLA defines what C does not: ``x rem 0 = x`` and ``INT_MIN rem -1
    = 0``; ONNX Runtime's Mod fails on a zero divisor, so both divisors become 1
    first (``x rem 1 = x rem -1 = 0``) and ``x`` is put back where it was 0.
    """
    x, y = name(g, ins[0]), name(g, ins[1])
    dt = np.dtype(_out_aval(eqn).dtype)
    if not np.issubdtype(dt, np.integer):
        return [g.op("Mod", x, y, fmod=1)]
    zero = g.op("Equal", y, g.const(np.zeros((), dt)))
    unsafe = zero
    if np.issubdtype(dt, np.signedinteger):
        unsafe = g.op("Or", zero, g.op("Equal", y, g.const(np.asarray(-1, dt))))
    one = g.const(np.ones((), dt))
    r = g.op("Mod", x, _where_int(g, unsafe, one, y, dt), fmod=1)
    return [_where_int(g, zero, x, r, dt)]


def _where_int(g: Graph, cond: str, a: str, b: str, dt: np.dtype) -> str:
    """``Where`` for any integer dtype (ONNX Runtime has none for int16, uint16, uint64)."""
    if dt in (np.int8, np.uint8, np.int32, np.uint32, np.int64):
        return g.op("Where", cond, a, b)
    i64 = onnx_dtype(np.int64)
    r = g.op("Where", cond, g.op("Cast", a, to=i64), g.op("Cast", b, to=i64))
    return g.op("Cast", r, to=onnx_dtype(dt))


def _unary_chain(*ops: str) -> Lowering:
    def lower(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
        x = name(g, ins[0])
        for op in ops:
            x = g.op(op, x)
        return [x]

    return lower


def _one_minus(op: str) -> Lowering:
    """``1 - op(x)`` (erfc as 1 - erf; ONNX has no erfc)."""

    def lower(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
        one = g.const(np.ones((), _out_aval(eqn).dtype))
        return [g.op("Sub", one, g.op(op, name(g, ins[0])))]

    return lower


def _is_finite(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """``x - x`` is 0 for finite ``x``, NaN for infinities and NaN."""
    x = name(g, ins[0])
    return [g.op("Not", g.op("IsNaN", g.op("Sub", x, x)))]


def _square(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    x = name(g, ins[0])
    return [g.op("Mul", x, x)]


def _integer_pow(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    y = int(eqn.params["y"])
    x = name(g, ins[0])
    if y == 0:
        return [g.op("Expand", g.const(np.ones((), _out_aval(eqn).dtype)), ints(g, ins[0].shape))]
    acc = x
    for _ in range(abs(y) - 1):
        acc = g.op("Mul", acc, x)
    return [g.op("Reciprocal", acc) if y < 0 else acc]


def _log1p(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    one = g.const(np.ones((), _out_aval(eqn).dtype))
    return [g.op("Log", g.op("Add", name(g, ins[0]), one))]


def _round(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    x = name(g, ins[0])
    method = int(eqn.params.get("rounding_method", 0))
    if method == 1:  # to nearest even: ONNX Round's rule
        return [g.op("Round", x)]
    # Away from zero: floor(|x|) plus one where the fraction is at least 1/2, with
    # x's sign. (floor(|x| + 0.5) is wrong where |x| + 0.5 rounds up in float32:
    # 0.49999997, 2**23 + 1.) Both steps are exact; NaN and infinities stay.
    a = g.op("Abs", x)
    whole = g.op("Floor", a)
    half = g.const(np.asarray(0.5, _out_aval(eqn).dtype))
    up = g.op("GreaterOrEqual", g.op("Sub", a, whole), half)
    r = g.op("Add", whole, g.op("Cast", up, to=onnx_dtype(_out_aval(eqn).dtype)))
    negative = g.op("Less", x, g.const(np.zeros((), _out_aval(eqn).dtype)))
    return [g.op("Where", negative, g.op("Neg", r), r)]


def _convert(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    to = np.dtype(eqn.params["new_dtype"])
    x = name(g, ins[0])
    if not (np.issubdtype(ins[0].dtype, np.floating) and np.issubdtype(to, np.integer)):
        return [g.op("Cast", x, to=onnx_dtype(to))]
    # XLA saturates float -> integer conversions and sends NaN to 0; ONNX's Cast of
    # an out-of-range value is undefined (ONNX Runtime wraps).
    info, src = np.iinfo(to), np.dtype(ins[0].dtype)
    if src.itemsize < 4:  # float16 (exactly) as float32: every integer bound is finite
        x, src = g.op("Cast", x, to=onnx_dtype(np.float32)), np.dtype(np.float32)
    lo = np.asarray(info.min, src)  # a power of two (or 0): exact
    hi = np.asarray(info.max, src)
    if int(hi) > info.max:  # rounded up (2**31 for int32): the float below it
        hi = np.nextafter(hi, np.asarray(0, src))
    y = g.op("Cast", g.op("Clip", x, g.const(lo), g.const(hi)), to=onnx_dtype(to))
    y = g.op("Where", g.op("Greater", x, g.const(hi)), g.const(np.asarray(info.max, to)), y)
    return [g.op("Where", g.op("IsNaN", x), g.const(np.zeros((), to)), y)]


def _identity(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    return [g.op("Identity", name(g, ins[0]))]


def _reshape_to(g: Graph, x: str, shape: Sequence[int]) -> str:
    return g.op("Reshape", x, ints(g, shape))


def _reshape(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    if eqn.params.get("dimensions") is not None:
        raise ExportError("reshape with `dimensions` (a transposing reshape) is not supported")
    return [_reshape_to(g, name(g, ins[0]), _out_aval(eqn).shape)]


def _to_out_shape(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """Squeeze / expand_dims: a reshape to the output's shape."""
    return [_reshape_to(g, name(g, ins[0]), _out_aval(eqn).shape)]


def _broadcast_in_dim(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    shape = tuple(eqn.params["shape"])
    dims = tuple(eqn.params["broadcast_dimensions"])
    ones = [1] * len(shape)
    for d, size in zip(dims, ins[0].shape, strict=True):
        ones[d] = size
    x = name(g, ins[0])
    if tuple(ones) != tuple(ins[0].shape):
        x = _reshape_to(g, x, ones)
    return [g.op("Expand", x, ints(g, shape)) if tuple(ones) != shape else x]


def _transpose(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    return [g.op("Transpose", name(g, ins[0]), perm=list(eqn.params["permutation"]))]


def _reduce(op: str) -> Lowering:
    def lower(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
        axes = list(eqn.params["axes"])
        return [g.op(op, name(g, ins[0]), ints(g, axes), keepdims=0)]

    return lower


def _reduce_bool(op: str) -> Lowering:
    """reduce_and / reduce_or: min / max over the values cast to int32."""

    def lower(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
        x = g.op("Cast", name(g, ins[0]), to=onnx_dtype(np.int32))
        y = g.op(op, x, ints(g, list(eqn.params["axes"])), keepdims=0)
        return [g.op("Cast", y, to=onnx_dtype(np.bool_))]

    return lower


def _arg(op: str) -> Lowering:
    def lower(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
        (axis,) = eqn.params["axes"]
        y = g.op(op, name(g, ins[0]), axis=int(axis), keepdims=0, select_last_index=0)
        return [g.op("Cast", y, to=onnx_dtype(eqn.params["index_dtype"]))]

    return lower


def _select_n(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    pred, *cases = ins
    if len(cases) != 2:
        raise ExportError(f"select_n with {len(cases)} cases is not supported; allowed: 2")
    p = name(g, pred)
    if np.dtype(pred.dtype) != np.bool_:
        p = g.op("Cast", p, to=onnx_dtype(np.bool_))
    return [g.op("Where", p, name(g, cases[1]), name(g, cases[0]))]


def _clamp(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """``min(max(x, lo), hi)``; 16-bit integers in int32 (ONNX Runtime has no kernels)."""
    dt = np.dtype(_out_aval(eqn).dtype)
    lo, x, hi = (name(g, v) for v in ins)
    if dt not in (np.int16, np.uint16):
        return [g.op("Min", g.op("Max", x, lo), hi)]
    lo, x, hi = (g.op("Cast", v, to=onnx_dtype(np.int32)) for v in (lo, x, hi))
    return [g.op("Cast", g.op("Min", g.op("Max", x, lo), hi), to=onnx_dtype(dt))]


def _concatenate(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    return [g.op("Concat", *(name(g, v) for v in ins), axis=int(eqn.params["dimension"]))]


def _slice(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    start = list(eqn.params["start_indices"])
    limit = list(eqn.params["limit_indices"])
    strides = eqn.params.get("strides") or [1] * len(start)
    axes = list(range(len(start)))
    return [
        g.op(
            "Slice",
            name(g, ins[0]),
            ints(g, start),
            ints(g, limit),
            ints(g, axes),
            ints(g, list(strides)),
        )
    ]


def _rev(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    axes = list(eqn.params["dimensions"])
    big = np.iinfo(np.int64).max
    return [
        g.op(
            "Slice",
            name(g, ins[0]),
            ints(g, [-1] * len(axes)),
            ints(g, [-big] * len(axes)),
            ints(g, axes),
            ints(g, [-1] * len(axes)),
        )
    ]


def _pad(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    config = eqn.params["padding_config"]
    if any(interior for _, _, interior in config):
        raise ExportError("pad with interior padding is not supported")
    x = name(g, ins[0])
    los = [lo for lo, _, _ in config]
    his = [hi for _, hi, _ in config]
    if any(p < 0 for p in los + his):  # negative padding crops
        shape = ins[0].shape
        starts = [max(-lo, 0) for lo in los]
        ends = [size - max(-hi, 0) for size, hi in zip(shape, his, strict=True)]
        x = g.op("Slice", x, ints(g, starts), ints(g, ends))
        los, his = [max(p, 0) for p in los], [max(p, 0) for p in his]
    return [g.op("Pad", x, ints(g, los + his), name(g, ins[1]))]


def _split(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    sizes = list(eqn.params["sizes"])
    return g.node(
        "Split", [name(g, ins[0]), ints(g, sizes)], len(sizes), axis=int(eqn.params["axis"])
    )


def dot_general(g: Graph, lhs: Value, rhs: Value, dims: Any, out_shape: Sequence[int]) -> str:
    """``lax.dot_general`` as Transpose/Reshape around one (batched) MatMul.

    Constant operands are rearranged in NumPy, so a weight becomes one initializer
    in MatMul's ``(K, N)`` layout. Integer operands take ``MatMulInteger``.
    """
    (lc, rc), (lb, rb) = dims
    lf = [a for a in range(len(lhs.shape)) if a not in lc and a not in lb]
    rf = [a for a in range(len(rhs.shape)) if a not in rc and a not in rb]
    size = lambda v, axes: int(np.prod([v.shape[a] for a in axes], dtype=np.int64))  # noqa: E731
    batch = [lhs.shape[a] for a in lb]
    m, k, n = size(lhs, lf), size(lhs, lc), size(rhs, rf)
    lead = [int(np.prod(batch, dtype=np.int64))] if batch else []
    a = _arrange(g, lhs, [*lb, *lf, *lc], [*lead, m, k])
    b = _arrange(g, rhs, [*rb, *rc, *rf], [*lead, k, n])
    integer = np.issubdtype(lhs.dtype, np.integer) and np.issubdtype(rhs.dtype, np.integer)
    if integer and not all(np.dtype(v.dtype) in (np.int8, np.uint8) for v in (lhs, rhs)):
        raise ExportError(
            f"an integer dot_general of {np.dtype(lhs.dtype)} and {np.dtype(rhs.dtype)} has "
            "no ONNX kernel; allowed: int8 or uint8 operands (MatMulInteger)"
        )
    # MatMulInteger: int8 x int8 -> int32, exact (qcore's integer path).
    return _reshape_to(g, g.op("MatMulInteger" if integer else "MatMul", a, b), out_shape)


def _arrange(g: Graph, v: Value, perm: list[int], shape: list[int]) -> str:
    """``v`` transposed by ``perm`` and reshaped to ``shape`` (folded for constants)."""
    if isinstance(v, Const):
        return g.const(np.ascontiguousarray(np.transpose(v.value, perm)).reshape(shape))
    x = v.name
    if perm != list(range(len(perm))):
        x = g.op("Transpose", x, perm=perm)
    return _reshape_to(g, x, shape) if list(v.shape) != shape else x


def _dot_general(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    out = dot_general(g, ins[0], ins[1], eqn.params["dimension_numbers"], _out_aval(eqn).shape)
    want = eqn.params.get("preferred_element_type")
    natural = np.int32 if np.issubdtype(ins[0].dtype, np.integer) else ins[0].dtype
    if want is not None and np.dtype(want) != np.dtype(natural):
        out = g.op("Cast", out, to=onnx_dtype(want))
    return [out]


def _gather(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """The gather of ``jnp.take(table, ids, axis=0)`` and ``table[ids]``: ONNX Gather.

    Any other gather (``x[:, i]``, ``take_along_axis``, under ``vmap``) takes
    :func:`_gather_elements`.
    """
    operand, indices = ins
    dn = eqn.params["dimension_numbers"]
    rank, batch_rank = len(operand.shape), len(indices.shape) - 1
    whole = (1, *operand.shape[1:])
    if (
        tuple(dn.collapsed_slice_dims) != (0,)
        or tuple(dn.start_index_map) != (0,)
        or tuple(getattr(dn, "operand_batching_dims", ())) != ()
        or indices.shape[-1:] != (1,)
        or tuple(eqn.params["slice_sizes"]) != whole
        or tuple(dn.offset_dims) != tuple(range(batch_rank, batch_rank + rank - 1))
    ):
        return [_gather_elements(g, eqn, operand, indices)]
    idx = _reshape_to(g, name(g, indices), indices.shape[:-1])
    # ONNX Gather fails on ids outside [-rows, rows); XLA clamps them (indexing,
    # mode="clip") or returns a fill value (jnp.take's default mode="fill").
    rows = operand.shape[0]
    dtype = np.dtype(indices.dtype)
    clipped = g.op("Clip", idx, g.const(np.asarray(0, dtype)), g.const(np.asarray(rows - 1, dtype)))
    out = g.op("Gather", name(g, operand), clipped, axis=0)
    if "FILL" not in str(eqn.params.get("mode")):
        return [out]
    inside = g.op("Equal", idx, clipped)
    inside = _reshape_to(g, inside, (*indices.shape[:-1], *([1] * (rank - 1))))
    fill = g.const(np.asarray(_fill_value(eqn.params.get("fill_value"), operand.dtype)))
    return [g.op("Where", inside, out, fill)]


def _fill_value(fill: Any, dtype: Any) -> Any:
    """What XLA's gather in mode="fill" returns for an id out of range (jax.lax.gather)."""
    dtype = np.dtype(dtype)
    if fill is not None:
        return np.asarray(fill).astype(dtype)
    if np.issubdtype(dtype, np.inexact):
        return np.asarray(np.nan, dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.asarray(info.min if np.issubdtype(dtype, np.signedinteger) else info.max, dtype)
    return np.asarray(True, dtype)


def conv(g: Graph, lhs: Value, rhs: Value, p: dict) -> str:
    """``lax.conv_general_dilated`` with parameters ``p`` as one ONNX ``Conv``.

    The operands are transposed to ONNX's ``(N, C, spatial...)`` and ``(O, I,
    spatial...)`` layouts (a constant kernel in NumPy) and the result back.
    """
    dn = p["dimension_numbers"]
    if any(d != 1 for d in p["lhs_dilation"]) or p["batch_group_count"] != 1:
        raise ExportError(
            "conv_general_dilated with lhs_dilation (a transposed convolution) or "
            "batch_group_count > 1 is not supported"
        )
    integer = np.issubdtype(lhs.dtype, np.integer) and np.issubdtype(rhs.dtype, np.integer)
    if integer:  # ConvInteger takes uint8: int8 codes shifted by 128, zero point 128
        lhs, rhs = _as_uint8(g, lhs), _as_uint8(g, rhs)
    x = _arrange(g, lhs, list(dn.lhs_spec), [lhs.shape[a] for a in dn.lhs_spec])
    w = _arrange(g, rhs, list(dn.rhs_spec), [rhs.shape[a] for a in dn.rhs_spec])
    pads = [lo for lo, _ in p["padding"]] + [hi for _, hi in p["padding"]]
    zero = [g.const(np.uint8(128))] * 2 if integer else []
    y = g.op(
        "ConvInteger" if integer else "Conv",
        x,
        w,
        *zero,
        strides=list(p["window_strides"]),
        pads=pads,
        dilations=list(p["rhs_dilation"]),
        group=int(p["feature_group_count"]),
    )
    # Conv's output is (N, C, spatial...); out_spec says where each goes.
    return transpose(g, y, [int(a) for a in np.argsort(dn.out_spec)])


def transpose(g: Graph, x: str, perm: Sequence[int]) -> str:
    """``x`` transposed by ``perm``; ``x`` itself for the identity permutation."""
    if list(perm) == list(range(len(perm))):
        return x
    return g.op("Transpose", x, perm=list(perm))


def _as_uint8(g: Graph, v: Value) -> Value:
    """int8 codes as uint8 codes + 128 (uint8 stays)."""
    if np.dtype(v.dtype) == np.uint8:
        return v
    if np.dtype(v.dtype) != np.int8:
        raise ExportError(
            f"an integer convolution of {np.dtype(v.dtype)} is not supported; allowed: int8, uint8"
        )
    if isinstance(v, Const):
        return Const((v.value.astype(np.int16) + 128).astype(np.uint8))
    wide = g.op("Cast", v.name, to=onnx_dtype(np.int16))
    shifted = g.op("Add", wide, g.const(np.int16(128)))
    return Tensor(g.op("Cast", shifted, to=onnx_dtype(np.uint8)), v.shape, np.dtype(np.uint8))


def _conv(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    return [conv(g, ins[0], ins[1], eqn.params)]


def _reduce_window(kind: str) -> Lowering:
    """Pooling: reduce_window_{sum,max} over the spatial axes of an N...C tensor."""

    def lower(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
        p = eqn.params
        window = tuple(p["window_dimensions"])
        strides = tuple(p["window_strides"])
        padding = tuple(tuple(pair) for pair in p["padding"])
        rank = len(window)
        spatial = [
            a for a in range(rank) if window[a] != 1 or strides[a] != 1 or padding[a] != (0, 0)
        ]
        if any(d != 1 for d in (*p["base_dilation"], *p["window_dilation"])) or 0 in spatial:
            raise ExportError("reduce_window with dilation or over the batch axis is not supported")
        channels = [a for a in range(1, rank) if a not in spatial]
        perm = [0, *channels, *spatial]
        x = transpose(g, name(g, ins[0]), perm)
        if channels and len(channels) > 1:
            raise ExportError("reduce_window with more than one channel axis is not supported")
        attrs: dict[str, Any] = {
            "kernel_shape": [window[a] for a in spatial],
            "strides": [strides[a] for a in spatial],
            "pads": [padding[a][0] for a in spatial] + [padding[a][1] for a in spatial],
        }
        if not channels:
            x = g.op("Unsqueeze", x, ints(g, [1]))
        if kind == "max":
            y = g.op("MaxPool", x, **attrs)
        else:  # a sum: average over the full window (padding counted) times its size
            y = g.op("AveragePool", x, count_include_pad=1, **attrs)
            size = int(np.prod(attrs["kernel_shape"]))
            y = g.op("Mul", y, g.const(np.asarray(size, ins[0].dtype)))
        if not channels:
            y = g.op("Squeeze", y, ints(g, [1]))
        return [transpose(g, y, [int(a) for a in np.argsort(perm)])]

    return lower


# --- Integer bit operations -------------------------------------------------------


def _bits(dtype: Any) -> tuple[int, np.dtype, np.dtype]:
    """The width of an integer dtype and its signed and unsigned dtypes of that width."""
    dt = np.dtype(dtype)
    if not np.issubdtype(dt, np.integer):
        raise ExportError(f"a bit operation on {dt} is not supported; allowed: integer dtypes")
    bits = dt.itemsize * 8
    return bits, np.dtype(f"int{bits}"), np.dtype(f"uint{bits}")


def _as_uint64(g: Graph, v: Value) -> str:
    """The bits of integer ``v``, zero-extended to uint64 (ONNX BitShift is unsigned only)."""
    _, _, unsigned = _bits(v.dtype)
    x = name(g, v)
    if np.dtype(v.dtype) != unsigned:
        x = g.op("Cast", x, to=onnx_dtype(unsigned))
    return g.op("Cast", x, to=onnx_dtype(np.uint64))


def _shift(kind: str) -> Lowering:
    """shift_left / shift_right_logical / shift_right_arithmetic with XLA's semantics.

    The shift amount is read as unsigned (a negative amount is a large one); an
    amount of the bit width or more gives 0 (``-1`` for a negative value shifted
    right arithmetically). Signed values shift as their two's complement bits; an
    arithmetic shift of an unsigned value shifts its bits as signed, as XLA does.
    """

    def lower(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
        x, y = ins
        dt = np.dtype(_out_aval(eqn).dtype)
        bits, signed, unsigned = _bits(dt)
        amount = name(g, y)
        if np.dtype(y.dtype) != unsigned:
            amount = g.op("Cast", amount, to=onnx_dtype(unsigned))
        amount = g.op("Cast", amount, to=onnx_dtype(np.int64))
        over = g.op("GreaterOrEqual", amount, g.const(np.int64(bits)))
        amount = g.op("Min", amount, g.const(np.int64(bits - 1)))
        amount = g.op("Cast", amount, to=onnx_dtype(np.uint64))
        # Computed in 64 bits (ONNX Runtime's Where has no int8/int16 kernels), then
        # cast back, which keeps the low bits.
        i64 = onnx_dtype(np.int64)
        if kind != "arithmetic":
            direction = "LEFT" if kind == "left" else "RIGHT"
            r = g.op("BitShift", _as_uint64(g, x), amount, direction=direction)
            r = g.op("Where", over, g.const(np.int64(0)), g.op("Cast", r, to=i64))
            return [g.op("Cast", r, to=onnx_dtype(dt))]
        # x >> n (arithmetic) = ~((~x) >> n) for negative x, with the bits of ~x >= 0.
        s = name(g, x)
        if dt != signed:  # an unsigned value's bits, read as signed
            s = g.op("Cast", s, to=onnx_dtype(signed))
        s = g.op("Cast", s, to=i64)
        neg = g.op("Less", s, g.const(np.int64(0)))
        t = g.op("Where", neg, g.op("BitwiseNot", s), s)
        r = g.op("BitShift", g.op("Cast", t, to=onnx_dtype(np.uint64)), amount, direction="RIGHT")
        r = g.op("Cast", r, to=i64)
        r = g.op("Where", neg, g.op("BitwiseNot", r), r)
        return [g.op("Cast", r, to=onnx_dtype(dt))]

    return lower


_POPCOUNT_TABLE = np.array([bin(i).count("1") for i in range(256)], np.int32)


def _population_count(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """The set bits of each value: a 256-entry table looked up per byte, summed."""
    (x,) = ins
    bits, _, _ = _bits(x.dtype)
    shifts = np.arange(0, bits, 8, dtype=np.uint64).reshape((-1,) + (1,) * len(x.shape))
    b = g.op("BitShift", _as_uint64(g, x), g.const(shifts), direction="RIGHT")
    b = g.op("BitwiseAnd", b, g.const(np.uint64(255)))
    counts = g.op("Gather", g.const(_POPCOUNT_TABLE), g.op("Cast", b, to=onnx_dtype(np.int64)))
    total = g.op("ReduceSum", counts, ints(g, [0]), keepdims=0)
    return [g.op("Cast", total, to=onnx_dtype(_out_aval(eqn).dtype))]


# --- Cumulative reductions --------------------------------------------------------


def _cumsum(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """ONNX CumSum (float, int32 and int64 only: narrower integers sum as int32, wrapping alike)."""
    (x,) = ins
    dt = np.dtype(_out_aval(eqn).dtype)
    work = dt
    if np.issubdtype(dt, np.integer) and dt not in (np.int32, np.int64):
        work = np.dtype(np.int64 if dt in (np.uint32, np.uint64) else np.int32)
    elif dt == np.bool_:
        raise ExportError("cumsum of booleans is not supported; allowed: numeric dtypes")
    v = name(g, x)
    if work != dt:
        v = g.op("Cast", v, to=onnx_dtype(work))
    axis = g.const(np.int64(eqn.params["axis"]))
    y = g.op("CumSum", v, axis, reverse=int(bool(eqn.params.get("reverse", False))))
    return [y if work == dt else g.op("Cast", y, to=onnx_dtype(dt))]


def _cumulative(op: str) -> Lowering:
    """Cumulative products, maxima, minima (no ONNX op): a log-depth scan.

    Step ``k`` combines each element with the one ``2**k`` before it (the
    operation's identity before the start); ``ceil(log2(n))`` steps.
    """

    def lower(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
        (x,) = ins
        dt = np.dtype(_out_aval(eqn).dtype)
        axis, reverse = int(eqn.params["axis"]), bool(eqn.params.get("reverse", False))
        shape = list(x.shape)
        n = shape[axis]
        if op == "Mul":
            identity: Any = 1
        elif np.issubdtype(dt, np.floating):
            identity = -np.inf if op == "Max" else np.inf
        elif dt == np.bool_:
            identity = op == "Min"
        else:
            identity = np.iinfo(dt).min if op == "Max" else np.iinfo(dt).max
        y = name(g, x)
        # ONNX Runtime has no Max/Min for 16-bit integers; int32 products wrap alike.
        work = np.dtype(np.int32) if dt == np.bool_ or dt.itemsize < 4 else dt
        if work != dt:
            y = g.op("Cast", y, to=onnx_dtype(work))
        step = 1
        while step < n:
            fill = g.const(np.full([*shape[:axis], step, *shape[axis + 1 :]], identity, work))
            if reverse:
                rest = g.op("Slice", y, ints(g, [step]), ints(g, [n]), ints(g, [axis]))
                shifted = g.op("Concat", rest, fill, axis=axis)
            else:
                rest = g.op("Slice", y, ints(g, [0]), ints(g, [n - step]), ints(g, [axis]))
                shifted = g.op("Concat", fill, rest, axis=axis)
            y = g.op(op, y, shifted)
            step *= 2
        return [y if work == dt else g.op("Cast", y, to=onnx_dtype(dt))]

    return lower


# --- Stacking, tiling ---------------------------------------------------------------


def _stack(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    axis = int(eqn.params["axis"])
    parts = [g.op("Unsqueeze", name(g, v), ints(g, [axis])) for v in ins]
    return [g.op("Concat", *parts, axis=axis)]


def _tile(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    return [g.op("Tile", name(g, ins[0]), ints(g, list(eqn.params["reps"])))]


def _exp2(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    two = g.const(np.asarray(2, _out_aval(eqn).dtype))
    return [g.op("Pow", two, name(g, ins[0]))]


# Giles (2010), "Approximating the erfinv function": the single-precision
# polynomials XLA evaluates for erf_inv, in w - 2.5 (w < 5) and sqrt(w) - 3.
_ERF_INV_SMALL = (
    2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
    -0.00125372503, -0.00417768164, 0.246640727, 1.50140941,
)  # fmt: skip
_ERF_INV_LARGE = (
    -0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
    -0.0076224613, 0.00943887047, 1.00167406, 2.83297682,
)  # fmt: skip


def _erf_inv(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """``lax.erf_inv`` as XLA computes it (no ONNX op): Giles' polynomials in ``w``.

    ``w = -log(1 - x**2)``; ``erf_inv(±1) = ±inf``, NaN outside ``[-1, 1]``.
    float64 uses the same (single-precision) polynomials.
    """
    dt = np.dtype(_out_aval(eqn).dtype)
    c = lambda v: g.const(np.asarray(v, dt))  # noqa: E731
    x = name(g, ins[0])
    w = g.op("Neg", g.op("Log", g.op("Sub", c(1.0), g.op("Mul", x, x))))
    small = g.op("Less", w, c(5.0))
    w = g.op("Where", small, g.op("Sub", w, c(2.5)), g.op("Sub", g.op("Sqrt", w), c(3.0)))
    pairs = list(zip(_ERF_INV_SMALL, _ERF_INV_LARGE, strict=True))
    p = g.op("Where", small, c(pairs[0][0]), c(pairs[0][1]))
    for a, b in pairs[1:]:
        p = g.op("Add", g.op("Mul", p, w), g.op("Where", small, c(a), c(b)))
    y = g.op("Mul", p, x)
    pole = g.op("Equal", g.op("Abs", x), c(1.0))
    return [g.op("Where", pole, g.op("Mul", x, c(np.inf)), y)]


# --- Dynamic slices and scatters ----------------------------------------------------


def _clamped_starts(
    g: Graph, starts: Sequence[Value], shape: Sequence[int], sizes: Sequence[int]
) -> str:
    """The start indices as one int64 vector, clamped as JAX does to ``[0, dim - size]``."""
    hi = np.asarray(shape, np.int64) - np.asarray(sizes, np.int64)
    if all(isinstance(s, Const) for s in starts):
        values = np.asarray([int(s.value) for s in starts if isinstance(s, Const)], np.int64)
        return ints(g, list(np.clip(values, 0, hi)))
    parts = [g.op("Cast", name(g, s), to=onnx_dtype(np.int64)) for s in starts]
    vec = g.op("Concat", *(g.op("Reshape", p, ints(g, [1])) for p in parts), axis=0)
    return g.op("Min", g.op("Max", vec, ints(g, [0] * len(shape))), ints(g, list(hi)))


def _dynamic_slice(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """``lax.dynamic_slice``: ONNX Slice from run-time starts, clamped so the slice fits."""
    x, *starts = ins
    sizes = list(eqn.params["slice_sizes"])
    begin = _clamped_starts(g, starts, x.shape, sizes)
    return [g.op("Slice", name(g, x), begin, g.op("Add", begin, ints(g, sizes)))]


def _window_offsets(window: Sequence[int], dims: Sequence[int], rank: int) -> np.ndarray:
    """The int64 operand offsets of each position of a window, shape ``(*window, rank)``.

    The window's axes lie along operand axes ``dims``; other axes get offset 0.
    """
    grid = np.zeros((*window, rank), np.int64)
    for j, d in enumerate(dims):
        grid[..., d] = np.indices(window, np.int64)[j] if window else 0
    return grid


def _dynamic_update_slice(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """``lax.dynamic_update_slice``: ScatterND of the update at clamped starts."""
    x, update, *starts = ins
    rank = len(x.shape)
    begin = _clamped_starts(g, starts, x.shape, update.shape)
    grid = g.const(_window_offsets(update.shape, range(rank), rank))
    return [g.op("ScatterND", name(g, x), g.op("Add", grid, begin), name(g, update))]


def _mode(params: dict, prim: str) -> str:
    """A gather/scatter's ``GatherScatterMode`` name; one_hot is refused."""
    mode = params.get("mode")
    mode = str(getattr(mode, "name", mode))
    if mode == "ONE_HOT":
        raise ExportError(
            f"{prim} in mode one_hot is not supported; allowed: clip, fill/drop, promise_in_bounds"
        )
    return mode


def _starts(
    g: Graph,
    indices: Value,
    batch: list[int],
    to_operand: list[int],
    batching: dict[int, np.ndarray],
    rank: int,
) -> np.ndarray | str:
    """Each window's start in all operand axes, shape ``(*batch, rank)`` (int64).

    Axis ``to_operand[k]`` starts at ``indices[..., k]``; a vmap batching axis ``d``
    at ``batching[d]``, the position along the indices' batch axes; others at 0.
    NumPy when the indices are constants.
    """
    if isinstance(indices, Const):
        idx = indices.value.astype(np.int64).reshape([*batch, len(to_operand)])
        start = np.zeros([*batch, rank], np.int64)
        for k, d in enumerate(to_operand):
            start[..., d] = idx[..., k]
        for d, pos in batching.items():
            start[..., d] = pos
        return start
    idx = g.op("Cast", name(g, indices), to=onnx_dtype(np.int64))
    idx = _reshape_to(g, idx, [*batch, len(to_operand)])
    nb = len(batch)
    cols = []
    for d in range(rank):
        if d in to_operand:
            k = to_operand.index(d)
            cols.append(g.op("Slice", idx, ints(g, [k]), ints(g, [k + 1]), ints(g, [nb])))
        else:
            fixed = batching[d] if d in batching else np.zeros(batch, np.int64)
            cols.append(g.const(fixed[..., None]))
    return g.op("Concat", *cols, axis=nb) if rank > 1 else cols[0]


def _all_last(g: Graph, cond: str, axis: int) -> str:
    """``cond`` true along all of ``axis`` (kept as size 1)."""
    ok = g.op("ReduceMin", g.op("Cast", cond, to=onnx_dtype(np.int32)), ints(g, [axis]), keepdims=1)
    return g.op("Cast", ok, to=onnx_dtype(np.bool_))


def _gather_elements(g: Graph, eqn: Any, operand: Value, indices: Value) -> str:
    """Any ``lax.gather`` as ONNX GatherND, one full index per output element.

    Window starts are clamped so the window fits, as XLA does (``x[i]``,
    ``mode="clip"``, ``promise_in_bounds``); in ``fill`` mode (``take_along_axis``,
    ``jnp.take``'s default) a window that does not fit gives ``fill_value``.
    """
    p = eqn.params
    dn = p["dimension_numbers"]
    mode = _mode(p, "gather")
    rank, shape, sizes = len(operand.shape), list(operand.shape), list(p["slice_sizes"])
    dt = np.dtype(operand.dtype)
    to_operand = [int(d) for d in dn.start_index_map]
    ob = [int(d) for d in getattr(dn, "operand_batching_dims", ())]
    ib = [int(d) for d in getattr(dn, "start_indices_batching_dims", ())]
    batch = list(indices.shape[:-1])
    batching = {d: np.indices(batch, np.int64)[i] for d, i in zip(ob, ib, strict=True)}
    window_dims = [d for d in range(rank) if d not in dn.collapsed_slice_dims and d not in ob]
    window = [sizes[d] for d in window_dims]
    hi = np.asarray(shape, np.int64) - np.asarray(sizes, np.int64)
    start = _starts(g, indices, batch, to_operand, batching, rank)
    start = g.const(start) if isinstance(start, np.ndarray) else start
    clamped = g.op("Min", g.op("Max", start, ints(g, [0] * rank)), g.const(hi))
    at = [*batch, *([1] * len(window)), rank]
    grid = g.const(_window_offsets(window, window_dims, rank))
    out = g.op("GatherND", name(g, operand), g.op("Add", _reshape_to(g, clamped, at), grid))
    if mode == "FILL_OR_DROP":
        fill = p.get("fill_value")
        if fill is None:
            if np.issubdtype(dt, np.inexact):
                fill = np.nan
            elif dt == np.bool_:
                fill = True
            else:
                fill = np.iinfo(dt).min if np.issubdtype(dt, np.signedinteger) else np.iinfo(dt).max
        ok = _all_last(g, g.op("Equal", start, clamped), len(batch))
        ok = _reshape_to(g, ok, [*batch, *([1] * len(window))])
        full = g.const(np.full([*batch, *window], fill, dt))
        if np.issubdtype(dt, np.integer):
            out = _where_int(g, ok, out, full, dt)
        else:
            out = g.op("Where", ok, out, full)
    # GatherND gives (*batch, *window); offset_dims say where the window axes go.
    offset = [int(d) for d in dn.offset_dims]
    perm, b = [], 0
    for o in range(len(batch) + len(window)):
        if o in offset:
            perm.append(len(batch) + offset.index(o))
        else:
            perm.append(b)
            b += 1
    return g.op("Transpose", out, perm=perm) if perm != sorted(perm) else out


# JAX's scatter primitives and ScatterND's reduction (subtract adds the negated update).
_SCATTER_REDUCTIONS = {
    "scatter": "none",
    "scatter-add": "add",
    "scatter-sub": "add",
    "scatter-mul": "mul",
    "scatter-min": "min",
    "scatter-max": "max",
}


def _scatter(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """``x.at[idx].set/add/subtract/multiply/min/max``: ONNX ScatterND, element by element.

    Each update element gets its full operand index (its window's start from
    ``indices`` plus its place in the window). JAX's modes: ``clip`` clamps each
    window's start so the window fits; ``fill``/``drop`` (the default) and
    ``promise_in_bounds`` skip a window that does not fit, which here writes it to
    an extra row appended to axis 0 and sliced off again.
    """
    prim = eqn.primitive.name
    operand, indices, updates = ins
    p = eqn.params
    dn = p["dimension_numbers"]
    mode = _mode(p, prim)
    rank = len(operand.shape)
    if rank == 0:
        raise ExportError(f"{prim} of a 0-d operand is not supported; allowed: arrays")
    reduction = _SCATTER_REDUCTIONS[prim]
    shape = list(operand.shape)
    uwd = list(dn.update_window_dims)
    to_operand = list(dn.scatter_dims_to_operand_dims)
    # vmap's batching axes: operand axis ob[j] is indexed by the position along
    # axis ib[j] of the indices.
    ob = [int(d) for d in getattr(dn, "operand_batching_dims", ())]
    ib = [int(d) for d in getattr(dn, "scatter_indices_batching_dims", ())]
    window_dims = [d for d in range(rank) if d not in dn.inserted_window_dims and d not in ob]
    scatter_axes = [d for d in range(len(updates.shape)) if d not in uwd]
    batch = [updates.shape[d] for d in scatter_axes]
    window = [updates.shape[d] for d in uwd]
    batching = {d: np.indices(batch, np.int64)[i] for d, i in zip(ob, ib, strict=True)}
    sizes = [1] * rank
    for d, size in zip(window_dims, window, strict=True):
        sizes[d] = size
    hi = np.asarray(shape, np.int64) - np.asarray(sizes, np.int64)
    grid = _window_offsets(window, window_dims, rank)
    at = [*batch, *([1] * len(window)), rank]  # where a start broadcasts over its window
    dummy = np.asarray([shape[0], *([0] * (rank - 1))], np.int64)
    clip = mode == "CLIP"

    start = _starts(g, indices, batch, to_operand, batching, rank)
    if isinstance(start, np.ndarray):  # the usual x.at[2:5].set(...): indices known now
        if clip:
            start = np.clip(start, 0, hi)
        valid = np.all((start >= 0) & (start <= hi), axis=-1)
        full = start.reshape(at) + grid
        pad = not bool(np.all(valid))
        if pad:
            full = np.where(valid.reshape([*batch, *([1] * (len(window) + 1))]), full, dummy)
        index = g.const(full)
    else:
        nb = len(batch)
        if clip:
            start = g.op("Min", g.op("Max", start, ints(g, [0] * rank)), g.const(hi))
        index = g.op("Add", _reshape_to(g, start, at), g.const(grid))
        pad = not clip
        if pad:
            ok = g.op(
                "And",
                g.op("GreaterOrEqual", start, ints(g, [0] * rank)),
                g.op("LessOrEqual", start, g.const(hi)),
            )
            ok = _reshape_to(g, _all_last(g, ok, nb), [*at[:-1], 1])
            index = g.op("Where", ok, index, g.const(dummy))
    upd = name(g, updates)
    perm = scatter_axes + uwd
    if perm != list(range(len(perm))):
        upd = g.op("Transpose", upd, perm=perm)
    if prim == "scatter-sub":
        upd = g.op("Neg", upd)
    data = name(g, operand)
    if pad:
        extra = g.const(np.zeros([1, *shape[1:]], operand.dtype))
        data = g.op("Concat", data, extra, axis=0)
    out = g.op("ScatterND", data, index, upd, reduction=reduction)
    if pad:
        out = g.op("Slice", out, ints(g, [0]), ints(g, [shape[0]]), ints(g, [0]))
    return [out]


# --- Sorting ------------------------------------------------------------------------


def _sort_key(g: Graph, x: str, dtype: Any) -> str:
    """``x`` in a dtype ONNX Runtime's TopK takes, with the same order."""
    dt = np.dtype(dtype)
    if dt in (np.float32, np.float64, np.int32, np.int64, np.int8, np.int16, np.uint8):
        return x
    if np.issubdtype(dt, np.floating):
        return g.op("Cast", x, to=onnx_dtype(np.float32))
    wide = np.int64 if dt in (np.uint32, np.uint64) else np.int32
    return g.op("Cast", x, to=onnx_dtype(wide))


def _sort(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """``lax.sort`` (``jnp.sort``, ``argsort``, ``sort_key_val``): stable, ascending.

    ONNX TopK with ``k`` = the axis' length sorts one key stably (equal keys keep
    their order, -0.0 equals 0.0, NaNs last: JAX's order). Several keys sort key by
    key from the last (each a stable pass); every operand is then gathered in the
    final order. An unstable sort of keys alone is the same; one carrying values is
    refused (XLA's order of equal keys cannot be reproduced).
    """
    axis = int(eqn.params["dimension"])
    num_keys = int(eqn.params.get("num_keys", 1))
    if not eqn.params.get("is_stable", True) and len(ins) > num_keys:
        raise ExportError(
            "sort with is_stable=False carrying values (jnp.argsort(..., stable=False), "
            "lax.sort_key_val(..., is_stable=False)) is not supported: XLA orders equal keys "
            "its own way, ONNX's TopK by index; allowed: stable sorts (jnp.argsort's default)"
        )
    n = ins[0].shape[axis]
    size = ints(g, [n])
    order: str | None = None
    for key in reversed(ins[:num_keys]):
        k = name(g, key)
        if order is not None:
            k = g.op("GatherElements", k, order, axis=axis)
        _, step = g.node("TopK", [_sort_key(g, k, key.dtype), size], 2, axis=axis, largest=0)
        order = step if order is None else g.op("GatherElements", order, step, axis=axis)
    assert order is not None
    return [g.op("GatherElements", name(g, v), order, axis=axis) for v in ins]


def _top_k(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """``lax.top_k``: ONNX TopK (largest, sorted; equal values in index order).

    JAX orders +0.0 before -0.0: a float key gets -0.0 replaced by the float64
    just below zero. NaNs come first, as JAX's positive NaNs do (ONNX cannot tell
    a NaN's sign; JAX puts negative NaNs last).
    """
    (x,) = ins
    k = int(eqn.params["k"])
    axis = int(eqn.params.get("axis", len(x.shape) - 1))
    if axis < 0:
        axis += len(x.shape)
    v = name(g, x)
    key = _sort_key(g, v, x.dtype)
    if np.issubdtype(x.dtype, np.floating):
        wide = g.op("Cast", v, to=onnx_dtype(np.float64))
        zero = g.const(np.zeros((), x.dtype))
        minus_zero = g.op(
            "And",
            g.op("Equal", v, zero),
            g.op("IsInf", g.op("Div", g.const(np.ones((), x.dtype)), v), detect_positive=0),
        )
        below = g.const(np.float64(-np.finfo(np.float64).smallest_subnormal))
        key = g.op("Where", minus_zero, below, wide)
    _, idx = g.node("TopK", [key, ints(g, [k])], 2, axis=axis, largest=1, sorted=1)
    values = g.op("GatherElements", v, idx, axis=axis)
    return [values, g.op("Cast", idx, to=onnx_dtype(_out_aval(eqn, 1).dtype))]


LOWERINGS: dict[str, Lowering] = {
    "add": _elementwise("Add"),
    "sub": _elementwise("Sub"),
    "mul": _elementwise("Mul"),
    "div": _elementwise("Div"),
    "max": _max,
    "min": _elementwise("Min"),
    "pow": _elementwise("Pow"),
    "rem": _fmod,
    "and": _elementwise("And"),
    "or": _elementwise("Or"),
    "not": _elementwise("Not"),
    "gt": _compare("Greater"),
    "lt": _compare("Less"),
    "ge": _compare("GreaterOrEqual"),
    "le": _compare("LessOrEqual"),
    "eq": _compare("Equal"),
    "ne": _compare("Equal", negate=True),
    "neg": _elementwise("Neg"),
    "abs": _elementwise("Abs"),
    "sign": _elementwise("Sign"),
    "floor": _elementwise("Floor"),
    "ceil": _elementwise("Ceil"),
    "exp": _elementwise("Exp"),
    "log": _elementwise("Log"),
    "tanh": _elementwise("Tanh"),
    "logistic": _elementwise("Sigmoid"),
    "erf": _elementwise("Erf"),
    "erfc": _one_minus("Erf"),
    "sqrt": _elementwise("Sqrt"),
    "rsqrt": _unary_chain("Sqrt", "Reciprocal"),
    "sin": _elementwise("Sin"),
    "cos": _elementwise("Cos"),
    "is_finite": _is_finite,
    "log1p": _log1p,
    "square": _square,
    "integer_pow": _integer_pow,
    "round": _round,
    "convert_element_type": _convert,
    "copy": _identity,
    "copy_p": _identity,
    "stop_gradient": _identity,
    "reduce_precision": _identity,
    "reshape": _reshape,
    "squeeze": _to_out_shape,
    "expand_dims": _to_out_shape,
    "broadcast_in_dim": _broadcast_in_dim,
    "transpose": _transpose,
    "reduce_sum": _reduce("ReduceSum"),
    "reduce_max": _reduce("ReduceMax"),
    "reduce_min": _reduce("ReduceMin"),
    "reduce_prod": _reduce("ReduceProd"),
    "reduce_and": _reduce_bool("ReduceMin"),
    "reduce_or": _reduce_bool("ReduceMax"),
    "argmax": _arg("ArgMax"),
    "argmin": _arg("ArgMin"),
    "select_n": _select_n,
    "clamp": _clamp,
    "concatenate": _concatenate,
    "slice": _slice,
    "rev": _rev,
    "pad": _pad,
    "split": _split,
    "dot_general": _dot_general,
    "gather": _gather,
    "conv_general_dilated": _conv,
    "reduce_window_sum": _reduce_window("sum"),
    "reduce_window_max": _reduce_window("max"),
    "shift_left": _shift("left"),
    "shift_right_logical": _shift("logical"),
    "shift_right_arithmetic": _shift("arithmetic"),
    "population_count": _population_count,
    "cumsum": _cumsum,
    "cumprod": _cumulative("Mul"),
    "cummax": _cumulative("Max"),
    "cummin": _cumulative("Min"),
    "stack": _stack,
    "tile": _tile,
    "exp2": _exp2,
    "erf_inv": _erf_inv,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    **dict.fromkeys(_SCATTER_REDUCTIONS, _scatter),
    "sort": _sort,
    "top_k": _top_k,
}


def lower(g: Graph, eqn: Any, ins: list[Value]) -> list[str]:
    """The ONNX lowering of ``eqn`` (see the module docstring)."""
    fn = LOWERINGS.get(eqn.primitive.name)
    if fn is None:
        raise ExportError(
            f"the JAX primitive {eqn.primitive.name!r} has no ONNX lowering; supported: "
            f"{', '.join(sorted(LOWERINGS))}"
        )
    return fn(g, eqn, ins)

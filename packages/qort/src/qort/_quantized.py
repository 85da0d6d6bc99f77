"""Captured quantized ops (see :mod:`qort._capture`) as integer ONNX ops.

Weight-only products become ``DequantizeLinear`` of the stored codes (int8, or int4
in blocks along the contraction) followed by the float ``MatMul`` or ``Conv``: the
file holds the codes, and ONNX Runtime may fuse the pair into an integer kernel.

Dynamic-range products (w8a8) become::

    bound = max(ReduceMax(x), -min(x)) per scale block
    scale = max(bound * (1/127.5), tiny), or 1 where bound is 0
    codes = QuantizeLinear(x * (1 / scale), 1, zero point 128)  # uint8
    codes[argmin(x)] = 0 where min(x) / scale < -127.5 + 127.5 * 2**-19
    y     = MatMulIntegerToFloat(codes, weight codes + 128, 1, weight scale, 128, 128)
    y     = y * scale   # the exact int32 sum times both scales

which is qcore's arithmetic as XLA computes it, step for step: XLA turns both
divisions into multiplications by a reciprocal, and qcore sends values within 32
ulps above the tie -127.5 (only a block's minimum can be there) to -128. So the
codes equal qcore's and the sum is exact; measured on (4096, 384) activations:
0 codes of 1.6 million differ (1,618 without the tie-rule step, which costs one
more pass over each row, about +50 % of the quantization's time).
Both operands are uint8 with zero point 128 because ONNX Runtime's uint8 × uint8
kernel accumulates exactly on every x86 CPU, where uint8 × int8 saturates 16-bit
pair sums on CPUs without VNNI (``benchmarks/onnx_numerics.py``: int32 sums off by up
to 136,012).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from onnx import TensorProto, helper

import qcore
from qcore import calibration, packing
from qort._capture import SiteRecord
from qort._errors import ExportError
from qort._graph import CONTRIB_DOMAIN, Const, Graph, Tensor, Value, onnx_dtype
from qort._lowering import conv, ints

_TINY = np.float32(np.finfo(np.float32).tiny)
# qcore.numerics.encode sends scaled values in [-127.5, _TIE_EDGE) to -128.
_TIE_EDGE = -127.5 + 127.5 * 2.0**-19


@dataclasses.dataclass
class CodeCheck:
    """What validation needs to compare a dynamic site's activation codes with qcore's.

    Attributes:
        codes: Graph name of the uint8 codes (``code + 128``), shaped ``(rows, cols)``.
        perm: Transposition of the activation before it is reshaped to ``(rows, cols)``.
        shape: ``(rows, cols)``.
        spec: The activation's spec (qcore quantizes the JAX input with it).
        weight: The weight codes as ``(K, N)`` int32, for the exact recomputation.
        weight_scale: Its scale, ``(1, N)``.
        act_scale: Graph name of the activation scale, ``(rows, 1)``.
    """

    codes: str
    perm: list[int]
    shape: tuple[int, int]
    spec: qcore.HowToQuantize
    weight: np.ndarray
    weight_scale: np.ndarray
    act_scale: str


def lower_site(
    g: Graph,
    rec: SiteRecord,
    ins: list[Value],
    out_shape: tuple[int, ...],
    out_dtype: Any,
    conv_params: dict | None = None,
) -> tuple[str, CodeCheck | None]:
    """The ONNX nodes of one captured site; returns its output name and code check.

    ``conv_params`` are the parameters of the ``conv_general_dilated`` equation inside
    a convolution site (the converter finds it).
    """
    operands = jax.tree.unflatten(rec.treedef, ins)
    w, x = operands[rec.weight_side], operands[1 - rec.weight_side]
    if not isinstance(w, qcore.QArray) or not all(isinstance(v, Const) for v in jax.tree.leaves(w)):
        raise ExportError(
            f"{rec.where}: the weight is computed while the model runs; allowed: weights "
            "stored in the params (quantized params passed to export)"
        )
    if not isinstance(x, Tensor):
        raise ExportError(f"{rec.where}: the activation is a constant; nothing to export")
    if rec.op == "conv_general_dilated":
        assert conv_params is not None
        return _conv(g, rec, x, w, conv_params), None
    wc = rec.call.contracting[rec.weight_side]
    xc = rec.call.contracting[1 - rec.weight_side]
    x_free = [a for a in range(len(x.shape)) if a not in xc]
    w_free = [a for a in range(len(w.shape)) if a not in wc]
    k = int(np.prod([x.shape[a] for a in xc]))
    m = int(np.prod([x.shape[a] for a in x_free]))
    codes, scale, zero = _weight_matrix(rec, w, list(wc), w_free, k)
    perm = [*x_free, *xc]
    x2 = _arranged(g, x, perm, (m, k))
    if rec.act_spec is None:
        y, check = _weight_only(g, rec, x2, w, codes, scale, zero), None
    else:
        y, check = _dynamic(g, rec, x, perm, x2, codes, scale, zero, (m, k))
    if rec.weight_side == 0:  # the weight's free axes come first in dot_general's output
        y = g.op("Transpose", y, perm=[1, 0])
    y = g.op("Reshape", y, ints(g, out_shape))
    if np.dtype(out_dtype) != np.float32:
        y = g.op("Cast", y, to=onnx_dtype(out_dtype))
    return y, check


def _leaf(x: Any) -> np.ndarray:
    """A constant leaf of a captured QArray (the converter checked they all are)."""
    assert isinstance(x, Const)
    return np.asarray(x.value)


def _codes(w: qcore.QArray) -> np.ndarray:
    """The weight's integer codes, unpacked."""
    q = _leaf(w.qvalue)
    if w.packing is not None:
        q = np.asarray(
            packing.unpack(
                jnp.asarray(q),
                w.qtype.bits,
                w.packing.length,
                axis=w.packing.axis,
                signed=w.qtype.signed,
            )
        )
    return q


def _check_weight_qtype(rec: SiteRecord, w: qcore.QArray) -> None:
    qt = w.qtype
    if qt.kind != "int" or qt.bits not in (4, 8):
        raise ExportError(
            f"{rec.where}: weight qtype {qt.name!r} has no ONNX integer type; allowed: "
            "int8, uint8, int4, uint4"
        )


def _weight_matrix(
    rec: SiteRecord, w: qcore.QArray, wc: list[int], w_free: list[int], k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Codes as ``(K, N)``; scale (and zero point) as ``(groups, N)``."""
    _check_weight_qtype(rec, w)
    perm = [*wc, *w_free]
    n = int(np.prod([w.shape[a] for a in w_free]))
    codes = np.transpose(_codes(w), perm).reshape(k, n)
    parts = []
    for leaf in (w.scale, w.zero_point):
        if leaf is None:
            parts.append(None)
            continue
        s = _leaf(leaf)
        # Per-tensor or tiled along free axes: repeat to one value per output channel.
        for a in w_free:
            s = np.repeat(s, w.shape[a] // s.shape[a], axis=a)
        s = np.transpose(s, perm)
        groups = [s.shape[i] for i in range(len(wc))]
        if sum(g_ > 1 for g_ in groups) > 1:
            raise ExportError(
                f"{rec.where}: the weight has scale tiles along more than one contracted "
                "axis; allowed: tiles along one axis"
            )
        parts.append(s.reshape(int(np.prod(groups)), n))
    return codes, parts[0], parts[1]


def _arranged(g: Graph, x: Tensor, perm: list[int], shape: tuple[int, ...]) -> str:
    name = x.name
    if perm != list(range(len(perm))):
        name = g.op("Transpose", name, perm=perm)
    if tuple(np.array(x.shape)[perm]) != tuple(shape):
        name = g.op("Reshape", name, ints(g, shape))
    return name


def _initializer(g: Graph, codes: np.ndarray, qtype: Any) -> str:
    """An initializer holding integer codes, int4 ones packed two to a byte by ONNX."""
    if qtype.bits == 8:
        return g.const(codes.astype(np.int8 if qtype.signed else np.uint8), "w")
    kind = TensorProto.INT4 if qtype.signed else TensorProto.UINT4
    return g.raw_initializer(
        helper.make_tensor("w", kind, list(codes.shape), codes.ravel().tolist())
    )


def _weight_only(
    g: Graph,
    rec: SiteRecord,
    x2: str,
    w: qcore.QArray,
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray | None,
) -> str:
    k, n = codes.shape
    groups = scale.shape[0]
    inputs = [_initializer(g, codes, w.qtype)]
    attrs: dict[str, Any] = {}
    if groups == 1:
        inputs.append(g.const(scale.reshape(n).astype(np.float32)))
        attrs["axis"] = 1
        zshape: tuple[int, ...] = (n,)
    else:
        inputs.append(g.const(scale.astype(np.float32)))
        attrs.update(axis=0, block_size=k // groups)
        zshape = scale.shape
    if zero is not None:
        zdtype = TensorProto.INT4 if w.qtype.signed else TensorProto.UINT4
        if w.qtype.bits == 8:
            inputs.append(g.const(zero.reshape(zshape).astype(w.qtype.storage_dtype)))
        else:
            zt = helper.make_tensor("z", zdtype, list(zshape), zero.ravel().astype(int).tolist())
            inputs.append(g.raw_initializer(zt))
    weight = g.op("DequantizeLinear", *inputs, **attrs)
    return g.op("MatMul", x2, weight)


def _check_dynamic_spec(rec: SiteRecord, spec: qcore.HowToQuantize) -> None:
    qt = spec.resolved_qtype
    wrong = []
    if qt.name != "int8":
        wrong.append(f"act_qtype {qt.name!r} (allowed: 'int8')")
    if spec.tiled_axes:
        wrong.append(f"tiled activation axes {dict(spec.tiled_axes)} (allowed: none)")
    if not spec.symmetric or spec.narrow_range:
        wrong.append("an asymmetric or narrow activation range (allowed: symmetric, full)")
    cal = calibration.parse(spec.calibration)
    if (
        not (isinstance(cal, calibration.AbsMax) and cal.clip == 1.0)
        or spec.rounding != "nearest_even"
    ):
        wrong.append(
            f"calibration {spec.calibration!r} with rounding {spec.rounding!r} (allowed: "
            "'absmax', 'nearest_even')"
        )
    if wrong:
        raise ExportError(f"{rec.where}: dynamic-range export does not support " + "; ".join(wrong))


def _dynamic(
    g: Graph,
    rec: SiteRecord,
    x: Tensor,
    perm: list[int],
    x2: str,
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray | None,
    mk: tuple[int, int],
) -> tuple[str, CodeCheck]:
    spec = rec.act_spec
    assert spec is not None
    _check_dynamic_spec(rec, spec)
    if zero is not None or scale.shape[0] != 1 or codes.dtype != np.int8:
        raise ExportError(
            f"{rec.where}: w8a8 export needs symmetric int8 weights with one scale per output "
            "channel (no tiles along the contraction); allowed: weight_qtype='int8' without "
            "tile_size"
        )
    m, k = mk
    rank = len(x.shape)
    channel = sorted(a % rank for a in spec.channelwise_axes)
    order = perm[: len(channel)]
    if sorted(order) != channel or any(a in channel for a in perm[len(channel) :]):
        free = tuple(perm[: rank - len(rec.call.contracting[1 - rec.weight_side])])
        raise ExportError(
            f"{rec.where}: activation scales per axes {tuple(channel)} do not lead the "
            f"non-contracted axes {free}; allowed: per token, per sequence or per tensor"
        )
    rows = int(np.prod([x.shape[a] for a in channel]))
    cols = m * k // rows
    xq = x2 if rows == m else g.op("Reshape", x2, ints(g, (rows, cols)))
    # bound = max |x| per row, from the row's max and its (first) min, whose index the
    # tie rule below needs.
    row_min_at = g.op("ArgMin", xq, axis=1, keepdims=1)
    row_min = g.op("GatherElements", xq, row_min_at, axis=1)
    row_max = g.op("ReduceMax", xq, ints(g, [1]), keepdims=1)
    bound = g.op("Max", row_max, g.op("Neg", row_min))
    # XLA computes qcore's bound / 127.5 as bound * fl(1 / 127.5), and x / scale as
    # x * fl(1 / scale): the same operations here give the same scales and codes.
    quotient = g.op("Max", g.op("Mul", bound, g.const(np.float32(1 / 127.5))), g.const(_TINY))
    zero_bound = g.op("Equal", bound, g.const(np.float32(0)))
    act_scale = g.op("Where", zero_bound, g.const(np.float32(1)), quotient)
    inverse = g.op("Reciprocal", act_scale)
    one, zp = g.const(np.float32(1)), g.const(np.uint8(128))
    q = g.op("QuantizeLinear", g.op("Mul", xq, inverse), one, zp)
    # qcore's tie rule: a value within 32 ulps above -127.5 takes code -128 (uint8 0).
    # Only a row's minimum can be there; its code is recomputed and written back.
    scaled_min = g.op("Mul", row_min, inverse)
    near = g.op("Less", scaled_min, g.const(np.float32(_TIE_EDGE)))
    rounded_min = g.op("QuantizeLinear", scaled_min, one, zp)
    min_code = g.op("Where", near, g.const(np.uint8(0)), rounded_min)
    q = g.op("ScatterElements", q, row_min_at, min_code, axis=1)
    q2 = q if rows == m else g.op("Reshape", q, ints(g, mk))
    w_u8 = g.const((codes.astype(np.int16) + 128).astype(np.uint8), "w")
    zp128 = g.const(np.uint8(128))
    n = codes.shape[1]
    # ONNX Runtime's MatMulIntegerToFloat is MatMulInteger, Cast and the product with
    # a_scale * b_scale (here 1 * the weight's scale) in one kernel: the exact sum
    # times the weight scale, then the row's activation scale.
    w_scale = g.const(scale.reshape(n).astype(np.float32))
    y = g.op("MatMulIntegerToFloat", q2, w_u8, one, w_scale, zp128, zp128, domain=CONTRIB_DOMAIN)
    if rows == m:
        y = g.op("Mul", y, act_scale)
    else:  # one scale per group of rows/m consecutive rows
        y3 = g.op("Reshape", y, ints(g, (rows, m // rows, n)))
        s3 = g.op("Reshape", act_scale, ints(g, (rows, 1, 1)))
        y = g.op("Reshape", g.op("Mul", y3, s3), ints(g, (m, n)))
    check = CodeCheck(
        q, perm, (rows, cols), spec, codes.astype(np.int32), scale.reshape(1, n), act_scale
    )
    return y, check


def _conv(g: Graph, rec: SiteRecord, x: Tensor, w: qcore.QArray, params: dict) -> str:
    """A weight-only convolution: DequantizeLinear of the kernel, then Conv."""
    _check_weight_qtype(rec, w)
    codes = _codes(w)
    scale = _leaf(w.scale).astype(np.float32)
    out_axis = rec.call.contracting[rec.weight_side]
    (o,) = [a for a in range(codes.ndim) if a not in out_axis]
    if any(scale.shape[a] != 1 for a in range(codes.ndim) if a != o):
        raise ExportError(
            f"{rec.where}: convolution weights with scale tiles are not supported; allowed: "
            "one scale per output channel or per tensor"
        )
    inputs = [_initializer(g, codes, w.qtype)]
    attrs: dict[str, Any] = {}
    if scale.size == 1:
        inputs.append(g.const(scale.reshape(())))
    else:
        inputs.append(g.const(scale.reshape(-1)))
        attrs["axis"] = o
    if w.zero_point is not None:
        raise ExportError(f"{rec.where}: asymmetric convolution weights are not supported")
    dequantized = g.op("DequantizeLinear", *inputs, **attrs)
    kernel = Tensor(dequantized, tuple(codes.shape), np.dtype(np.float32))
    return conv(g, x, kernel, params)


@dataclasses.dataclass
class QdqCheck:
    """What validation needs to judge a marked fake quantization (:mod:`qort.qdq`).

    Attributes:
        codes: Graph name of the codes (after the ``Clip``, if any).
        dtype: Their ONNX dtype (uint8: signed codes are stored as ``code + 128``).
        offset: What was added to the codes (128 for signed codes, else 0).
        scale: The scale, broadcastable to the values.
        zero_point: The zero point, shaped like ``scale``.
    """

    codes: str
    dtype: np.dtype
    offset: int
    scale: np.ndarray
    zero_point: np.ndarray


def _per_axis(a: np.ndarray, axis: int | None) -> np.ndarray:
    """A broadcastable scale or zero point in ONNX's layout: 0-d, or 1-D along ``axis``."""
    return a.reshape(()) if axis is None else a.reshape(-1)


def lower_qdq(g: Graph, mark: Any, x: Tensor, scale: Any, zero_point: Any) -> tuple[str, QdqCheck]:
    """``QuantizeLinear`` → (``Clip``) → ``DequantizeLinear`` of a marked fake quantization.

    Signed codes are stored as uint8 ``code + 128`` with zero point ``z + 128`` (the
    same values): ONNX Runtime's x86 CPU kernels take uint8 activations, and it
    converts int8 ``QuantizeLinear`` / ``DequantizeLinear`` pairs to uint8 itself
    only without a ``Clip`` between them (a narrow or 4-bit signed input then left
    its ``Conv`` unfused).
    """
    s = np.asarray(scale, np.float32)
    z = np.asarray(zero_point, np.float32)
    offset = 128 if np.dtype(mark.storage) == np.int8 else 0
    attrs = {} if mark.axis is None else {"axis": mark.axis}
    s_name = g.const(_per_axis(s, mark.axis))
    z_name = g.const((_per_axis(z, mark.axis) + offset).astype(np.uint8))
    codes = g.op("QuantizeLinear", x.name, s_name, z_name, **attrs)
    lo, hi = mark.qmin + offset, mark.qmax + offset
    if (lo, hi) != (0, 255):
        codes = g.op("Clip", codes, g.const(np.uint8(lo)), g.const(np.uint8(hi)))
    y = g.op("DequantizeLinear", codes, s_name, z_name, **attrs)
    check = QdqCheck(codes, np.dtype(np.uint8), offset, s.astype(np.float64), z.astype(np.float64))
    return y, check


def lower_dq(g: Graph, mark: Any, codes: Any, scale: Any, zero_point: Any) -> str:
    """``DequantizeLinear`` of constant codes (an integer initializer).

    int8 codes with zero point 0 are stored as uint8 ``code + 128`` with zero point
    128 (the same values): fused with a uint8 activation, ONNX Runtime's x86
    uint8 x int8 kernels add pairs of products in 16 bits and saturate on CPUs
    without VNNI (``QLinearConv`` and ``MatMulIntegerToFloat`` were off by several
    output steps on this project's AVX2 machine; uint8 x uint8 was exact).
    """
    c = np.asarray(codes)
    attrs = {} if mark.axis is None else {"axis": mark.axis}
    s = _per_axis(np.asarray(scale, np.float32), mark.axis)
    z = _per_axis(np.asarray(zero_point, np.float32), mark.axis)
    if c.dtype == np.int8 and not np.any(z):
        c, z = (c.astype(np.int16) + 128).astype(np.uint8), z + 128
    z = z.astype(c.dtype)
    return g.op("DequantizeLinear", g.const(c, "w"), g.const(s), g.const(z), **attrs)

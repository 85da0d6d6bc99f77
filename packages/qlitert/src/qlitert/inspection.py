"""What a ``.tflite`` model contains: ops, tensor types, quantization, bytes.

:func:`inspect` reads the flatbuffer (LiteRT's schema, no interpreter needed) into a
:class:`ModelReport`: every op of the main subgraph with the types of its inputs
and outputs, every tensor's quantization parameters, and the bytes of constant
data by type.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of the graph.

    Attributes:
        index: Its index in the subgraph.
        name: Its name.
        dtype: LiteRT type name (``"INT8"``, ``"FLOAT32"``...).
        shape: Its shape.
        scale: Quantization scales (empty if not quantized).
        zero_point: Quantization zero points.
        quantized_dimension: The per-channel axis.
        constant_bytes: Bytes of constant data it holds (0 for activations).
    """

    index: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    scale: tuple[float, ...]
    zero_point: tuple[int, ...]
    quantized_dimension: int
    constant_bytes: int


@dataclasses.dataclass(frozen=True)
class Op:
    """One op: its name and its input / output tensors (indices into ``tensors``)."""

    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ModelReport:
    """The main subgraph of a ``.tflite`` model.

    Attributes:
        ops: Ops in execution order.
        tensors: All tensors.
        inputs: Indices of the graph inputs.
        outputs: Indices of the graph outputs.
        size: Bytes of the flatbuffer.
    """

    ops: tuple[Op, ...]
    tensors: tuple[Tensor, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    size: int

    def op_names(self) -> list[str]:
        """Op names in execution order."""
        return [op.name for op in self.ops]

    def constant_bytes(self) -> dict[str, int]:
        """Bytes of constant data per tensor type (weights, biases)."""
        out: Counter[str] = Counter()
        for t in self.tensors:
            if t.constant_bytes:
                out[t.dtype] += t.constant_bytes
        return dict(out)

    def op_types(self, op: Op) -> tuple[list[str], list[str]]:
        """The input and output tensor types of ``op``."""
        return [self.tensors[i].dtype for i in op.inputs], [
            self.tensors[i].dtype for i in op.outputs
        ]

    def summary(self) -> str:
        """A readable listing: one line per op, then the byte breakdown."""
        lines = []
        for op in self.ops:
            ins, outs = self.op_types(op)
            lines.append(f"{op.name:24s} {','.join(ins):32s} -> {','.join(outs)}")
        lines.append(f"constants: {self.constant_bytes()}; file: {self.size} bytes")
        return "\n".join(lines)


def _names(enum: type) -> dict[int, str]:
    return {v: k for k, v in vars(enum).items() if not k.startswith("_")}


def _name(t: Any) -> str:
    """A schema tensor's name as text."""
    return t.name.decode(errors="replace") if isinstance(t.name, bytes) else str(t.name or "")


def read(tflite: Any, name: str = "tflite") -> tuple[bytes, str]:
    """The bytes of a model given as bytes or as a path, and how messages name it.

    Raises:
        TypeError: If ``tflite`` is neither bytes nor a path.
        ValueError: If the path is not a readable file.
    """
    if isinstance(tflite, bytes | bytearray | memoryview):
        return bytes(tflite), name
    if not isinstance(tflite, str | os.PathLike):
        raise TypeError(
            f"{name} is a {type(tflite).__name__}; allowed: the .tflite bytes or a file path"
        )
    path = Path(tflite)
    if not path.is_file():
        what = "a directory" if path.is_dir() else "missing"
        raise ValueError(f"{name}={str(path)!r} is {what}; allowed: a .tflite file")
    return path.read_bytes(), f"{name} (file {str(path)!r})"


# What unpacking a damaged flatbuffer raises: offsets or lengths outside the bytes
# (struct.error, IndexError, numpy's ValueError), a union of the wrong type
# (AttributeError, TypeError), a string that is not UTF-8.
_DAMAGE = (struct.error, IndexError, ValueError, TypeError, AttributeError, UnicodeDecodeError)


def parse(data: bytes, what: str = "tflite") -> Any:
    """``data`` unpacked with LiteRT's schema and checked for consistency.

    Every index (op codes, tensors, buffers, subgraphs) must be in range, every
    op input computed before, shapes must fit their constants and 2 GiB, and
    quantization parameters their types, so a model that parses can be
    inspected and handed to the interpreter.

    Raises:
        ValueError: Naming ``what`` and the problem (truncated, bad identifier,
            an offset or index out of range).
    """
    from ai_edge_litert import schema_py_generated as schema  # noqa: PLC0415 - heavy import

    def bad(problem: str) -> ValueError:
        return ValueError(f"{what} is not a valid LiteRT model: {problem}")

    if len(data) < 8:
        raise bad(f"it has {len(data)} bytes; a LiteRT flatbuffer has at least 8 (truncated?)")
    if data[4:8] != b"TFL3":
        raise bad(f"bytes 4..8 are {data[4:8]!r}, not the file identifier b'TFL3'")
    root = struct.unpack_from("<I", data)[0]
    if root + 4 > len(data):
        raise bad(f"the root table at byte {root} is beyond the end (byte {len(data)}): truncated")
    try:
        model: Any = schema.ModelT.InitFromPackedBuf(bytearray(data), 0)  # generated, untyped
        _check(model, schema)
    except _DAMAGE as err:
        raise bad(
            f"the flatbuffer is truncated or damaged ({type(err).__name__}: {err}; "
            f"the data ends at byte {len(data)})"
        ) from None
    return model


def _ints(v: Any) -> tuple[int, ...]:
    """A schema int vector (a list, an array or None) as a tuple."""
    return tuple(int(i) for i in np.asarray(v if v is not None else [], np.int64).reshape(-1))


def _in_range(indices: Any, n: int, what: str, *, optional: bool = False) -> None:
    """Raises IndexError unless every index is in ``0..n-1`` (or -1 if ``optional``)."""
    for i in _ints(indices):
        if not (-1 if optional else 0) <= i < n:
            raise IndexError(f"{what} {i} is out of range (there are {n})")


# Bits per element of the fixed-size tensor types (int4 is packed, two per byte).
_BITS = {
    "FLOAT32": 32, "FLOAT16": 16, "INT32": 32, "UINT8": 8, "INT64": 64, "BOOL": 8,
    "INT16": 16, "COMPLEX64": 64, "INT8": 8, "FLOAT64": 64, "COMPLEX128": 128, "UINT64": 64,
    "UINT32": 32, "UINT16": 16, "INT4": 4, "BFLOAT16": 16, "INT2": 2, "UINT4": 4,
    "FLOAT8_E4M3FN": 8, "FLOAT8_E5M2": 8,
}  # fmt: skip
# A larger tensor is a damaged shape (TFLite's flatbuffers are limited to 2 GiB).
_MAX_TENSOR_BYTES = 2**31


def _check_size(t: Any, dtype: str, data: Any) -> None:
    """Raises ValueError for a damaged shape: negative, huge, or not its constant's size."""
    shape, bits = _ints(t.shape), _BITS.get(dtype)
    count = int(np.prod([d if d >= 0 else 1 for d in shape], dtype=object))  # -1: dynamic
    if any(d < -1 for d in shape) or (bits and count * bits // 8 > _MAX_TENSOR_BYTES):
        raise ValueError(f"tensor {_name(t)!r} ({dtype}) has shape {list(shape)}")
    if not bits or data is None or t.sparsity is not None:
        return
    sizes = {-(-count * bits // 8)} | ({count} if bits < 8 else set())  # packed or not
    if len(data) not in sizes:
        raise ValueError(
            f"tensor {_name(t)!r} ({dtype}, shape {list(shape)}) holds {len(data)} bytes"
        )


# Zero points the integer kernels can represent, by tensor type.
_ZERO_POINTS = {"INT8": (-128, 127), "UINT8": (0, 255), "INT16": (-32768, 32767), "INT4": (-8, 7)}


# Scales above this come only from a degenerate range (an activation spanning 1e32),
# and LiteRT 2.3.0 aborts the process loading an ADD whose operands' scales are that
# far apart (its fixed-point multiplier underflows), so such a model is refused.
MAX_SCALE = 1e30


def _check_quantization(t: Any, dtype: str) -> None:
    """Raises ValueError for bad scales (see MAX_SCALE) or zero points out of range."""
    q = t.quantization
    if q is None or q.scale is None or not len(q.scale):
        return
    scale = np.asarray(q.scale, np.float64)
    zp, shape = np.asarray(_ints(q.zeroPoint)), _ints(t.shape)
    lo, hi = _ZERO_POINTS.get(dtype, (-(2**31), 2**31 - 1))
    channels = shape[q.quantizedDimension] if 0 <= q.quantizedDimension < len(shape) else 1
    if (
        not np.all(np.isfinite(scale) & (scale > 0) & (scale <= MAX_SCALE))
        or zp.size not in (0, 1, scale.size)
        or np.any((zp < lo) | (zp > hi))
        or scale.size not in (1, channels)
    ):
        raise ValueError(
            f"tensor {_name(t)!r} ({dtype}, shape {list(shape)}) has scales {scale.tolist()[:4]}, "
            f"zero points {zp.tolist()[:4]}, quantized dimension {q.quantizedDimension} "
            f"(allowed: finite scales in (0, {MAX_SCALE:g}], one or one per channel, and "
            f"zero points in [{lo}, {hi}])"
        )


def _check(model: Any, schema: Any) -> None:
    """Raises IndexError / ValueError for an index out of range or a missing table."""
    if model.version != 3:
        raise ValueError(f"schema version {model.version} (LiteRT reads version 3)")
    if not model.subgraphs or not model.operatorCodes or not model.buffers:
        raise ValueError("no subgraphs, operator codes or buffers")
    tables = [*model.subgraphs, *model.operatorCodes, *model.buffers]
    if any(t is None for t in tables):
        raise ValueError("a missing subgraph, operator code or buffer")
    ops, types = _names(schema.BuiltinOperator), _names(schema.TensorType)
    for code in model.operatorCodes:
        builtin = max(code.builtinCode, code.deprecatedBuiltinCode)
        if builtin not in ops:
            raise ValueError(f"unknown builtin operator code {builtin}")
    for graph in model.subgraphs:
        tensors, n = graph.tensors or [], len(graph.tensors or [])
        for k, t in enumerate(tensors):
            if t is None or t.type not in types:
                raise ValueError(f"tensor {k} is missing or has an unknown type")
            _in_range([t.buffer], len(model.buffers), "buffer")
            _check_size(t, types[t.type], model.buffers[t.buffer].data)
            _check_quantization(t, types[t.type])
        _in_range(graph.inputs, n, "graph input tensor")
        _in_range(graph.outputs, n, "graph output tensor")
        # Tensors with a value: graph inputs, constants, variables, then op outputs.
        ready = set(_ints(graph.inputs)) | {
            k
            for k, t in enumerate(tensors)
            if t.isVariable
            or model.buffers[t.buffer].data is not None
            or model.buffers[t.buffer].offset > 1
        }
        for k, op in enumerate(graph.operators or []):
            if op is None:
                raise ValueError(f"operator {k} is missing")
            _in_range([op.opcodeIndex], len(model.operatorCodes), "operator code")
            _in_range(op.inputs, n, "op input tensor", optional=True)
            _in_range(op.outputs, n, "op output tensor")
            _in_range(op.intermediates, n, "op intermediate tensor")
            unready = [i for i in _ints(op.inputs) if i >= 0 and i not in ready]
            if unready:
                raise ValueError(f"operator {k} reads tensors {unready} that nothing computes")
            ready.update(_ints(op.outputs))
        unready = [i for i in _ints(graph.outputs) if i not in ready]
        if unready:
            raise ValueError(f"graph outputs {unready} are computed by no operator")
    for sig in model.signatureDefs or []:
        _in_range([sig.subgraphIndex], len(model.subgraphs), "signature subgraph")
        n = len(model.subgraphs[sig.subgraphIndex].tensors or [])
        for m in [*(sig.inputs or []), *(sig.outputs or [])]:
            _in_range([m.tensorIndex], n, "signature tensor")


def inspect(tflite: Any) -> ModelReport:
    """Reads a ``.tflite`` model's main subgraph.

    Args:
        tflite: The flatbuffer bytes, or the path of a ``.tflite`` file.

    Raises:
        TypeError: If ``tflite`` is neither bytes nor a path.
        ValueError: If it is not a valid LiteRT flatbuffer (truncated, another
            file identifier, an offset or index out of range, a tensor whose shape
            does not fit its data or exceeds 2 GiB, a tensor no op computes,
            quantization parameters out of range): one message naming the input
            and what is wrong.
    """
    return from_bytes(*read(tflite))


def from_bytes(data: bytes, what: str = "tflite") -> ModelReport:
    """:func:`inspect` of ``data``; messages name it ``what``."""
    from ai_edge_litert import schema_py_generated as schema  # noqa: PLC0415 - heavy import

    model = parse(data, what)
    ops_names, type_names = _names(schema.BuiltinOperator), _names(schema.TensorType)
    graph: Any = model.subgraphs[0]
    tensors = []
    for i, t in enumerate(graph.tensors or []):
        q = t.quantization
        constant = model.buffers[t.buffer].data
        tensors.append(
            Tensor(
                index=i,
                name=_name(t),
                dtype=type_names[t.type],
                shape=_ints(t.shape),
                scale=tuple(
                    float(s) for s in (q.scale if q is not None and q.scale is not None else ())
                ),
                zero_point=_ints(q.zeroPoint) if q is not None else (),
                quantized_dimension=int(q.quantizedDimension) if q is not None else 0,
                constant_bytes=0 if constant is None else len(constant),
            )
        )
    ops = []
    for op in graph.operators or []:
        code = model.operatorCodes[op.opcodeIndex]
        builtin = max(code.builtinCode, code.deprecatedBuiltinCode)
        ops.append(
            Op(
                name=ops_names[builtin],
                inputs=tuple(i for i in _ints(op.inputs) if i >= 0),
                outputs=_ints(op.outputs),
            )
        )
    return ModelReport(
        ops=tuple(ops),
        tensors=tuple(tensors),
        inputs=_ints(graph.inputs),
        outputs=_ints(graph.outputs),
        size=len(data),
    )

"""What a ``.tflite`` model contains: ops, tensor types, quantization, bytes.

:func:`inspect` reads the flatbuffer (LiteRT's schema, no interpreter needed) into a
:class:`ModelReport`: every op of the main subgraph with the types of its inputs
and outputs, every tensor's quantization parameters, and the bytes of constant
data by type.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
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


def inspect(tflite: bytes) -> ModelReport:
    """Reads a ``.tflite`` flatbuffer's main subgraph.

    Raises:
        ValueError: If ``tflite`` is not a LiteRT flatbuffer.
    """
    from ai_edge_litert import schema_py_generated as schema  # noqa: PLC0415 - heavy import

    if len(tflite) < 8 or tflite[4:8] != b"TFL3":
        raise ValueError("tflite is not a LiteRT flatbuffer (no 'TFL3' identifier)")
    model: Any = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)  # generated, untyped
    ops_names, type_names = _names(schema.BuiltinOperator), _names(schema.TensorType)
    graph: Any = model.subgraphs[0]
    tensors = []
    for i, t in enumerate(graph.tensors):
        q = t.quantization
        data = model.buffers[t.buffer].data if t.buffer < len(model.buffers) else None
        size = 0 if data is None else len(data)
        tensors.append(
            Tensor(
                index=i,
                name=(t.name or b"").decode() if isinstance(t.name, bytes) else str(t.name or ""),
                dtype=type_names.get(t.type, str(t.type)),
                shape=tuple(int(d) for d in (t.shape if t.shape is not None else ())),
                scale=tuple(
                    float(s) for s in (q.scale if q is not None and q.scale is not None else ())
                ),
                zero_point=tuple(
                    int(z)
                    for z in (q.zeroPoint if q is not None and q.zeroPoint is not None else ())
                ),
                quantized_dimension=int(q.quantizedDimension) if q is not None else 0,
                constant_bytes=size,
            )
        )
    ops = []
    for op in graph.operators:
        code = model.operatorCodes[op.opcodeIndex]
        builtin = max(code.builtinCode, code.deprecatedBuiltinCode)
        ops.append(
            Op(
                name=ops_names.get(builtin, str(builtin)),
                inputs=tuple(int(i) for i in np.asarray(op.inputs) if i >= 0),
                outputs=tuple(int(i) for i in np.asarray(op.outputs)),
            )
        )
    return ModelReport(
        ops=tuple(ops),
        tensors=tuple(tensors),
        inputs=tuple(int(i) for i in np.asarray(graph.inputs)),
        outputs=tuple(int(i) for i in np.asarray(graph.outputs)),
        size=len(tflite),
    )

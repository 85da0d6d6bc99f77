"""An ONNX graph under construction: nodes, initializers, fresh names, units.

Values flowing through the converter are either :class:`Const` (a NumPy array known
at export time, folded where every input of an op is one) or :class:`Tensor` (a
named graph value computed at run time). Every jaxpr equation (or quantized site)
that produces graph values is recorded as a :class:`Unit`: its nodes, the names it
reads and writes, and what it is. Validation re-runs each unit on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

# The ONNX operator set written: 21 has int4/uint4 and blocked DequantizeLinear.
OPSET = 21
# ONNX Runtime's contrib operators (w8a8 products use its MatMulIntegerToFloat).
CONTRIB_DOMAIN = "com.microsoft"


@dataclasses.dataclass(frozen=True)
class Const:
    """A value known at export time."""

    value: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.value.dtype


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A graph value computed at run time."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


Value = Const | Tensor


@dataclasses.dataclass
class Unit:
    """The nodes one jaxpr equation or quantized site became.

    Attributes:
        label: What it is, for reports (``"dot_general"``, ``"qdot layer_0/..."``).
        inputs: Graph values it reads (not initializers).
        outputs: Graph values it writes that later units or the graph outputs read.
        nodes: Indices into the builder's node list.
        quantized: The site's record for a quantized op, else None.
        source: Where in the user's code the equation came from.
    """

    label: str
    inputs: list[Tensor]
    outputs: list[Tensor]
    nodes: list[int]
    quantized: Any = None
    source: str = ""


class Graph:
    """Collects nodes and initializers; hands out fresh names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.units: list[Unit] = []
        self._count = 0
        self._const_names: dict[tuple[bytes, str, tuple[int, ...]], str] = {}
        self._open: list[int] | None = None

    def fresh(self, hint: str = "t") -> str:
        """A name no other value has."""
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, value: Any, hint: str = "c") -> str:
        """The name of an initializer holding ``value`` (identical ones are shared)."""
        array = np.asarray(value)
        key = (array.tobytes(), array.dtype.str, tuple(array.shape))
        name = self._const_names.get(key)
        if name is None:
            name = self.fresh(hint)
            # np.ascontiguousarray would make a 0-d array 1-d.
            self.initializers[name] = numpy_helper.from_array(
                np.require(array, requirements="C"), name
            )
            self._const_names[key] = name
        return name

    def raw_initializer(self, tensor: onnx.TensorProto) -> str:
        """Adds a prepared initializer (such as packed int4 codes) under a fresh name."""
        name = self.fresh("w")
        tensor.name = name
        self.initializers[name] = tensor
        return name

    def node(self, op: str, inputs: Sequence[str], n_out: int = 1, **attrs: Any) -> list[str]:
        """Appends a node; returns its output names."""
        outs = [self.fresh(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, **attrs))
        if self._open is not None:
            self._open.append(len(self.nodes) - 1)
        return outs

    def op(self, op: str, *inputs: str, **attrs: Any) -> str:
        """Appends a one-output node; returns its output name."""
        return self.node(op, inputs, **attrs)[0]

    def begin(self) -> None:
        """Starts recording the nodes of a unit."""
        self._open = []

    def end(self, unit: Unit) -> None:
        """Files the nodes recorded since :meth:`begin` under ``unit``."""
        assert self._open is not None
        unit.nodes = self._open
        self._open = None
        if unit.nodes:
            self.units.append(unit)


def onnx_dtype(dtype: Any) -> int:
    """The ONNX element type of a NumPy dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def value_info(tensor: Tensor) -> onnx.ValueInfoProto:
    """The graph input/output declaration of ``tensor``."""
    return helper.make_tensor_value_info(tensor.name, onnx_dtype(tensor.dtype), list(tensor.shape))


_NONDETERMINISTIC = {
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    "Dropout",
}
_SUBGRAPHS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def deduplicated(nodes: Sequence[onnx.NodeProto], keep: Sequence[str]) -> list[onnx.NodeProto]:
    """``nodes`` with repeated computations dropped (common subexpression elimination).

    A node equal to an earlier one (same op, domain, inputs after renaming and
    attributes) is dropped and its outputs are read from the earlier node instead;
    this is how three products of one activation (a transformer's query, key and
    value) share one activation quantization. Nodes writing a name in ``keep`` (graph
    outputs) and nodes with subgraphs stay. ``nodes`` must be in topological order.
    """
    rename: dict[str, str] = {}
    seen: dict[tuple, list[str]] = {}
    out: list[onnx.NodeProto] = []
    for node in nodes:
        inputs = [rename.get(x, x) for x in node.input]
        if inputs != list(node.input):
            node = _with_inputs(node, inputs)
        key = (
            node.op_type,
            node.domain,
            tuple(inputs),
            tuple(sorted(a.SerializeToString() for a in node.attribute)),
        )
        earlier = seen.get(key)
        reusable = (
            node.op_type not in _NONDETERMINISTIC
            and not any(a.type in _SUBGRAPHS for a in node.attribute)
            and not any(o in keep for o in node.output)
        )
        if earlier is not None and reusable:
            rename.update(zip(node.output, earlier, strict=True))
            continue
        if reusable:
            seen[key] = list(node.output)
        out.append(node)
    return out


def _with_inputs(node: onnx.NodeProto, inputs: list[str]) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.input[:] = inputs
    return copy

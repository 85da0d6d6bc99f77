"""A traced JAX function (its jaxpr) as an ONNX model.

The converter walks the jaxpr once, equation by equation, carrying two values per
variable: its ONNX value (a constant or a graph tensor) and its JAX value on the
example inputs (the *reference*, which validation feeds to each op on its own).

- Calls (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``...) are
  inlined, except qflax's captured quantized ops (:mod:`qort._capture`), which
  become integer ONNX ops (:mod:`qort._quantized`), and the calls marked by
  :mod:`qort.qdq`, which become ``QuantizeLinear`` / ``DequantizeLinear``.
- Loops are unrolled: ``scan`` (``nn.scan`` over layers, ``fori_loop`` with
  Python bounds) has a fixed length, and a ``while`` loop whose condition depends
  on constants only runs a number of steps known at export. A ``cond`` / ``switch``
  on a constant is its branch; on a graph value, every branch is computed and the
  outputs selected (``Where``). Each step is lowered (and validated) again.
- ``optimization_barrier`` (a hint to XLA; qcore isolates its quantized products
  behind barriers) passes its operands through: no node, and constants stay
  constants.
- Equations whose results nothing reads (Flax's scan leaves a dead copy of its
  body's first call outside the loop) are skipped.
- An equation whose inputs are all constants is folded: its JAX value becomes an
  initializer (this is how a weight's layout change or a position table costs
  nothing at run time).
- Every other equation is lowered by :mod:`qort._lowering`.

Nodes that no graph output needs are dropped at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np
import onnx
from onnx import helper

from qort import _lowering, _quantized, _tree, qdq
from qort._capture import PREFIX, SiteRecord
from qort._errors import ExportError
from qort._graph import (
    CONTRIB_DOMAIN,
    OPSET,
    Const,
    Graph,
    Tensor,
    Unit,
    Value,
    deduplicated,
    value_info,
)

# Calls whose body is inlined, and the parameter holding it.
_INLINE = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}
# float16 equations compute in float32 between Casts (see _Walker.lower).
_FLOAT16_IN_FLOAT32 = True
# A while loop on constants is unrolled up to this many steps.
_MAX_WHILE_STEPS = 10_000
# Folded broadcasts larger than this stay a broadcast of a small initializer.
_FOLD_LIMIT_BYTES = 1 << 20
# ONNX Runtime reads IR version 10 (opset 21) models; newer onnx releases write 11+.
IR_VERSION = 10


@dataclasses.dataclass
class Converted:
    """An exported graph and what validation needs.

    Attributes:
        model: The ONNX model.
        graph: The builder, with its units (one per lowered equation or site).
        inputs: The graph inputs, in the function's argument order (flattened).
        outputs: The graph outputs, in the function's output order (flattened).
        refs: JAX values of the graph tensors on the example inputs, by name.
        checks: Code checks of the dynamic-range sites, by unit index.
        out_tree: The structure of the function's outputs.
        qdq_checks: Code checks of the marked fake quantizations, by unit index.
        products: Names of the ``Conv`` / ``MatMul`` nodes whose two operands are
            dequantized codes (an activation and a weight), with where they were traced.
    """

    model: onnx.ModelProto
    graph: Graph
    inputs: list[Tensor]
    outputs: list[Tensor]
    refs: dict[str, np.ndarray]
    checks: dict[int, _quantized.CodeCheck]
    out_tree: Any
    qdq_checks: dict[int, _quantized.QdqCheck] = dataclasses.field(default_factory=dict)
    products: dict[str, str] = dataclasses.field(default_factory=dict)


class _Walker:
    def __init__(self, sites: dict[str, SiteRecord]) -> None:
        self.g = Graph()
        self.sites = sites
        self.refs: dict[str, np.ndarray] = {}
        self.checks: dict[int, _quantized.CodeCheck] = {}
        self.qdq_checks: dict[int, _quantized.QdqCheck] = {}

    def run(
        self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Value], arg_refs: Sequence[Any]
    ) -> tuple[list[Value], list[Any]]:
        env: dict[Any, Value] = {}
        ref: dict[Any, Any] = {}
        for var, c in zip(jaxpr.constvars, consts, strict=True):
            env[var], ref[var] = Const(np.asarray(c)), c
        for var, v, r in zip(jaxpr.invars, args, arg_refs, strict=True):
            env[var], ref[var] = v, r

        def read(atom: Any) -> tuple[Value, Any]:
            if isinstance(atom, jex.Literal):
                return Const(np.asarray(atom.val, getattr(atom.aval, "dtype", None))), atom.val
            return env[atom], ref[atom]

        for eqn in _live(jaxpr):
            ins, rins = zip(*(read(a) for a in eqn.invars), strict=True) if eqn.invars else ((), ())
            outs, routs = self.equation(eqn, list(ins), list(rins))
            for var, v, r in zip(eqn.outvars, outs, routs, strict=True):
                if not isinstance(var, jex.DropVar):
                    env[var], ref[var] = v, r
        results = [read(a) for a in jaxpr.outvars]
        return [v for v, _ in results], [r for _, r in results]

    def equation(
        self, eqn: Any, ins: list[Value], rins: list[Any]
    ) -> tuple[list[Value], list[Any]]:
        prim = eqn.primitive.name
        if prim in ("pjit", "jit") and str(eqn.params.get("name", "")).startswith(PREFIX):
            return self.site(eqn, ins, rins)
        mark = qdq.mark_of(str(eqn.params.get("name", ""))) if prim in ("pjit", "jit") else None
        if mark is not None:
            return self.mark(eqn, mark, ins, rins)
        if prim in _INLINE and _INLINE[prim] in eqn.params:
            return self.call(eqn.params[_INLINE[prim]], ins, rins)
        if prim == "scan":
            return self.scan(eqn, ins, rins)
        if prim == "while":
            return self.while_loop(eqn, ins, rins)
        if prim == "cond":
            return self.cond(eqn, ins, rins)
        if prim == "optimization_barrier":  # a hint to XLA: its outputs are its inputs
            return ins, rins
        routs = eqn.primitive.bind(*rins, **eqn.params)
        routs = list(routs) if eqn.primitive.multiple_results else [routs]
        if all(isinstance(v, Const) for v in ins) and not self._keep_unfolded(eqn, ins):
            return [Const(_folded(r)) for r in routs], routs
        _check_no_bfloat16(eqn)
        self.g.begin()
        try:
            names = self.lower(eqn, ins)
        except ExportError as e:
            raise ExportError(f"{e} (at {_where(eqn)})") from None
        outs = self._outputs(eqn, names, routs)
        self.g.end(Unit(prim, _tensors(ins), outs, [], source=_where(eqn)))
        return list(outs), routs

    def lower(self, eqn: Any, ins: list[Value]) -> list[str]:
        """The equation's ONNX nodes; float16 ones compute in float32, rounded after.

        ONNX Runtime's CPU provider has no float16 kernel for most ops: it computes
        them in float32 between Casts it inserts, and then drops a float32 -> float16
        Cast of the graph that feeds one, so a ``convert_element_type`` to float16
        lost its rounding. Writing the float32 computation and both Casts out (as
        XLA computes float16 on the CPU: in float32, rounded after every op) leaves
        ONNX Runtime nothing to insert or remove.
        """
        f16 = np.dtype(np.float16)
        wide = [np.dtype(v.aval.dtype) == f16 for v in eqn.outvars]
        uses_f16 = any(wide) or any(np.dtype(v.dtype) == f16 for v in ins)
        if not (_FLOAT16_IN_FLOAT32 and uses_f16) or eqn.primitive.name == "convert_element_type":
            return _lowering.lower(self.g, eqn, ins)
        f32 = np.dtype(np.float32)
        ins32: list[Value] = []
        for v in ins:
            if np.dtype(v.dtype) != f16:
                ins32.append(v)
            elif isinstance(v, Const):
                ins32.append(Const(v.value.astype(f32)))
            else:
                cast = self.g.op("Cast", v.name, to=onnx.TensorProto.FLOAT)
                ins32.append(Tensor(cast, v.shape, f32))
        names = _lowering.lower(self.g, _Float32Equation(eqn), ins32)
        return [
            self.g.op("Cast", n, to=onnx.TensorProto.FLOAT16) if w else n
            for n, w in zip(names, wide, strict=True)
        ]

    def call(self, body: Any, ins: list[Value], rins: list[Any]) -> tuple[list[Value], list[Any]]:
        """Inlines a jaxpr (closed or open) called on ``ins``."""
        jaxpr, consts = (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, [])
        return self.run(jaxpr, consts, ins, rins)

    def scan(self, eqn: Any, ins: list[Value], rins: list[Any]) -> tuple[list[Value], list[Any]]:
        """``lax.scan`` unrolled: the body once per step, on slices of the scanned inputs."""
        p = eqn.params
        n_consts, n_carry, length = p["num_consts"], p["num_carry"], int(p["length"])
        consts, carry, xs = (
            ins[:n_consts],
            ins[n_consts : n_consts + n_carry],
            ins[n_consts + n_carry :],
        )
        rconsts = rins[:n_consts]
        rcarry, rxs = rins[n_consts : n_consts + n_carry], rins[n_consts + n_carry :]
        if length == 0:  # no step: the carry as given, empty stacked outputs
            routs = eqn.primitive.bind(*rins, **eqn.params)
            return [*carry, *(Const(np.asarray(r)) for r in routs[n_carry:])], list(routs)
        ys: list[list[tuple[Value, Any]]] = [[] for _ in eqn.outvars[n_carry:]]
        steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for t in steps:
            x_t = [self._index(x, r, t, eqn) for x, r in zip(xs, rxs, strict=True)]
            outs, routs = self.call(
                p["jaxpr"],
                [*consts, *carry, *(v for v, _ in x_t)],
                [*rconsts, *rcarry, *(r for _, r in x_t)],
            )
            carry, rcarry = outs[:n_carry], routs[:n_carry]
            for k, (v, r) in enumerate(zip(outs[n_carry:], routs[n_carry:], strict=True)):
                ys[k].append((v, r))
        if p["reverse"]:
            ys = [list(reversed(y)) for y in ys]
        stacked = [self._stack(y, eqn) for y in ys]
        return [*carry, *(v for v, _ in stacked)], [*rcarry, *(r for _, r in stacked)]

    def while_loop(
        self, eqn: Any, ins: list[Value], rins: list[Any]
    ) -> tuple[list[Value], list[Any]]:
        """``lax.while_loop`` unrolled while its condition is a constant."""
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, state = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]
        rcc, rbc, rstate = rins[:nc], rins[nc : nc + nb], rins[nc + nb :]
        for _ in range(_MAX_WHILE_STEPS + 1):
            (go,), _ = self.call(p["cond_jaxpr"], [*cconsts, *state], [*rcc, *rstate])
            if not isinstance(go, Const):
                raise ExportError(
                    f"a while_loop whose condition depends on the inputs has no ONNX lowering "
                    f"(at {_where(eqn)}); allowed: a fixed number of steps (lax.scan, "
                    "lax.fori_loop with Python int bounds, or a condition on constants)"
                )
            if not bool(go.value):
                return state, rstate
            state, rstate = self.call(p["body_jaxpr"], [*bconsts, *state], [*rbc, *rstate])
        raise ExportError(
            f"a while_loop runs more than {_MAX_WHILE_STEPS} steps (at {_where(eqn)}); "
            f"allowed: at most {_MAX_WHILE_STEPS} (each step is unrolled)"
        )

    def cond(self, eqn: Any, ins: list[Value], rins: list[Any]) -> tuple[list[Value], list[Any]]:
        """``lax.cond`` / ``switch``: the branch of a constant index, else all and Where."""
        branches = eqn.params["branches"]
        index, ops, rops = ins[0], ins[1:], rins[1:]
        if isinstance(index, Const):
            return self.call(branches[int(index.value)], ops, rops)
        results = [self.call(b, ops, rops)[0] for b in branches]
        routs = eqn.primitive.bind(*rins, **eqn.params)
        self.g.begin()
        idx = _lowering.name(self.g, index)
        names = []
        for k in range(len(eqn.outvars)):
            out = _lowering.name(self.g, results[0][k])
            for b in range(1, len(branches)):
                hit = self.g.op("Equal", idx, self.g.const(np.asarray(b, index.dtype)))
                out = self.g.op("Where", hit, _lowering.name(self.g, results[b][k]), out)
            names.append(out)
        outs = self._outputs(eqn, names, list(routs))
        reads = [index, *(r[k] for r in results for k in range(len(eqn.outvars)))]
        self.g.end(Unit("cond", _tensors(reads), outs, [], source=_where(eqn)))
        return list(outs), list(routs)

    def _index(self, x: Value, r: Any, t: int, eqn: Any) -> tuple[Value, Any]:
        """Step ``t`` of a scanned input: ``x[t]``."""
        if isinstance(x, Const):
            return Const(np.asarray(x.value)[t]), r[t]
        self.g.begin()
        out = self.g.op("Gather", x.name, self.g.const(np.asarray(t, np.int64)), axis=0)
        rt = np.asarray(r[t])
        tensor = Tensor(out, x.shape[1:], np.dtype(x.dtype))
        self.refs[out] = rt
        self.g.end(Unit("scan step input", [x], [tensor], [], source=_where(eqn)))
        return tensor, r[t]

    def _stack(self, ys: list[tuple[Value, Any]], eqn: Any) -> tuple[Value, Any]:
        """The per-step outputs of a scan stacked along a new axis 0."""
        ref = jax.numpy.stack([r for _, r in ys])
        consts = [v.value for v, _ in ys if isinstance(v, Const)]
        if len(consts) == len(ys):
            return Const(np.stack([np.asarray(c) for c in consts])), ref
        self.g.begin()
        parts = [
            self.g.op("Unsqueeze", _lowering.name(self.g, v), _lowering.ints(self.g, [0]))
            for v, _ in ys
        ]
        out = self.g.op("Concat", *parts, axis=0)
        v0 = ys[0][0]
        tensor = Tensor(out, (len(ys), *v0.shape), np.dtype(v0.dtype))
        self.refs[out] = np.asarray(ref)
        self.g.end(
            Unit("scan stack", _tensors([v for v, _ in ys]), [tensor], [], source=_where(eqn))
        )
        return tensor, ref

    def _keep_unfolded(self, eqn: Any, ins: list[Value]) -> bool:
        """A broadcast of a constant to a large shape stays a broadcast."""
        if eqn.primitive.name != "broadcast_in_dim":
            return False
        aval = eqn.outvars[0].aval
        return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize > _FOLD_LIMIT_BYTES

    def _outputs(self, eqn: Any, names: list[str], routs: list[Any]) -> list[Tensor]:
        outs = []
        for var, n, r in zip(eqn.outvars, names, routs, strict=True):
            outs.append(Tensor(n, tuple(var.aval.shape), np.dtype(var.aval.dtype)))
            self.refs[n] = np.asarray(r)
        return outs

    def site(self, eqn: Any, ins: list[Value], rins: list[Any]) -> tuple[list[Value], list[Any]]:
        rec = self.sites[eqn.params["name"]]
        _check_no_bfloat16(eqn)
        routs = eqn.primitive.bind(*rins, **eqn.params)
        aval = eqn.outvars[0].aval
        conv = _conv_params(eqn.params["jaxpr"].jaxpr) if rec.op == "conv_general_dilated" else None
        self.g.begin()
        try:
            name, check = _quantized.lower_site(
                self.g, rec, ins, tuple(aval.shape), aval.dtype, conv_params=conv
            )
        except ExportError as e:
            raise ExportError(f"{e} (site {rec.where})") from None
        outs = self._outputs(eqn, [name], list(routs))
        self.g.end(Unit(f"{rec.op} {rec.where}", _tensors(ins), outs, [], rec, rec.where))
        if check is not None:
            self.checks[len(self.g.units) - 1] = check
        return list(outs), list(routs)

    def mark(
        self, eqn: Any, mark: qdq.Mark, ins: list[Value], rins: list[Any]
    ) -> tuple[list[Value], list[Any]]:
        """A call marked by :mod:`qort.qdq`: Q/DQ nodes instead of its arithmetic."""
        routs = list(eqn.primitive.bind(*rins, **eqn.params))
        x, scale, zero_point = ins
        if not isinstance(scale, Const) or not isinstance(zero_point, Const):
            raise ExportError(f"{eqn.params['name']}: the scale is computed while the model runs")
        self.g.begin()
        if mark.kind == "dequantize":
            if not isinstance(x, Const):
                raise ExportError(f"{eqn.params['name']}: the codes are computed at run time")
            name = _quantized.lower_dq(self.g, mark, x.value, scale.value, zero_point.value)
            check = None
        elif isinstance(x, Const):  # a constant fake-quantized: folded like any constant
            self.g.end(Unit("folded", [], [], []))
            return [Const(_folded(routs[0]))], routs
        else:
            name, check = _quantized.lower_qdq(self.g, mark, x, scale.value, zero_point.value)
        outs = self._outputs(eqn, [name], routs)
        self.g.end(Unit(mark.kind, _tensors(ins), outs, [], mark, _where(eqn)))
        if check is not None:
            self.qdq_checks[len(self.g.units) - 1] = check
        return list(outs), routs


# Ops a dequantized operand may pass through on its way to a product (max pooling
# commutes with DequantizeLinear: its scale is positive).
_LAYOUT_OPS = ("Transpose", "Reshape", "Identity", "Flatten", "Squeeze", "Unsqueeze", "MaxPool")


def _fuse_biases(g: Graph, refs: dict[str, np.ndarray]) -> None:
    """Moves a dequantized bias added after a ``Conv`` or 2-D ``MatMul`` into the op.

    JAX adds a layer's bias as its own ``add``; ONNX Runtime fuses a quantized
    product only when the int32 bias is its input (``QLinearConv``, ``QGemm``). So
    ``Conv(x, w)`` + ``Reshape(DequantizeLinear(b))`` becomes ``Conv(x, w, DQ(b))``,
    and ``MatMul(x, [Transpose](w))`` + ``DQ(b)`` becomes ``Gemm(x, w, DQ(b))``. The
    product's unit takes over the addition's unit (validated as one float op).
    """
    producer = {o: i for i, n in enumerate(g.nodes) for o in n.output}
    readers: dict[str, int] = {}
    for n in g.nodes:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
    unit_of = {k: u for u in g.units for k in u.nodes}
    drop: set[int] = set()

    def source(name: str, through: tuple[str, ...]) -> tuple[int | None, list[int]]:
        """The node producing ``name`` behind ops in ``through``, and those ops."""
        passed = []
        i = producer.get(name)
        while i is not None and g.nodes[i].op_type in through:
            passed.append(i)
            i = producer.get(g.nodes[i].input[0])
        return i, passed

    for j, add in enumerate(g.nodes):
        if add.op_type != "Add" or len(add.input) != 2:
            continue
        for y_in, b_in in (add.input, add.input[::-1]):
            p, between = source(y_in, ("Reshape",))
            d, _ = source(b_in, ("Reshape", "Unsqueeze"))
            if p is None or d is None or g.nodes[d].op_type != "DequantizeLinear":
                continue
            bias = g.nodes[d].output[0]
            prod = g.nodes[p]
            shape = refs.get(bias, np.zeros((0, 0))).shape
            out = refs.get(add.output[0])
            if len(shape) != 1 or out is None or len(prod.input) != 2 or between and out.ndim != 2:
                continue
            if any(readers.get(g.nodes[k].output[0], 0) != 1 for k in [p, *between]):
                continue
            # Where the added bias runs: along axis 1 for Conv, the last axis for MatMul.
            added = refs.get(b_in, np.zeros(())).shape
            added = (1,) * (out.ndim - len(added)) + tuple(added)
            along = [a for a, n in enumerate(added) if n != 1]
            if len(added) != out.ndim or along not in ([1], [out.ndim - 1]):
                continue
            if prod.op_type == "Conv" and not between and along == [1] and out.ndim > 2:
                prod.input.append(bias)
            elif prod.op_type == "MatMul" and out.ndim == 2 and along == [1]:
                a, w = prod.input
                t, _ = source(w, ())
                attrs: dict[str, Any] = {}
                if t is not None and g.nodes[t].op_type == "Transpose" and readers[w] == 1:
                    if list(g.nodes[t].attribute[0].ints) != [1, 0]:
                        continue
                    w, attrs = g.nodes[t].input[0], {"transB": 1}
                    drop.add(t)
                gemm = helper.make_node("Gemm", [a, w, bias], list(prod.output), **attrs)
                g.nodes[p] = gemm
            else:
                continue
            # The product (and the reshapes after it) now compute the sum: they write
            # the Add's output, the Add's unit becomes part of the product's.
            last = between[0] if between else p
            g.nodes[last].output[0] = add.output[0]
            drop.add(j)
            u, v, b = unit_of.get(p), unit_of.get(j), unit_of.get(d)
            if u is not None and v is not None and u is not v:
                u.outputs = v.outputs
                bias_t = [t for t in (b.outputs if b else []) if t.name == bias]
                if bias_t and bias not in {t.name for t in u.inputs}:
                    u.inputs.append(bias_t[0])
                u.nodes = sorted(set(u.nodes) | set(v.nodes))
                v.nodes = []
            break
    if drop:
        _reorder(g, drop)


def _reorder(g: Graph, drop: set[int]) -> None:
    """Removes the nodes at ``drop`` and sorts the rest topologically.

    A bias moved into a product may be dequantized after it. Renumbers the units'
    node lists.
    """
    keep = [i for i in range(len(g.nodes)) if i not in drop]
    producer = {o: i for i in keep for o in g.nodes[i].output}
    order: list[int] = []
    placed: set[int] = set()

    def place(i: int) -> None:
        if i in placed:
            return
        placed.add(i)
        for x in g.nodes[i].input:
            if x in producer:
                place(producer[x])
        order.append(i)

    for i in keep:
        place(i)
    index = {i: k for k, i in enumerate(order)}
    g.nodes = [g.nodes[i] for i in order]
    for unit in g.units:
        unit.nodes = sorted(index[i] for i in unit.nodes if i in index)


def _name_products(g: Graph) -> dict[str, str]:
    """Names each ``Conv`` / ``MatMul`` whose two operands are dequantized codes.

    Returns ``{node name: where it was traced}``; validation looks the names up in
    ONNX Runtime's optimized graph (a product left as a float op keeps its name).
    """
    producer = {o: n for n in g.nodes for o in n.output}
    where = {k: u.source for u in g.units for k in u.nodes}

    def dequantized(name: str) -> bool:
        node = producer.get(name)
        while node is not None and node.op_type in _LAYOUT_OPS:
            node = producer.get(node.input[0])
        return node is not None and node.op_type == "DequantizeLinear"

    found = {}
    for i, node in enumerate(g.nodes):
        if node.op_type in ("Conv", "MatMul", "Gemm") and all(
            dequantized(x) for x in node.input[:2]
        ):
            node.name = f"qdq_product_{len(found)}"
            found[node.name] = where.get(i) or node.op_type
    return found


class _Float32Equation:
    """An equation seen with float32 in place of float16 (avals and dtype params)."""

    def __init__(self, eqn: Any) -> None:
        f16 = np.dtype(np.float16)
        swap = lambda x: np.dtype(np.float32) if _is_dtype(x, f16) else x  # noqa: E731
        self.primitive = eqn.primitive
        self.source_info = eqn.source_info
        self.params = {k: swap(v) for k, v in eqn.params.items()}
        self.invars = eqn.invars
        self.outvars = [
            _Aval(v.aval.update(dtype=np.float32) if _is_dtype(v.aval.dtype, f16) else v.aval)
            for v in eqn.outvars
        ]


@dataclasses.dataclass(frozen=True)
class _Aval:
    aval: Any


def _is_dtype(x: Any, dtype: np.dtype) -> bool:
    try:
        return isinstance(x, np.dtype | type) and np.dtype(x) == dtype
    except TypeError:
        return False


def _check_no_bfloat16(eqn: Any) -> None:
    """bfloat16 graph values: refused (ONNX Runtime's CPU kernels mostly lack them)."""
    for v in (*eqn.invars, *eqn.outvars):
        if getattr(getattr(v, "aval", None), "dtype", None) == jax.numpy.bfloat16:
            raise ExportError(
                f"the JAX primitive {eqn.primitive.name!r} computes in bfloat16 (at "
                f"{_where(eqn)}); allowed: float32 or float16 (ONNX Runtime's CPU provider "
                "has no bfloat16 kernels for most ops; compute in float32, e.g. a Flax "
                "module's dtype=jnp.float32)"
            )


def _live(jaxpr: Any) -> list[Any]:
    """The equations of ``jaxpr`` whose results an output needs (or with effects)."""
    needed = {v for v in jaxpr.outvars if isinstance(v, jex.Var)}
    keep = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in needed for v in eqn.outvars if not isinstance(v, jex.DropVar)):
            keep.append(eqn)
            needed.update(v for v in eqn.invars if isinstance(v, jex.Var))
    return keep[::-1]


def _folded(value: Any) -> Any:
    """A folded value as NumPy; PRNG keys (no NumPy dtype) stay JAX arrays.

    A key is only ever read by other folded equations (``random_bits``...); a graph
    op that needs one as an initializer fails in :func:`qort._lowering.name`.
    """
    try:
        return np.asarray(value)
    except TypeError:
        return value


def _tensors(values: Sequence[Value]) -> list[Tensor]:
    seen: dict[str, Tensor] = {}
    for v in values:
        if isinstance(v, Tensor):
            seen.setdefault(v.name, v)
    return list(seen.values())


def _where(eqn: Any) -> str:
    """Where an equation came from: the module/function name stack, when there is one."""
    stack = str(getattr(eqn.source_info, "name_stack", "") or "")
    return f"{eqn.primitive.name} in {stack}" if stack else eqn.primitive.name


def _conv_params(jaxpr: Any) -> dict:
    """The parameters of the one convolution inside a captured site."""
    found = []

    def visit(j: Any) -> None:
        for e in j.eqns:
            if e.primitive.name == "conv_general_dilated":
                found.append(e.params)
            for sub in jex.jaxprs_in_params(e.params):
                visit(sub)

    visit(jaxpr)
    if len(found) != 1:
        raise ExportError(
            f"a quantized convolution site holds {len(found)} convolutions; allowed: one"
        )
    return dict(found[0])


def convert(
    fn: Any,
    args: Sequence[Any],
    sites: dict[str, SiteRecord],
    input_names: Sequence[str],
    output_names: Sequence[str] | None,
) -> Converted:
    """Traces ``fn(*args)`` and converts it (see the module docstring)."""
    flat, in_tree = jax.tree.flatten(tuple(args))
    closed = jax.make_jaxpr(lambda *leaves: fn(*jax.tree.unflatten(in_tree, leaves)))(*flat)
    out_tree = jax.tree.structure(jax.eval_shape(lambda: fn(*args)))
    w = _Walker(sites)
    inputs = []
    for var, n, x in zip(closed.jaxpr.invars, input_names, flat, strict=True):
        inputs.append(Tensor(n, tuple(var.aval.shape), np.dtype(var.aval.dtype)))
        # JAX traces int64 and float64 examples as int32 and float32 (x64 off).
        w.refs[n] = np.asarray(x).astype(var.aval.dtype)
    outs, _ = w.run(closed.jaxpr, closed.consts, inputs, [jax.numpy.asarray(x) for x in flat])
    if not outs:
        raise ExportError(
            f"the function returns no arrays (output structure {out_tree}); allowed: at least "
            "one array output"
        )
    names = list(output_names) if output_names else [f"output_{i}" for i in range(len(outs))]
    if len(names) != len(outs):
        raise ExportError(
            f"output_names has {len(names)} names but the function returns {len(outs)} "
            "arrays; allowed: one name per output leaf"
        )
    outputs = []
    for v, n in zip(outs, names, strict=True):
        # Every output is an Identity of its value: outputs that are graph inputs,
        # initializers or another output's value are graph outputs of their own.
        src = _lowering.name(w.g, v)
        w.g.nodes.append(helper.make_node("Identity", [src], [n]))
        outputs.append(Tensor(n, v.shape, np.dtype(v.dtype)))
        w.refs[n] = w.refs[v.name] if isinstance(v, Tensor) else v.value
    _fuse_biases(w.g, w.refs)
    _prune(w.g, [t.name for t in outputs])
    products = _name_products(w.g)
    # Validation cuts the graph per unit from w.g.nodes; the model drops repeats.
    graph = helper.make_graph(
        deduplicated(w.g.nodes, [t.name for t in outputs]),
        "qort",
        [value_info(t) for t in inputs],
        [value_info(t) for t in outputs],
        list(w.g.initializers.values()),
    )
    opsets = [helper.make_opsetid("", OPSET)]
    if any(node.domain == CONTRIB_DOMAIN for node in graph.node):
        opsets.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="qort")
    model.ir_version = IR_VERSION
    structure = _tree.encode(out_tree)
    if structure is not None:
        helper.set_model_props(model, {_tree.KEY: structure})
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:  # a lowering bug, not the user's
        raise ExportError(f"the ONNX checker rejected the exported graph: {e}") from e
    return Converted(
        model, w.g, inputs, outputs, w.refs, w.checks, out_tree, w.qdq_checks, products
    )


def _prune(g: Graph, outputs: list[str]) -> None:
    """Drops nodes no output needs, and initializers no node reads; renumbers units."""
    needed = set(outputs)
    keep = [False] * len(g.nodes)
    for i in range(len(g.nodes) - 1, -1, -1):
        if any(o in needed for o in g.nodes[i].output):
            keep[i] = True
            needed.update(x for x in g.nodes[i].input if x)
    index = {}
    nodes = []
    for i, node in enumerate(g.nodes):
        if keep[i]:
            index[i] = len(nodes)
            nodes.append(node)
    g.nodes = nodes
    g.initializers = {k: v for k, v in g.initializers.items() if k in needed}
    for unit in g.units:
        unit.nodes = [index[i] for i in unit.nodes if i in index]

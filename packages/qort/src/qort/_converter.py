"""A traced JAX function (its jaxpr) as an ONNX model.

The converter walks the jaxpr once, equation by equation, carrying two values per
variable: its ONNX value (a constant or a graph tensor) and its JAX value on the
example inputs (the *reference*, which validation feeds to each op on its own).

- Calls (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``...) are
  inlined, except qflax's captured quantized ops (:mod:`qort._capture`), which
  become integer ONNX ops (:mod:`qort._quantized`).
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

from qort import _lowering, _quantized, _tree
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
    "checkpoint": "jaxpr",
}
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
    """

    model: onnx.ModelProto
    graph: Graph
    inputs: list[Tensor]
    outputs: list[Tensor]
    refs: dict[str, np.ndarray]
    checks: dict[int, _quantized.CodeCheck]
    out_tree: Any


class _Walker:
    def __init__(self, sites: dict[str, SiteRecord]) -> None:
        self.g = Graph()
        self.sites = sites
        self.refs: dict[str, np.ndarray] = {}
        self.checks: dict[int, _quantized.CodeCheck] = {}

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

        for eqn in jaxpr.eqns:
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
        if prim in _INLINE and _INLINE[prim] in eqn.params:
            body = eqn.params[_INLINE[prim]]
            jaxpr, consts = (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, [])
            return self.run(jaxpr, consts, ins, rins)
        routs = eqn.primitive.bind(*rins, **eqn.params)
        routs = list(routs) if eqn.primitive.multiple_results else [routs]
        if all(isinstance(v, Const) for v in ins) and not self._keep_unfolded(eqn, ins):
            return [Const(_folded(r)) for r in routs], routs
        self.g.begin()
        try:
            names = _lowering.lower(self.g, eqn, ins)
        except ExportError as e:
            raise ExportError(f"{e} (at {_where(eqn)})") from None
        outs = self._outputs(eqn, names, routs)
        self.g.end(Unit(prim, _tensors(ins), outs, [], source=_where(eqn)))
        return list(outs), routs

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
    _prune(w.g, [t.name for t in outputs])
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
    return Converted(model, w.g, inputs, outputs, w.refs, w.checks, out_tree)


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

"""From an intercepted call to a typed site, and from a site to a visitor.

:func:`classify` is the one place that turns an intercepted op call into what a
provider acts on: it finds the calling module and its path, names the site
(``einsum0``, ``dot_general1``... per module in call order; every op counts, so
names do not depend on rules), matches the rules (first match wins, recording
which rules were used), binds the call with the op's registry entry, tells
weights from activations by where each operand came from (a model parameter
read in this call, see :mod:`qflax._engine.context`) and plans each operand's
quantization under the rule, validating tiles and rotation once, here.

The result is an :class:`OpSite` (a contraction) or a :class:`LookupSite` (a
table lookup), or None when the call is not the providers' business (no calling
module, no matching rule, a call that binds to nothing, a lookup in an array
that is not a parameter). :func:`handler` feeds sites to a :class:`Visitor`:
the providers (PTQ, QAT, LoRA by composition over PTQ), statistics collection and
the quantization report are visitors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

import qcore
from qflax._engine import interception, opcall, registry
from qflax._engine.context import CallContext, Source
from qflax._engine.opcall import OpCall, TakeCall, arguments, bind
from qflax.rotation import Hadamard
from qflax.rule import QuantizationRule, RuleMatcher

SIDES = ("lhs", "rhs")


@dataclasses.dataclass(frozen=True)
class Weight:
    """Plan for a weight operand: its spec, where it was read, its rotation."""

    spec: qcore.HowToQuantize
    source: Source
    rotation: Hadamard | None = None


@dataclasses.dataclass(frozen=True)
class Activation:
    """Plan for an activation operand: a dynamic spec, or a static site name."""

    spec: qcore.HowToQuantize | None
    site: str | None
    qtype: str
    calibration: str


Plan = Weight | Activation | None


@dataclasses.dataclass(frozen=True)
class _Site:
    """What both kinds of site share: the op, the module, the rule, the original call."""

    op: str  # the op's registry name
    module: Any
    path: str  # the module's path
    name: str  # the site's name in its module, e.g. "einsum0"
    rule: QuantizationRule
    original: Callable[..., Any]
    args: tuple
    kwargs: dict

    @property
    def where(self) -> str:
        """``path/name`` (or ``name`` at the root), as errors show the site."""
        return f"{self.path}/{self.name}" if self.path else self.name

    def run_original(self) -> Any:
        """The unmodified op on the original arguments."""
        return self.original(*self.args, **self.kwargs)


@dataclasses.dataclass(frozen=True)
class OpSite(_Site):
    """A contraction a rule selected, its operands' provenance and plans."""

    call: OpCall
    sources: tuple[Source | None, Source | None]
    plans: tuple[Plan, Plan]


@dataclasses.dataclass(frozen=True)
class LookupSite(_Site):
    """A lookup in a parameter that a rule with ``weight_qtype`` selected."""

    call: TakeCall
    plan: Weight


class Visitor(Protocol):
    """What acts on sites: a provider, statistics collection, the report."""

    def visit_op(self, ctx: CallContext, site: OpSite) -> jax.Array:
        """The op's result (e.g. computed quantized, or ``site.run_original()``)."""
        ...

    def visit_lookup(self, ctx: CallContext, site: LookupSite) -> jax.Array:
        """The lookup's result."""
        ...


def handler(
    ctx: CallContext, matcher: RuleMatcher, visitor: Visitor
) -> Callable[[str, Callable[..., Any], tuple, dict], Any]:
    """The op handler of one call (see ``interception.intercept``) that feeds ``visitor``."""

    def handle(name: str, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        op = registry.get(name)
        if op.split is not None and op.split(arguments(original, args, kwargs)):
            return interception.run_inside(original, args, kwargs)
        site = classify(ctx, matcher, name, original, args, kwargs)
        if site is None:
            out = original(*args, **kwargs)
            if op.lookup:
                _follow_index(ctx, arguments(original, args, kwargs), out)
            return out
        if isinstance(site, LookupSite):
            return visitor.visit_lookup(ctx, site)
        return visitor.visit_op(ctx, site)

    return handle


def _follow_index(ctx: CallContext, a: dict[str, Any], out: Any) -> None:
    """Indexing of a parameter left float: a reshape (``w[None]``) is followed, a slice noted."""
    table, idx = a.get("arr"), a.get("idx")
    if table is None or not isinstance(out, jax.Array):
        return
    if opcall.reshape_index(idx) and out.size == table.size:
        ctx.follow(table, out, ("reshape", tuple(out.shape)))
    elif opcall.static_index(idx):
        ctx.taint((table,), out, "indexing")


def classify(
    ctx: CallContext,
    matcher: RuleMatcher,
    name: str,
    original: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> OpSite | LookupSite | None:
    """The site of an intercepted call, or None if no rule makes it the providers' business.

    Raises:
        ValueError: A rule that does not fit the op (tiles that do not divide a
            weight's axis, a rotation of an op that contracts several axes, a
            rotated lookup, ``act_batch_axes`` out of range, a rule quantizing an
            integer param).
    """
    op = registry.get(name)
    args = tuple(ctx.read(a) for a in args)
    kwargs = {k: ctx.read(v) for k, v in kwargs.items()}
    if op.lookup and ctx.source(args[0] if args else _first(kwargs)) is None:
        return None  # not a lookup in a param (most indexing)
    found = ctx.calling_module()
    if found is None:
        return None
    module, path = found
    site = ctx.site(module, name)
    rule = matcher.match(path, name)
    if rule is None:
        return None
    call = _bind(op, original, args, kwargs)
    if call is None:
        return None
    base = {
        "op": name,
        "module": module,
        "path": path,
        "name": site,
        "rule": rule,
        "original": original,
        "args": args,
        "kwargs": kwargs,
    }
    if isinstance(call, TakeCall):
        return _lookup(ctx, base, call, rule)
    sources = (ctx.source(call.operands[0]), ctx.source(call.operands[1]))
    if rule.weight_qtype is not None and sources == (None, None):
        # With a followed weight on one side, a param-derived other operand is the
        # op's activation (a learned query broadcast to the batch), not a lost weight.
        for x in call.operands:
            _warn_unfollowed(ctx, matcher, x, f"{path}/{site}" if path else site, rule)
    plans = (
        _plan(call, rule, 0, site, sources[0], path),
        _plan(call, rule, 1, site, sources[1], path),
    )
    return OpSite(**base, call=call, sources=sources, plans=plans)


def _warn_unfollowed(
    ctx: CallContext, matcher: RuleMatcher, operand: Any, where: str, rule: QuantizationRule
) -> None:
    """Warns, once per param and rule list, when ``operand`` is a param not followed to the op."""
    found = ctx.derived(operand)
    if found is None or not jnp.issubdtype(found[0].value.dtype, jnp.inexact):
        return
    source, how = found
    fate = "quantized per call as an activation" if rule.act_qtype else "left float"
    matcher.warn_once(
        source.path,
        f"param {source.path!r} reaches op site {where!r} through {how!r}, which qflax "
        f"cannot follow, so the rule's weight_qtype={rule.weight_qtype!r} does not apply: it "
        f"is stored float and {fate}. Pass the param to the op as read (casts, "
        "transposes, reshapes, squeeze/expand_dims, indexing by None/.../: and "
        "jax.checkpoint arguments are followed) and apply the transform to the op's "
        "other operand or its output, or store the param already transformed",
    )


def _bind(
    op: registry.OpDef, original: Callable[..., Any], args: tuple, kwargs: dict
) -> OpCall | TakeCall | None:
    """``bind(op.bind, ...)``, with a registered op's binder checked and its errors named."""
    if op.name in registry.BUILTIN_NAMES:
        return bind(op.bind, original, args, kwargs)
    try:
        call = bind(op.bind, original, args, kwargs)
    except Exception as err:
        raise ValueError(
            f"bind of op {op.name!r} raised {err!r}; a binder returns an OpCall, a TakeCall "
            "or None for the call's arguments"
        ) from err
    if call is not None and not isinstance(call, OpCall | TakeCall):
        raise TypeError(
            f"bind of op {op.name!r} returned {call!r}; allowed: an OpCall, a TakeCall or None"
        )
    if call is not None and call.name != op.name:
        raise ValueError(
            f"bind of op {op.name!r} returned a call with name={call.name!r}; allowed: "
            f"name={op.name!r} (e.g. OpCall.from_einsum({op.name!r}, ...))"
        )
    return call


def _first(kwargs: dict) -> Any:
    return kwargs.get("a", kwargs.get("arr"))


def _lookup(
    ctx: CallContext, base: dict[str, Any], call: TakeCall, rule: QuantizationRule
) -> LookupSite | None:
    source = ctx.source(call.table)
    if rule.weight_qtype is None or source is None or skips(rule, source):
        return None
    if rule.rotation is not None:
        raise ValueError(
            f"table {source.path!r}: rotation={rule.rotation!r} does not apply to a "
            "lookup (jnp.take); give the lookup a rule without rotation"
        )
    table = call.table
    spec = checked_spec(lambda: rule.lookup_spec(table.shape, call.axis), table, source.path)
    return LookupSite(**base, call=call, plan=Weight(spec, source))


def _plan(
    call: OpCall, rule: QuantizationRule, i: int, site: str, source: Source | None, path: str
) -> Plan:
    x = call.operands[i]
    if rule.rotation is not None and (
        len(call.contracting[0]) != 1
        or call.operands[0].shape[call.contracting[0][0]]
        != call.operands[1].shape[call.contracting[1][0]]
    ):
        raise ValueError(
            f"module {path!r}: rotation={rule.rotation!r} needs an op "
            f"that contracts exactly one axis of each operand, but {call.name} contracts "
            f"axes {call.contracting}; allowed: dot_general/einsum/dot/matmul with one "
            "contracting axis (exclude this op with a rule placed before this one)"
        )
    if source is not None:
        if rule.weight_qtype is None or skips(rule, source):
            return None
        spec = checked_spec(lambda: rule.weight_spec(x.shape, call.contracting[i]), x, source.path)
        if rule.rotation is not None:
            return Weight(spec, source, Hadamard(rule.rotation_seed, call.contracting[i][0]))
        return Weight(spec, source)
    if rule.act_qtype is None:
        return None
    qtype = qcore.qtypes.get(rule.act_qtype).name
    if rule.act_static_scale:
        return Activation(None, f"{site}_{SIDES[i]}", qtype, rule.act_calibration_method)
    try:
        spec = rule.act_spec(x.ndim, call.contracting[i])
    except ValueError as err:
        raise ValueError(
            f"rule module_path={rule.module_path!r} at module {path!r}, "
            f"op {call.name} (operand {SIDES[i]} of shape {tuple(x.shape)}): {err}"
        ) from None
    return Activation(spec, None, qtype, rule.act_calibration_method)


def checked_spec(
    make: Callable[[], qcore.HowToQuantize | None], weight: jax.Array, path: str
) -> qcore.HowToQuantize:
    """``make()``, a rule's spec for ``weight`` (param ``path``), checked against its shape.

    Raises:
        ValueError: The rule's error (bad tile axes, tiles that do not divide the
            axis) prefixed with the param's path and shape.
    """
    try:
        spec = make()
        assert spec is not None
        spec.scale_shape(weight.shape)
    except ValueError as err:
        raise ValueError(f"weight {path!r} of shape {tuple(weight.shape)}: {err}") from None
    return spec


def skips(rule: QuantizationRule, source: Source) -> bool:
    """Whether ``rule`` leaves a non-float param alone (the catch-all ``".*"`` rule does).

    Raises:
        ValueError: For any other rule that selects an integer or bool param.
    """
    dtype = jnp.dtype(source.value.dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return False
    if rule.module_path == ".*":
        return True
    raise ValueError(
        f"param {source.path!r} has dtype {dtype}, but the rule module_path="
        f"{rule.module_path!r} quantizes it to {rule.weight_qtype}; allowed: floating-point "
        "params (the catch-all module_path='.*' rule skips other dtypes)"
    )

"""The provider interface, and what the providers share.

A provider is a :class:`~qflax._engine.dispatch.Visitor` that owns a list of
rules: the engine classifies each intercepted call into a site
(:mod:`qflax._engine.dispatch`) and hands it to :meth:`Provider.visit_op` or
:meth:`Provider.visit_lookup`, whose return value is the op's result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import qcore
from qflax import stats
from qflax._engine import dispatch
from qflax._engine.context import CallContext
from qflax._engine.dispatch import Activation, LookupSite, OpSite, Weight
from qflax._engine.opcall import OpCall
from qflax.qparam import Recipe
from qflax.rotation import rotate
from qflax.rule import QuantizationRule, RuleMatcher


class Provider:
    """Base class of the providers: rule matching, the per-call handler, unused-rule report.

    Subclasses implement :meth:`visit_op` (a contraction a rule selected) and
    :meth:`visit_lookup` (a lookup in a parameter); see ``docs/extending.md``.

    Args:
        rules: The :class:`~qflax.QuantizationRule` list, first match wins.
    """

    # Whether quantize_model stores quantized params for the weights this provider's
    # rules select (PTQ), or keeps them float (QAT).
    stores_quantized_weights = False
    # Whether an NNX model's statistics update on each call (QAT's static ranges).
    learns_statistics = False

    def __init__(self, rules: Sequence[QuantizationRule]) -> None:
        self._matcher = RuleMatcher(rules)
        self.rules = tuple(self._matcher.rules)
        self._warned = False

    def unused_rules(self) -> list[QuantizationRule]:
        """Rules that have matched no op in any call so far."""
        return self._matcher.unused_rules()

    def warn_unused(self) -> None:
        """Warns (``UserWarning``) about every rule that has matched no op."""
        self._matcher.warn_unused()

    def call_finished(self) -> None:
        """Called after each model call; warns about unused rules after the first."""
        if not self._warned:
            self._warned = True
            self.warn_unused()

    def nnx_variables(self, model: Any, ctx: CallContext) -> list[tuple[Any, str, Any]]:
        """Variables to add to an NNX model after discovery, as ``(module, name, variable)``.

        Called by :func:`qflax.quantize_model` outside any trace, after every
        check of the conversion passed and before anything is added; ``ctx`` holds
        what the discovery pass recorded (``ctx.requests``). None by default.
        """
        del model, ctx
        return []

    def handler(self, ctx: CallContext) -> Callable[[str, Callable[..., Any], tuple, dict], Any]:
        """The op handler for one call (see ``qflax._engine.interception.intercept``)."""
        return dispatch.handler(ctx, self._matcher, self)

    def visit_op(self, ctx: CallContext, site: OpSite) -> jax.Array:
        """Computes a contraction a rule selected (each provider's own)."""
        raise NotImplementedError

    def visit_lookup(self, ctx: CallContext, site: LookupSite) -> jax.Array:
        """Computes a lookup in a parameter a rule selected (each provider's own)."""
        raise NotImplementedError


def site_call(site: OpSite, *, keep_weights: bool) -> OpCall:
    """The site's call, with its operands' contracting axis rotated if the rule says so.

    See :mod:`qflax.rotation`. With ``keep_weights``, weight operands are left as
    they are (a provider that stores weights rotated does not rotate them per call).
    """
    call = site.call
    if site.rule.rotation is None:
        return call
    new = list(call.operands)
    for i, (x, plan) in enumerate(zip(call.operands, site.plans, strict=True)):
        if not (keep_weights and isinstance(plan, Weight)):
            new[i] = rotate(x, call.contracting[i][0], site.rule.rotation_seed)
    return dataclasses.replace(call, operands=(new[0], new[1]))


def weight_recipe(plan: Weight, x: jax.Array) -> Recipe:
    """How a weight is quantized: the plan's spec in the layout the op received it in."""
    value = plan.source.value
    return Recipe(
        spec=plan.spec,
        transforms=plan.source.transforms,
        shape=tuple(value.shape),
        dtype=jnp.dtype(value.dtype),
        compute_dtype=jnp.dtype(x.dtype),
        rotation=plan.rotation,
    )


def batch_scale(x: jax.Array, plan: Activation) -> jax.Array:
    """The per-tensor scale of a static-range activation from this batch's range."""
    lo, hi = stats.observe(x, plan.calibration)
    return stats.scale({"lo": lo, "hi": hi}, plan.qtype)


def static_quantize(x: jax.Array, qtype: str, scale: jax.Array) -> qcore.QArray:
    """``x`` quantized with one stored scale for the whole tensor, in ``x``'s dtype.

    The codes come from the float32 scale; the QArray then takes ``x``'s dtype (its
    scale too), so the op's result keeps the model's dtype as with dynamic scales.
    """
    scale = scale.astype(jnp.float32).reshape((1,) * x.ndim)
    return qcore.quantize_with_scale_zero_point(x, qtype, scale).astype(x.dtype)


class SiteVars:
    """Reads and writes the variables of a site's module (static scales, statistics)."""

    def __init__(self, ctx: CallContext, site: OpSite | LookupSite) -> None:
        self.ctx, self.module, self.path = ctx, site.module, site.path

    def get(self, collection: str, name: str) -> Any:
        """The value of variable ``name``, or None."""
        return self.ctx.flavor.get_var(self.module, collection, name)

    def mutable(self, collection: str) -> bool:
        """Whether this call may change ``collection``."""
        return self.ctx.flavor.may_update(self.ctx, self.module, collection)

    def put(self, collection: str, name: str, value: Any) -> None:
        """Creates or replaces variable ``name``."""
        self.ctx.flavor.put_var(self.ctx, self.module, self.path, collection, name, value)

"""Marks qflax's quantized ops in the traced model, so the converter can see them.

:class:`CaptureProvider` is qflax's :class:`~qflax.PtqProvider` with one change: a
``dot_general`` or convolution whose weight is quantized (weight-only, or with a
dynamic-range activation) runs as a ``jax.jit`` of its own, named
``qort_site_<n>``, that takes the float activation and the weight's QArray. In the
jaxpr that call is one equation; :class:`SiteRecord` (kept by the provider under
that name) says what it computes, so the converter writes it as integer ONNX ops
instead of lowering qcore's arithmetic op by op. Everything else (static ranges,
activation-by-activation products, lookups) runs as PtqProvider runs it and is
lowered op by op.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax

import qcore
import qflax

_COUNTER = itertools.count()
PREFIX = "qort_site_"


@dataclasses.dataclass(frozen=True)
class SiteRecord:
    """One captured quantized op.

    Attributes:
        where: The site's module path and name in the model (``layer_0/query/dot_general0``).
        op: ``"dot_general"`` or ``"conv_general_dilated"``.
        weight_side: Which operand (0 or 1) is the quantized weight.
        act_spec: The activation's dynamic-range spec, or None (weight-only).
        call: The qflax :class:`~qflax.OpCall` (axes, and the op's own arguments).
        args: The intercepted call's positional arguments (a convolution's window).
        kwargs: Its keyword arguments.
        treedef: Structure of the captured call's ``(lhs, rhs)`` arguments.
    """

    where: str
    op: str
    weight_side: int
    act_spec: qcore.HowToQuantize | None
    call: qflax.OpCall
    args: tuple
    kwargs: dict
    treedef: Any


class CaptureProvider(qflax.PtqProvider):
    """PtqProvider whose weight-quantized products are named calls (see the module)."""

    def __init__(self, rules: Any) -> None:
        super().__init__(rules)
        self.sites: dict[str, SiteRecord] = {}

    def visit_op(self, ctx: qflax.CallContext, site: qflax.OpSite) -> jax.Array:
        """Runs the op as PtqProvider does, inside a named call where it can be captured."""
        plans = site.plans
        weights = [i for i, p in enumerate(plans) if _is_weight(p)]
        if len(weights) != 1 or site.op not in ("dot_general", "conv_general_dilated"):
            return super().visit_op(ctx, site)
        w = weights[0]
        act = plans[1 - w]
        if site.call.batch != ((), ()) or (act is not None and act.spec is None):
            return super().visit_op(ctx, site)  # batch axes, static ranges: op by op
        if site.op == "conv_general_dilated" and act is not None:
            return super().visit_op(ctx, site)  # w8a8 convolutions: op by op
        spec = None if act is None else act.spec
        name = f"{PREFIX}{next(_COUNTER)}"
        run = site.call.run

        def captured(lhs: Any, rhs: Any) -> jax.Array:
            operands = [lhs, rhs]
            if spec is not None:
                operands[1 - w] = qcore.quantize(operands[1 - w], spec)
            return run(*operands)

        captured.__name__ = captured.__qualname__ = name

        def wrapped(lhs: Any, rhs: Any) -> jax.Array:
            treedef = jax.tree.structure((lhs, rhs))
            self.sites[name] = SiteRecord(
                site.where, site.op, w, spec, site.call, site.args, site.kwargs, treedef
            )
            return jax.jit(captured)(lhs, rhs)

        call = dataclasses.replace(site.call, run=wrapped)
        new_plans = tuple(p if i == w else None for i, p in enumerate(plans))
        return super().visit_op(ctx, dataclasses.replace(site, call=call, plans=new_plans))


def _is_weight(plan: Any) -> bool:
    """A qflax weight plan (it carries the param's ``source``)."""
    return plan is not None and hasattr(plan, "source")

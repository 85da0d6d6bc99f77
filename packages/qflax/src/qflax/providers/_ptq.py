"""Post-training quantization: :class:`PtqProvider` computes with stored QArrays.

Operands are classified by the engine (:mod:`qflax._engine.dispatch`): an
operand read from a model parameter is a *weight* and gets the rule's
``weight_qtype`` (one scale per output channel, optional tiles along the
contracted axes); any other operand is an *activation* and gets ``act_qtype``,
with a scale computed per call (dynamic range) or a stored one
(``act_static_scale``, per tensor). An operand with no qtype stays float.
Integer and bool params are never quantized: the catch-all rule
(``module_path=".*"``) leaves them alone, any other rule that selects one raises.

Weights quantized where their values are concrete (Linen ``init``, ``apply`` with
``mutable=["params"]`` outside ``jax.jit``) and eager static-range calibration
batches must be finite: a NaN or inf raises, naming the param or site. Under
tracing, qcore's policy applies (non-finite values give NaN scales, so NaN
outputs, never plausible numbers).

Activation quantization sites are named per module in call order: the static
scale of the left operand of the module's first ``einsum`` is ``einsum0_lhs``
(statistic) and ``einsum0_lhs_scale`` (stored scale).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

import qcore
from qflax import stats
from qflax._engine.context import CallContext
from qflax._engine.dispatch import Activation, LookupSite, OpSite, Plan, Weight
from qflax._engine.layout import shared_view, transposition
from qflax._engine.opcall import OpCall
from qflax.providers._base import (
    Provider,
    SiteVars,
    batch_scale,
    site_call,
    static_quantize,
    weight_recipe,
)
from qflax.qparam import (
    ActScale,
    QuantizedParam,
    ScaleRecipe,
    check_finite_weight,
    divide_along,
    quantize_param,
)


class PtqProvider(Provider):
    """Post-training quantization: compute with stored QArrays.

    Schemas, by rule: weight-only (``weight_qtype`` only), dynamic range (plus
    ``act_qtype``), static range (plus ``act_static_scale=True``: stored per-tensor
    activation scales made from ``quant_stats``), activation-only (``act_qtype``
    only).

    Args:
        rules: The :class:`~qflax.QuantizationRule` list, first match wins.
    """

    stores_quantized_weights = True

    def visit_op(self, ctx: CallContext, site: OpSite) -> jax.Array:
        """Computes the op with quantized operands (see the class docstring)."""
        plans = site.plans
        if plans == (None, None):
            return site.run_original()
        call, sites = site_call(site, keep_weights=True), SiteVars(ctx, site)
        operands: list[Any] = list(call.operands)
        for i, plan in enumerate(plans):
            if isinstance(plan, Weight):
                operands[i] = self.weight(ctx, plan, call.operands[i])
                operands[1 - i] = self.scaled_input(call, plans, i, operands[1 - i])
        for i, plan in enumerate(plans):
            if isinstance(plan, Activation) and plan.spec is not None:
                operands[i] = qcore.quantize(operands[i], plan.spec)
            elif isinstance(plan, Activation):
                scale = self._scale(ctx, sites, plan, operands[i])
                operands[i] = static_quantize(operands[i], plan.qtype, scale)
        return call.run(*operands)

    def visit_lookup(self, ctx: CallContext, site: LookupSite) -> jax.Array:
        """Looks up rows of the quantized table, dequantized to the table's dtype."""
        return site.call.take_quantized(self.weight(ctx, site.plan, site.call.table))

    def scaled_input(self, call: OpCall, plans: Sequence[Plan], i: int, x: Any) -> Any:
        """``x`` (operand ``1 - i``) divided by the input scale weight ``i`` carries, if any."""
        plan = plans[i]
        assert isinstance(plan, Weight)
        qp = plan.source.value
        if not isinstance(qp, QuantizedParam) or qp.input_scale is None:
            return x
        axis = qp.recipe.input_scale_axis
        if call.contracting[i] != (axis,) or isinstance(plans[1 - i], Weight):
            raise ValueError(
                f"param {plan.source.path!r} carries a per-input-channel scale for its "
                f"compute-layout axis {axis} (AWQ/SmoothQuant), but {call.name} contracts its "
                f"axes {call.contracting[i]} with "
                f"{'another param' if isinstance(plans[1 - i], Weight) else 'an input'}; "
                "allowed: an op contracting exactly that axis with an activation"
            )
        return divide_along(x, qp.input_scale, call.contracting[1 - i][0])

    def weight(self, ctx: CallContext, plan: Weight, x: jax.Array) -> qcore.QArray:
        """The weight's QArray: stored, viewed transposed, or quantized now from float.

        Raises:
            ValueError: For a float weight where quantized params are due, or a
                stored one quantized differently from what this op needs.
        """
        source = plan.source
        if isinstance(source.value, QuantizedParam):
            qp = source.value
            want = (plan.spec, source.transforms, tuple(x.shape))
            have = (qp.recipe.spec, qp.recipe.transforms, qp.recipe.compute_shape())
            perm = transposition(qp.recipe, plan.spec, source.transforms, tuple(x.shape))
            if want != have and perm is not None and qp.recipe.rotation == plan.rotation:
                # The same quantized table in another axis order (a tied embedding's
                # lookup and its output projection): stored once, viewed transposed.
                return qp.qarray.transpose(*perm)
            if want != have:
                raise ValueError(
                    f"param {source.path!r} was quantized as {have[0]} in layout {have[1:]}, "
                    f"but this op needs {want[0]} in layout {want[1:]}; re-quantize it from "
                    "float with these rules"
                )
            if qp.recipe.rotation != plan.rotation:
                raise ValueError(
                    f"param {source.path!r} was quantized with rotation={qp.recipe.rotation}, "
                    f"but this op's rule needs rotation={plan.rotation}; re-quantize it from "
                    "float with these rules"
                )
            return qp.qarray
        recipe = weight_recipe(plan, x)
        if not ctx.may_quantize_params:
            raise ValueError(
                f"param {source.path!r} is float (shape {tuple(source.value.shape)}, dtype "
                f"{source.value.dtype}) but the rules quantize it to "
                f"{plan.spec.resolved_qtype.name}: pass quantized params "
                "(qflax.quantize_params(float_params, abstract_quantized_params)), or call "
                "apply with mutable=['params'] to quantize them in the model"
            )
        seen = ctx.written.get(source.path)
        # A second op on the same float value this call already quantized (under
        # nn.scan every trace reads a new value, so nothing crosses traces).
        written = seen[1] if seen is not None and seen[0] is source.value else None
        if written is not None:
            return written.qarray.transpose(*shared_view(written.recipe, recipe, source.path))
        if not ctx.discovering:  # NNX conversion checks them itself
            check_finite_weight(source.value, source.path)  # raises only for concrete values
        with ctx.in_read_trace(source):
            qp = quantize_param(source.value, recipe)
        if ctx.discovering:
            known = ctx.record_recipe(source.path, recipe)
            if known != recipe:
                shared_view(known, recipe, source.path)
        else:
            ctx.write_param(source, qp)
        ctx.written[source.path] = (source.value, qp)
        return qp.qarray

    def _scale(
        self, ctx: CallContext, sites: SiteVars, plan: Activation, x: jax.Array
    ) -> jax.Array:
        assert plan.site is not None
        name = f"{plan.site}_scale"
        stored = sites.get("params", name)
        if isinstance(stored, ActScale):
            return stored.scale
        where = f"{sites.path}/{name}" if sites.path else name
        if not ctx.may_quantize_params:
            raise ValueError(
                f"static activation scale {where!r} is missing from the params: make it with "
                "qflax.quantize_params(params, abstract_quantized_params, quant_stats), or call "
                "apply with the quant_stats collection and mutable=['params']"
            )
        stat = sites.get("quant_stats", plan.site)
        if stat is not None and not ctx.discovering:
            stats.check_seen(stat, f"{sites.path}/{plan.site}")
            scale = stats.scale(stat, plan.qtype)
        else:  # init: calibrate on the batch at hand
            stats.check_batch(x, f"{sites.path}/{plan.site}")
            scale = batch_scale(x, plan)
        sites.put("params", name, ActScale(scale, ScaleRecipe(plan.qtype, plan.site)))
        return scale

"""Quantization-aware training: :class:`QtProvider` trains through quantization.

The forward pass is the PTQ forward (bit-identical on the same parameters and
scales), the backward pass is straight-through, optionally quantized (qcore's
training ops), and static ranges are learnt as statistics (:mod:`qflax.stats`) in
``quant_stats``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

import qcore
from qflax import stats
from qflax._engine.context import CallContext
from qflax._engine.dispatch import Activation, LookupSite, OpSite, Weight
from qflax._engine.opcall import OpCall
from qflax.providers._base import (
    Provider,
    SiteVars,
    batch_scale,
    site_call,
    static_quantize,
    weight_recipe,
)
from qflax.qparam import QuantizedParam
from qflax.rule import QuantizationRule

_FLOAT_BACKWARD = qcore.BackwardQuant()


class QtProvider(Provider):
    """Quantization-aware training: the PTQ forward with straight-through gradients.

    Weights are fake-quantized from their float values every step, so they keep
    training in float. Dynamic-range activations are quantized per call. Static
    ones use the scale of their statistic in ``quant_stats`` (the current batch's
    range while a statistic has count 0); statistics are created with count 0 at
    init and updated when the ``quant_stats`` collection is mutable (Linen) or
    ``model.qflax_update_stats`` is True (NNX).

    Args:
        rules: The :class:`~qflax.QuantizationRule` list, first match wins.
        dlhs: Quantization of the contraction giving the lhs gradient (qcore
            :class:`~qcore.BackwardQuant`); default float.
        drhs: Same, for the rhs gradient.
        clip_gradient: Zero gradients of values outside the calibrated range.
        momentum: Weight of the old value in the statistics' moving average.
        rng_collection: Linen RNG stream for stochastic rounding.
    """

    learns_statistics = True

    def __init__(
        self,
        rules: Sequence[QuantizationRule],
        *,
        dlhs: qcore.BackwardQuant = _FLOAT_BACKWARD,
        drhs: qcore.BackwardQuant = _FLOAT_BACKWARD,
        clip_gradient: bool = False,
        momentum: float = 0.99,
        rng_collection: str = "quant",
    ) -> None:
        super().__init__(rules)
        if isinstance(momentum, bool) or not (
            isinstance(momentum, numbers.Real) and 0.0 <= momentum < 1.0
        ):
            raise ValueError(f"momentum={momentum!r} is not allowed; allowed: a number in [0, 1)")
        self.dlhs, self.drhs, self.clip_gradient = dlhs, drhs, clip_gradient
        self.momentum, self.rng_collection = momentum, rng_collection

    def visit_op(self, ctx: CallContext, site: OpSite) -> jax.Array:
        """Computes the op with qcore's training ops (see the class docstring)."""
        plans = site.plans
        if plans == (None, None):
            return site.run_original()
        call, sites = site_call(site, keep_weights=False), SiteVars(ctx, site)
        specs: list[qcore.HowToQuantize | None] = [None, None]
        scales: list[tuple[str, jax.Array] | None] = [None, None]
        for i, (x, plan) in enumerate(zip(call.operands, plans, strict=True)):
            if isinstance(plan, Weight):
                _float_weight(ctx, plan, x)
                specs[i] = plan.spec
            elif isinstance(plan, Activation) and plan.spec is not None:
                specs[i] = plan.spec
            elif isinstance(plan, Activation):
                scales[i] = (plan.qtype, self._scale(ctx, sites, plan, x))
        config = qcore.TrainingQuant(
            lhs=specs[0],
            rhs=specs[1],
            dlhs=self.dlhs,
            drhs=self.drhs,
            clip_gradient=self.clip_gradient,
        )
        key = self._key(ctx, site.module, config)
        if scales == [None, None]:
            return call.train(*call.operands, config, key)
        if config.dlhs != _FLOAT_BACKWARD or config.drhs != _FLOAT_BACKWARD or key is not None:
            raise ValueError(
                f"{site.path}: quantized backward passes and stochastic rounding are not "
                "available with act_static_scale rules"
            )
        return _static_forward(call, specs, scales)

    def visit_lookup(self, ctx: CallContext, site: LookupSite) -> jax.Array:
        """The PTQ lookup's values forward, straight through to the rows backward."""
        table = site.call.table
        _float_weight(ctx, site.plan, table)
        return site.call.take(
            qcore.fake_quant(table, site.plan.spec, clip_gradient=self.clip_gradient)
        )

    def _key(self, ctx: CallContext, module: Any, config: qcore.TrainingQuant) -> jax.Array | None:
        if not any(s.rounding == "stochastic" for s in config.specs()):
            return None
        return ctx.flavor.make_rng(module, self.rng_collection)

    def _scale(
        self, ctx: CallContext, sites: SiteVars, plan: Activation, x: jax.Array
    ) -> jax.Array:
        assert plan.site is not None
        batch = batch_scale(x, plan)
        if ctx.creates_variables:
            sites.put("quant_stats", plan.site, stats.empty())
            return batch
        stat = sites.get("quant_stats", plan.site)
        mutable = sites.mutable("quant_stats")
        if stat is None and not mutable:
            raise ValueError(
                f"statistic {sites.path}/{plan.site!r} of a static-range rule is missing: pass "
                "the quant_stats collection that init created along with the params"
            )
        if mutable:
            stats.check_batch(x, f"{sites.path}/{plan.site}")
            stat = stats.update(stat or stats.empty(), x, plan.calibration, momentum=self.momentum)
            sites.put("quant_stats", plan.site, stat)
        assert stat is not None
        return jnp.where(stat["count"] > 0, stats.scale(stat, plan.qtype), batch)


def _float_weight(ctx: CallContext, plan: Weight, x: jax.Array) -> None:
    """Checks that a QAT weight is float and records its recipe when discovering."""
    if isinstance(plan.source.value, QuantizedParam):
        raise ValueError(
            f"param {plan.source.path!r} is already quantized; QtProvider trains float "
            "params (quantize them with PtqProvider after training)"
        )
    if ctx.discovering:
        ctx.record_recipe(plan.source.path, weight_recipe(plan, x))


def _static_forward(
    call: OpCall,
    specs: list[qcore.HowToQuantize | None],
    scales: list[tuple[str, jax.Array] | None],
) -> jax.Array:
    """The PTQ forward with static scales, with a straight-through float backward."""
    qtypes = ["" if s is None else s[0] for s in scales]

    def quantized(i: int, x: jax.Array, scale: jax.Array | None) -> Any:
        if scale is not None:
            return static_quantize(x, qtypes[i], scale)
        spec = specs[i]
        return x if spec is None else qcore.quantize(x, spec)

    @jax.custom_vjp
    def op(a, b, s):
        return call.run(quantized(0, a, s[0]), quantized(1, b, s[1]))

    def fwd(a, b, s):
        return op(a, b, s), (a, b, s)

    def bwd(res, g):
        a, b, s = res
        y, vjp = jax.vjp(call.forward_float, a, b)
        da, db = vjp(g.astype(y.dtype))
        return da, db, jax.tree.map(jnp.zeros_like, s)

    op.defvjp(fwd, bwd)
    s = tuple(None if x is None else x[1] for x in scales)
    return op(*call.operands, s)

"""Providers: what happens to an intercepted op that a rule selects.

Both providers classify the op's two operands the same way: an operand that was
read from a model parameter (see :mod:`qflax.context`) is a *weight* and gets the
rule's ``weight_qtype`` (one scale per output channel, optional tiles along the
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

* :class:`PtqProvider` computes with stored QArrays: weights quantized ahead of
  time (``init``, :func:`qflax.quantize_params`, or NNX ``quantize_model``),
  activations quantized per call or with stored :class:`~qflax.qparam.ActScale`.
* :class:`QtProvider` trains through quantization: the forward pass is the
  PTQ forward (bit-identical on the same parameters and scales), the backward
  pass is straight-through, optionally quantized (qcore's training ops), and
  static ranges are learnt as statistics (:mod:`qflax.stats`) in ``quant_stats``.

Activation quantization sites are named per module in call order: the static
scale of the left operand of the module's first ``einsum`` is ``einsum0_lhs``
(statistic) and ``einsum0_lhs_scale`` (stored scale).
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

import qcore
from qflax import stats
from qflax.context import CallContext, Mode, Source
from qflax.opcall import OpCall, bind
from qflax.qparam import (
    ActScale,
    QuantizedParam,
    Recipe,
    ScaleRecipe,
    check_finite_weight,
    divide_along,
    quantize_param,
)
from qflax.rotation import Hadamard, rotate
from qflax.rule import QuantizationRule, RuleMatcher

SIDES = ("lhs", "rhs")
Tiles = tuple[tuple[int, int | float], ...]  # HowToQuantize.tiled_axes, normalised
_FLOAT_BACKWARD = qcore.BackwardQuant()


@dataclasses.dataclass(frozen=True)
class Weight:
    """Plan for a weight operand."""

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


class Provider:
    """Shared machinery: rule matching, operand classification, unused-rule report."""

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
        """The op handler for one call (see :func:`qflax.interception.intercept`)."""

        def handle(name: str, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
            if name == "take" and ctx.source(args[0] if args else kwargs.get("a")) is None:
                return original(*args, **kwargs)  # not a lookup in a param (most indexing)
            found = ctx.calling_module()
            if found is None:
                return original(*args, **kwargs)
            module, path = found
            site = ctx.site(module, name)  # every op counts, so names do not depend on rules
            rule = self._matcher.match(path, name)
            if rule is None or (rule.weight_qtype is None and rule.act_qtype is None):
                return original(*args, **kwargs)
            if name == "take":
                return self._take(ctx, rule, original, args, kwargs, path)
            call = bind(name, original, args, kwargs)
            if call is None:
                return original(*args, **kwargs)
            plans = [self._plan(ctx, call, rule, i, site) for i in range(2)]
            if all(p is None for p in plans):
                return original(*args, **kwargs)
            if rule.rotation is not None:
                call = self._rotated(call, plans, rule.rotation_seed)
            return self.compute(ctx, call, plans, module, path)

        return handle

    def _take(
        self,
        ctx: CallContext,
        rule: QuantizationRule,
        original: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        path: str,
    ) -> jax.Array:
        """A lookup in a parameter (``jnp.take``, ``table[ids]``) by module ``path``."""
        a = bind_take(original, args, kwargs)
        source = None if a is None else ctx.source(a["a"])
        if a is None or rule.weight_qtype is None or source is None or _skips(rule, source):
            return original(*args, **kwargs)
        table = a["a"]
        if rule.rotation is not None:
            raise ValueError(
                f"table {source.path!r}: rotation={rule.rotation!r} does not apply to a "
                "lookup (jnp.take); give the lookup a rule without rotation"
            )
        spec = checked_spec(lambda: rule.lookup_spec(table.ndim, a["axis"]), table, source.path)
        return self.lookup(ctx, Weight(spec, source), table, a, path)

    def lookup(
        self, ctx: CallContext, plan: Weight, table: jax.Array, a: dict, path: str
    ) -> jax.Array:
        """Computes module ``path``'s table lookup under the plan (each provider's own)."""
        raise NotImplementedError

    # A provider that stores weights rotated (PtqProvider) does not rotate them per call.
    stores_rotated_weights = False

    def _rotated(self, call: OpCall, plans: list[Weight | Activation | None], seed: int) -> OpCall:
        """``call`` with the contracting axis of its operands rotated (see qflax.rotation)."""
        new = list(call.operands)
        for i, (x, plan) in enumerate(zip(call.operands, plans, strict=True)):
            if not (self.stores_rotated_weights and isinstance(plan, Weight)):
                new[i] = rotate(x, call.contracting[i][0], seed)
        return dataclasses.replace(call, operands=(new[0], new[1]))

    def _plan(
        self, ctx: CallContext, call: OpCall, rule: QuantizationRule, i: int, site: str
    ) -> Weight | Activation | None:
        x = call.operands[i]
        if rule.rotation is not None and (
            len(call.contracting[0]) != 1
            or call.operands[0].shape[call.contracting[0][0]]
            != call.operands[1].shape[call.contracting[1][0]]
        ):
            where = ctx.calling_module()
            raise ValueError(
                f"module {where[1] if where else '?'!r}: rotation={rule.rotation!r} needs an op "
                f"that contracts exactly one axis of each operand, but {call.name} contracts "
                f"axes {call.contracting}; allowed: dot_general/einsum/dot/matmul with one "
                "contracting axis (exclude this op with a rule placed before this one)"
            )
        source = ctx.source(x)
        if source is not None:
            if rule.weight_qtype is None or _skips(rule, source):
                return None
            spec = checked_spec(
                lambda: rule.weight_spec(x.ndim, call.contracting[i]), x, source.path
            )
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
            where = ctx.calling_module()
            raise ValueError(
                f"rule module_path={rule.module_path!r} at module {where[1] if where else '?'!r}, "
                f"op {call.name} (operand {SIDES[i]} of shape {tuple(x.shape)}): {err}"
            ) from None
        return Activation(spec, None, qtype, rule.act_calibration_method)

    def compute(
        self,
        ctx: CallContext,
        call: OpCall,
        plans: list[Weight | Activation | None],
        module: Any,
        path: str,
    ) -> jax.Array:
        """Computes the op under the plans (implemented by each provider)."""
        raise NotImplementedError


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


def _skips(rule: QuantizationRule, source: Source) -> bool:
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


def bind_take(original: Callable[..., Any], args: tuple, kwargs: dict) -> dict | None:
    """A lookup's arguments as ``jnp.take``'s, by name, or None for calls left float.

    ``original`` is ``jnp.take`` or JAX's indexing (``table[ids]``,
    ``table.at[ids].get(mode=...)``). Left float: ``jnp.take`` with ``axis=None`` (a
    lookup in the flattened array) or an ``out`` argument; indexing by anything but
    one integer array (slices, several indices, boolean masks, Python ints); a 0-d
    table. Indexing becomes a ``jnp.take`` along axis 0 with its own out-of-range
    rule: negative ids count from the end, then ids out of range are clamped
    (``mode=None``, ``"clip"``, ``"promise_in_bounds"``) or give ``fill_value``
    (``"fill"``, ``"drop"``).
    """
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    if original.__name__ == "rewriting_take":
        a = _indexing_as_take(a)
        if a is None:
            return None
    elif a["axis"] is None or a["out"] is not None:
        return None
    table = a["a"]
    if not isinstance(table, jax.Array) or table.ndim == 0:
        return None
    return a


_CLAMPING = (None, "clip", "promise_in_bounds")
_FILLING = ("fill", "drop", "fill_or_drop")


def _indexing_as_take(a: dict) -> dict | None:
    """``rewriting_take``'s arguments (``arr[idx]``) as ``jnp.take``'s, or None."""
    idx = a["idx"]
    if isinstance(idx, tuple):
        if len(idx) != 1:
            return None
        idx = idx[0]
    mode = a["mode"]
    mode = getattr(mode, "name", mode)
    mode = mode.lower() if isinstance(mode, str) else mode
    integer = isinstance(idx, jax.Array | np.ndarray) and jnp.issubdtype(idx.dtype, jnp.integer)
    if not integer or mode not in _CLAMPING + _FILLING or a["out_sharding"] is not None:
        return None
    if mode in _CLAMPING:
        # Indexing wraps negative ids once, then clamps: jnp.take(mode="clip") clamps only.
        size = a["arr"].shape[0] if a["arr"].ndim else 0
        idx, mode = jnp.where(idx < 0, idx + size, idx), "clip"
    else:
        mode = "fill"  # "drop" is indexing's name for it; negative ids wrap in both
    return {
        "a": a["arr"],
        "indices": idx,
        "axis": 0,
        "mode": mode,
        "fill_value": a["fill_value"],
        "unique_indices": a["unique_indices"],
        "indices_are_sorted": a["indices_are_sorted"],
    }


def transposition(
    stored: Recipe, spec: qcore.HowToQuantize, chain: tuple, shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The axes permutation that views ``stored``'s QArray as ``spec`` in layout ``chain``.

    None if no transpose does. Both layouts must be pure transposes of the
    parameter (no reshapes), and the scales, tiles and packing of ``stored`` must
    land, permuted, on ``spec``'s.
    """
    ndim = len(shape)
    p_stored, p_wanted = _permutation(stored.transforms, ndim), _permutation(chain, ndim)
    if p_stored is None or p_wanted is None or len(stored.compute_shape()) != ndim:
        return None
    perm = tuple(p_stored.index(axis) for axis in p_wanted)
    if tuple(stored.compute_shape()[a] for a in perm) != tuple(shape):
        return None
    old = stored.spec
    moved = dataclasses.replace(
        old,
        channelwise_axes=tuple(sorted(perm.index(a % ndim) for a in old.channelwise_axes)),
        tiled_axes=tuple((perm.index(a % ndim), t) for a, t in cast(Tiles, old.tiled_axes)),
        pack_axis=perm.index(old.pack_axis % ndim),
    )
    wanted = dataclasses.replace(
        spec,
        channelwise_axes=tuple(sorted(a % ndim for a in spec.channelwise_axes)),
        pack_axis=spec.pack_axis % ndim,
    )
    return perm if moved == wanted else None


def _shared_view(known: Recipe, recipe: Recipe, path: str) -> tuple[int, ...]:
    """How an op quantizing param ``path`` as ``recipe`` views it quantized as ``known``.

    Two ops may share one quantized param when one's layout is a transpose of the
    other's with the scales, tiles and packing moving along (a tied embedding's
    lookup and ``attend``); returns that axis order, or raises.
    """
    perm = transposition(known, recipe.spec, recipe.transforms, recipe.compute_shape())
    if perm is None or known.rotation != recipe.rotation:
        raise ValueError(
            f"param {path!r} is used by two ops that quantize it differently "
            f"({known.spec} in layout {known.transforms} vs {recipe.spec} in layout "
            f"{recipe.transforms}); give them rules that agree"
        )
    return perm


def _permutation(chain: tuple, ndim: int) -> tuple[int, ...] | None:
    """The axis permutation a chain of transposes applies, or None if it reshapes."""
    perm = tuple(range(ndim))
    for kind, arg in chain:
        if kind != "transpose":
            return None
        perm = tuple(perm[i] for i in arg)
    return perm


def _weight_recipe(plan: Weight, x: jax.Array) -> Recipe:
    value = plan.source.value
    return Recipe(
        spec=plan.spec,
        transforms=plan.source.chain,
        shape=tuple(value.shape),
        dtype=jnp.dtype(value.dtype),
        compute_dtype=jnp.dtype(x.dtype),
        rotation=plan.rotation,
    )


def _batch_scale(x: jax.Array, plan: Activation) -> jax.Array:
    lo, hi = stats.observe(x, plan.calibration)
    return stats.scale({"lo": lo, "hi": hi}, plan.qtype)


def _static_quantize(x: jax.Array, qtype: str, scale: jax.Array) -> qcore.QArray:
    return qcore.quantize_with_scale_zero_point(
        x, qtype, scale.astype(jnp.float32).reshape((1,) * x.ndim)
    )


class _Sites:
    """Reads and writes the per-module variables of activation sites (Linen or NNX)."""

    def __init__(self, ctx: CallContext, module: Any, path: str) -> None:
        self.ctx, self.module, self.path = ctx, module, path

    def get(self, collection: str, name: str) -> Any:
        if self.ctx.flavor == "linen":
            scope = self.module.scope
            if not scope.has_variable(collection, name):
                return None
            raw = scope.get_variable(collection, name)
            return raw.unbox() if hasattr(raw, "unbox") else raw
        var = getattr(self.module, name, None)
        return None if var is None else var.get_raw_value()

    def mutable(self, collection: str) -> bool:
        if self.ctx.flavor == "linen":
            return self.module.scope.is_mutable_collection(collection)
        return collection == "quant_stats" and self.ctx.update_stats

    def put(self, collection: str, name: str, value: Any) -> None:
        if self.ctx.flavor == "linen":
            self.module.scope.put_variable(collection, name, value)
        elif self.ctx.mode is Mode.DISCOVER:
            self.ctx.sites.setdefault(self.path, {})[name] = (collection, value)
        else:
            getattr(self.module, name).set_raw_value(value)


class PtqProvider(Provider):
    """Post-training quantization: compute with stored QArrays.

    Schemas, by rule: weight-only (``weight_qtype`` only), dynamic range (plus
    ``act_qtype``), static range (plus ``act_static_scale=True``: stored per-tensor
    activation scales made from ``quant_stats``), activation-only (``act_qtype``
    only).

    Args:
        rules: The :class:`~qflax.QuantizationRule` list, first match wins.
    """

    stores_rotated_weights = True

    def compute(self, ctx, call, plans, module, path):  # noqa: D102 - see Provider
        sites = _Sites(ctx, module, path)
        operands: list[Any] = list(call.operands)
        for i, plan in enumerate(plans):
            if isinstance(plan, Weight):
                operands[i] = self._weight(ctx, plan, call.operands[i])
                operands[1 - i] = self._scaled_input(call, plans, i, operands[1 - i])
        for i, plan in enumerate(plans):
            if isinstance(plan, Activation) and plan.spec is not None:
                operands[i] = qcore.quantize(operands[i], plan.spec)
            elif isinstance(plan, Activation):
                scale = self._scale(ctx, sites, plan, operands[i])
                operands[i] = _static_quantize(operands[i], plan.qtype, scale)
        return call.run(*operands)

    def lookup(self, ctx, plan, table, a, path):  # noqa: D102 - see Provider
        del path
        q = self._weight(ctx, plan, table)
        return qcore.take(
            q,
            a["indices"],
            a["axis"],
            mode=a["mode"],
            fill_value=a["fill_value"],
            dtype=table.dtype,
        )

    def _scaled_input(
        self, call: OpCall, plans: Sequence[Weight | Activation | None], i: int, x: Any
    ) -> Any:
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

    def _weight(self, ctx: CallContext, plan: Weight, x: jax.Array) -> qcore.QArray:
        source = plan.source
        if isinstance(source.value, QuantizedParam):
            qp = source.value
            want = (plan.spec, source.chain, tuple(x.shape))
            have = (qp.recipe.spec, qp.recipe.transforms, qp.recipe.compute_shape())
            perm = transposition(qp.recipe, plan.spec, source.chain, tuple(x.shape))
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
        recipe = _weight_recipe(plan, x)
        if ctx.mode is Mode.APPLY:
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
            return written.qarray.transpose(*_shared_view(written.recipe, recipe, source.path))
        if ctx.mode is not Mode.DISCOVER:  # NNX conversion checks them itself
            check_finite_weight(source.value, source.path)  # raises only for concrete values
        qp = quantize_param(source.value, recipe)
        if ctx.mode is Mode.DISCOVER:
            known = ctx.recipes.setdefault(source.path, recipe)
            if known != recipe:
                _shared_view(known, recipe, source.path)
        else:
            ctx.write_param(source, qp)
        ctx.written[source.path] = (source.value, qp)
        return qp.qarray

    def _scale(self, ctx: CallContext, sites: _Sites, plan: Activation, x: jax.Array) -> jax.Array:
        assert plan.site is not None
        name = f"{plan.site}_scale"
        stored = sites.get("params", name)
        if isinstance(stored, ActScale):
            return stored.scale
        where = f"{sites.path}/{name}" if sites.path else name
        if ctx.mode is Mode.APPLY:
            raise ValueError(
                f"static activation scale {where!r} is missing from the params: make it with "
                "qflax.quantize_params(params, abstract_quantized_params, quant_stats), or call "
                "apply with the quant_stats collection and mutable=['params']"
            )
        stat = sites.get("quant_stats", plan.site)
        if stat is not None and ctx.mode is not Mode.DISCOVER:
            stats.check_seen(stat, f"{sites.path}/{plan.site}")
            scale = stats.scale(stat, plan.qtype)
        else:  # init: calibrate on the batch at hand
            stats.check_batch(x, f"{sites.path}/{plan.site}")
            scale = _batch_scale(x, plan)
        sites.put("params", name, ActScale(scale, ScaleRecipe(plan.qtype, plan.site)))
        return scale


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

    def compute(self, ctx, call, plans, module, path):  # noqa: D102 - see Provider
        sites = _Sites(ctx, module, path)
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
        key = self._key(ctx, module, config)
        if scales == [None, None]:
            return call.train(*call.operands, config, key)
        if config.dlhs != _FLOAT_BACKWARD or config.drhs != _FLOAT_BACKWARD or key is not None:
            raise ValueError(
                f"{path}: quantized backward passes and stochastic rounding are not "
                "available with act_static_scale rules"
            )
        return _static_forward(call, specs, scales)

    def lookup(self, ctx, plan, table, a, path):  # noqa: D102 - see Provider
        del path
        _float_weight(ctx, plan, table)
        # Forward: the PTQ lookup's values; backward: straight through to the rows.
        fq = qcore.fake_quant(table, plan.spec, clip_gradient=self.clip_gradient)
        return jnp.take(
            fq,
            a["indices"],
            a["axis"],
            mode=a["mode"],
            unique_indices=a["unique_indices"],
            indices_are_sorted=a["indices_are_sorted"],
            fill_value=a["fill_value"],
        )

    def _key(self, ctx: CallContext, module: Any, config: qcore.TrainingQuant) -> jax.Array | None:
        if not any(s.rounding == "stochastic" for s in config.specs()):
            return None
        if ctx.flavor != "linen":
            raise ValueError(
                "stochastic rounding in QtProvider needs a Linen model (rngs="
                f"{{{self.rng_collection!r}: key}}); NNX models are not supported yet"
            )
        return module.make_rng(self.rng_collection)

    def _scale(self, ctx: CallContext, sites: _Sites, plan: Activation, x: jax.Array) -> jax.Array:
        assert plan.site is not None
        batch = _batch_scale(x, plan)
        if ctx.mode in (Mode.INIT, Mode.DISCOVER):
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
    if ctx.mode is Mode.DISCOVER:
        ctx.recipes.setdefault(plan.source.path, _weight_recipe(plan, x))


def _static_forward(
    call: OpCall,
    specs: list[qcore.HowToQuantize | None],
    scales: list[tuple[str, jax.Array] | None],
) -> jax.Array:
    """The PTQ forward with static scales, with a straight-through float backward."""
    qtypes = ["" if s is None else s[0] for s in scales]

    def quantized(i: int, x: jax.Array, scale: jax.Array | None) -> Any:
        if scale is not None:
            return _static_quantize(x, qtypes[i], scale)
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

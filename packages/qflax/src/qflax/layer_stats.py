"""Layer statistics: input statistics of the weights the rules quantize.

Calibration-based PTQ algorithms (:func:`qflax.gptq.gptq`, AWQ, SmoothQuant) need,
for each quantized weight, statistics of the activations it is multiplied with.
:func:`collect` runs the *float* model on calibration batches through the same
interception and :class:`~qflax.context.CallContext` machinery as the providers,
and accumulates per weight param path (a :class:`LayerStats`):

* ``hessian``: ``sum x^T x`` over every row ``x`` of the activation, with the
  contracting axis last (float32, ``(K, K)``); GPTQ's Hessian is ``hessian /
  count``.
* ``abs_sum`` and ``abs_max``: per input channel, the sum and the max of ``|x|``
  (``abs_sum / count`` is the mean ``|x|`` that AWQ and SmoothQuant use).
* ``count``: the number of rows seen.

Each weight also records its :class:`~qflax.qparam.Recipe`, exactly the one that
:class:`~qflax.PtqProvider` would create for the same rules, so an algorithm can
produce :class:`~qflax.QuantizedParam` objects that the plain PTQ model loads.

Each batch runs through one ``jax.jit``-compiled step that returns the updated
statistics (traced again only for a new batch shape, and once after the first
batch, whose statistics start empty); nothing is written into the model or its
params.

Supported ops: those whose weight operand is a model parameter contracted over
exactly one axis with no batch axes (``nn.Dense``, ``nn.DenseGeneral`` with one
input axis, ``nn.Einsum`` like ``"btd,dnh->btnh"``, ``x @ w``). Ops the rules
select whose operands are both activations (e.g. attention's ``q @ k``) have no
weight to calibrate and are skipped, as :class:`~qflax.PtqProvider` leaves their
weights alone; convolutions and ``ragged_dot`` raise.

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> import qflax
    >>> from qflax.layer_stats import collect
    >>> model = nn.Dense(3)
    >>> params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    >>> data = qflax.CalibrationData(model, params, [jnp.ones((2, 4)), 2 * jnp.ones((5, 4))])
    >>> rules = [qflax.QuantizationRule(weight_qtype="int8")]
    >>> stats = collect(data, rules, progress=False)
    >>> s = stats["kernel"]
    >>> int(s.count), s.hessian.shape, float(s.hessian[0, 0])  # 2 * 1 + 5 * 4
    (7, (4, 4), 22.0)
    >>> s.recipe.spec.channelwise_axes
    (1,)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from qflax._calibration_data import CalibrationData, accepts_legacy, check
from qflax._engine import dispatch, interception, registry
from qflax._engine import flavor as flavors
from qflax._engine.context import CallContext, Mode
from qflax._engine.dispatch import LookupSite, OpSite, Weight
from qflax._engine.opcall import OpCall
from qflax._progress import track
from qflax.providers._base import weight_recipe
from qflax.qparam import QuantizedParam, Recipe
from qflax.rule import QuantizationRule, RuleMatcher

# The built-in ops calibration collects statistics for (the registry's capability).
SUPPORTED_OPS = registry.names(calibration=True)


@dataclasses.dataclass(frozen=True)
class WeightUse:
    """Where a quantized weight is used (static, found while tracing).

    Attributes:
        path: The weight param's ``/``-joined path.
        recipe: The recipe :class:`~qflax.PtqProvider` gives it.
        axis: Its contracting axis in the compute layout (the recipe's layout).
        ops: ``module path: op name`` of every op that uses it.
        rule: The rule its first op matched (None in statistics made without one).
    """

    path: str
    recipe: Recipe
    axis: int
    ops: tuple[str, ...]
    rule: QuantizationRule | None = None


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """Accumulated input statistics of one quantized weight (see the module doc).

    Attributes:
        site: Where the weight is used (:class:`WeightUse`).
        count: Rows (input vectors) seen.
        hessian: ``sum x^T x``, ``(K, K)`` float32, or None if not collected.
        abs_sum: ``sum |x|`` per input channel, ``(K,)``.
        abs_max: ``max |x|`` per input channel, ``(K,)``.
    """

    site: WeightUse
    count: jax.Array
    hessian: jax.Array | None
    abs_sum: jax.Array
    abs_max: jax.Array

    @property
    def recipe(self) -> Recipe:
        """The weight's PTQ recipe."""
        return self.site.recipe

    def mean_hessian(self) -> jax.Array:
        """``hessian / count`` (raises if the Hessian was not collected)."""
        if self.hessian is None:
            raise ValueError(f"{self.site.path!r}: the Hessian was not collected")
        return self.hessian / jnp.maximum(self.count, 1).astype(jnp.float32)

    def abs_mean(self) -> jax.Array:
        """Mean ``|x|`` per input channel."""
        return self.abs_sum / jnp.maximum(self.count, 1).astype(jnp.float32)


@accepts_legacy(batches="batches")
def collect(
    data: CalibrationData,
    rules: Sequence[QuantizationRule],
    *,
    hessian: bool = True,
    jit: bool = True,
    progress: bool = True,
) -> dict[str, LayerStats]:
    """Runs the float model on calibration batches and accumulates input statistics.

    Args:
        data: The model, its float params and the batches
            (:class:`~qflax.CalibrationData`). An NNX model is left unchanged,
            except that its modules are labelled with their paths, as
            :func:`~qflax.quantize_model` does.
        rules: The rules that the PTQ model will use; their weight-quantized ops
            are the ones observed (rules without ``weight_qtype`` are ignored).
        hessian: Also accumulate ``sum x^T x`` (GPTQ); off for AWQ/SmoothQuant.
        jit: Compile each batch's step with ``jax.jit``.
        progress: Show progress over batches (tqdm if installed, else stderr).

    Returns:
        ``{weight param path: LayerStats}`` in the order the ops were called.

    Raises:
        ValueError: No batches; a batch that gives a weight's input NaN or inf
            (naming the batch, the weight and its ops); rules that select no
            weight; a rule selecting an op that is not a matmul (conv, ragged_dot);
            a weight with batch axes or more than one contracting axis; a weight
            that two ops use in different layouts or specs; already-quantized params.
    """
    data = check(data)
    matcher = RuleMatcher(rules)
    flavor = flavors.of(data.model)
    _check_float_params(data.float_tree())
    variables, call = flavor.caller(data.model, data.params, data.method, data.kwargs)

    sites: dict[str, WeightUse] = {}

    def step(variables: Any, acc: dict[str, dict[str, jax.Array]], args: tuple) -> dict:
        ctx = CallContext(flavor, Mode.APPLY)
        found: dict[str, dict[str, jax.Array]] = {}
        handler = dispatch.handler(ctx, matcher, _Collector(sites, found, hessian))
        with interception.intercept(handler, values=ctx):
            call(variables, args)
        return _add(acc, found)

    run = jax.jit(step) if jit else step
    acc: dict[str, dict[str, jax.Array]] = {}
    n = 0
    for args in track(data.inputs(), "calibration batches", progress, data.num_batches):
        acc = run(variables, acc, args)
        _check_finite(acc, sites, n)
        n += 1
    if n == 0:
        raise ValueError(
            f"no calibration data: {data._arg} is empty (pass at least one batch: an input "
            "array, or a tuple of positional inputs)"
        )
    if not acc:
        raise ValueError(
            "the rules select no weight: no op with a model parameter operand matched a rule "
            "with weight_qtype (check the module paths, e.g. 'layers/0/mlp/Dense_0')"
        )
    return {
        path: LayerStats(
            site=sites[path],
            count=s["count"],
            hessian=s.get("hessian"),
            abs_sum=s["abs_sum"],
            abs_max=s["abs_max"],
        )
        for path, s in acc.items()
    }


def _check_finite(
    acc: dict[str, dict[str, jax.Array]], sites: dict[str, WeightUse], batch: int
) -> None:
    """Raises at the first batch that gives some weight's input a NaN or inf."""
    counts = jax.device_get({path: s["nonfinite"] for path, s in acc.items()})
    for path, count in counts.items():
        if count:
            raise ValueError(
                f"calibration batch {batch} gives the input of weight {path!r} "
                f"({', '.join(sites[path].ops)}) {int(count)} non-finite values (NaN or inf); "
                "its statistics would be NaN. Allowed: finite calibration data (drop or clean "
                "the batch)"
            )


def _check_float_params(params: Any) -> None:
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedParam))
    if any(isinstance(x, QuantizedParam) for x in leaves):
        raise ValueError("params are already quantized; calibration needs the float params")


def _add(acc: dict, found: dict) -> dict:
    out = dict(acc)
    for path, s in found.items():
        old = out.get(path)
        if old is None:
            out[path] = s
            continue
        merged = {k: v + s[k] for k, v in old.items() if k != "abs_max"}
        merged["abs_max"] = jnp.maximum(old["abs_max"], s["abs_max"])
        out[path] = merged
    return out


class _Collector:
    """A visitor that runs ops float and adds their weights' input statistics to ``found``."""

    def __init__(self, sites: dict[str, WeightUse], found: dict, hessian: bool) -> None:
        self.sites, self.found, self.hessian = sites, found, hessian

    def visit_lookup(self, ctx: CallContext, site: LookupSite) -> jax.Array:
        self._check_op(site)
        return site.run_original()

    def visit_op(self, ctx: CallContext, site: OpSite) -> jax.Array:
        out = site.run_original()
        if site.rule.weight_qtype is None:
            return out
        self._check_op(site)
        call, path, name = site.call, site.path, site.op
        sources = site.sources
        if all(s is None for s in sources):
            return out  # no weight operand (e.g. attention's q @ k): nothing to calibrate
        if all(s is not None for s in sources):
            raise ValueError(
                f"module {path!r}: both operands of {name} are model parameters "
                f"({sources[0].path!r}, {sources[1].path!r}); calibration needs an activation"  # type: ignore[union-attr]
            )
        i = 0 if sources[0] is not None else 1
        plan = site.plans[i]
        if not isinstance(plan, Weight):
            return out  # an integer param the catch-all rule skips
        source = plan.source
        weight, act = call.operands[i], call.operands[1 - i]
        axis = _contracting_axis(call, i, f"module {path!r}: {name} weight {source.path!r}")
        # The statistics are of the unrotated weight's input: GPTQ/AWQ/SmoothQuant
        # quantize weights as stored.
        recipe = weight_recipe(dataclasses.replace(plan, rotation=None), weight)
        op = f"{path}: {name}"
        known = self.sites.get(source.path)
        if known is None:
            self.sites[source.path] = WeightUse(source.path, recipe, axis, (op,), site.rule)
        elif (known.recipe, known.axis) != (recipe, axis):
            raise ValueError(
                f"param {source.path!r} is used by two ops in different layouts or specs "
                f"({known.ops[0]}: {known.recipe.spec}, layout {known.recipe.transforms}, "
                f"contracting axis {known.axis}; {op}: {recipe.spec}, layout "
                f"{recipe.transforms}, contracting axis {axis}); give them rules that agree"
            )
        elif op not in known.ops:
            self.sites[source.path] = dataclasses.replace(known, ops=(*known.ops, op))
        x = _rows(act, call.contracting[1 - i])
        self.found.update(_add(self.found, {source.path: _batch_stats(x, self.hessian)}))
        return out

    @staticmethod
    def _check_op(site: OpSite | LookupSite) -> None:
        if not registry.get(site.op).calibration:
            supported = registry.names(calibration=True)
            raise ValueError(
                f"module {site.path!r}: a rule selects {site.op}, which calibration-based PTQ "
                f"does not handle (supported: {', '.join(supported)}); exclude it with a rule "
                "without weight_qtype placed before this one, or narrow the module_path"
            )


def _contracting_axis(call: OpCall, i: int, what: str) -> int:
    for j in (i, 1 - i):
        if len(call.contracting[j]) != 1:
            side = "the weight" if j == i else "its activation"
            raise ValueError(
                f"{what}: {side} is contracted over {len(call.contracting[j])} axes "
                f"{call.contracting[j]}; calibration-based PTQ handles ops with exactly one "
                "contracting axis (e.g. attention's output projection has two: heads and "
                "head_dim); exclude it with a rule without weight_qtype placed before this "
                "one, or narrow the module_path"
            )
    # A weight axis that is neither contracted nor an output channel of its own is a
    # batch axis shared with the activation (e.g. "bhd,hdk->bhk"): each slice would
    # need its own Hessian.
    weight, act = call.operands[i], call.operands[1 - i]
    out = jax.eval_shape(call.forward_float, *call.operands)
    if out.ndim != weight.ndim + act.ndim - 2:
        raise ValueError(
            f"{what} shares batch axes with its activation; calibration-based PTQ does "
            "not support that"
        )
    return call.contracting[i][0]


def _rows(act: jax.Array, contracting: tuple[int, ...]) -> jax.Array:
    """The activation as float32 rows ``(n, K)`` with the contracting axis last."""
    (c,) = contracting
    x = jnp.moveaxis(act, c, -1)
    return x.reshape(-1, x.shape[-1]).astype(jnp.float32)


def _batch_stats(x: jax.Array, hessian: bool) -> dict[str, jax.Array]:
    a = jnp.abs(x)
    s = {
        "count": jnp.asarray(x.shape[0], jnp.int32),
        "abs_sum": jnp.sum(a, axis=0),
        "abs_max": jnp.max(a, axis=0),
        "nonfinite": jnp.sum(~jnp.isfinite(x), dtype=jnp.int32),
    }
    if hessian:
        s["hessian"] = jnp.einsum("nk,nl->kl", x, x, precision=jax.lax.Precision.HIGHEST)
    return s


@accepts_legacy(lead=1)
def stats_or_collect(
    stats: dict[str, LayerStats] | None,
    data: CalibrationData,
    rules: Sequence[QuantizationRule],
    *,
    hessian: bool = True,
    progress: bool = True,
) -> dict[str, LayerStats]:
    """``stats`` if given, else :func:`collect` on ``data`` (the algorithms' input).

    Raises:
        ValueError: If ``stats`` is None and ``data`` has no batches.
    """
    data = check(data)
    if stats is not None:
        _check_stats_rules(stats, rules)
        return stats
    if data.batches is None:
        raise ValueError(
            f"no calibration data: {data._arg}=None; pass an iterable of model inputs "
            "(or stats=qflax.layer_stats.collect(...))"
        )
    return collect(data, rules, hessian=hessian, progress=progress)


def _check_stats_rules(stats: dict[str, LayerStats], rules: Sequence[QuantizationRule]) -> None:
    """Raises if ``rules`` would give an op of ``stats`` another rule than it was collected with.

    The statistics carry their recipes, so an algorithm given both would follow
    the statistics' rules, not ``rules``.
    """
    matcher = RuleMatcher(rules)
    for path, layer in stats.items():
        use = layer.site
        for op in use.ops if use.rule is not None else ():
            module, name = op.rsplit(": ", 1)
            rule = matcher.match(module, name)
            if rule != use.rule:
                raise ValueError(
                    f"stats[{path!r}] was collected for {op} with the rule {use.rule!r}, but "
                    f"rules give that op {rule!r}; collect the stats with the same rules "
                    "(qflax.layer_stats.collect(data, rules))"
                )

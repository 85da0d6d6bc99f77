"""LoRA and QLoRA: trainable low-rank adapters on the ops that rules select.

A :class:`LoraRule` selects ops like a :class:`~qflax.QuantizationRule` and adds,
for each selected op whose one operand is a model parameter (the *weight* ``W``),
two trainable factors ``A`` (``in_features x rank``) and ``B``
(``rank x out_axes``), where ``in_features`` is the product of the weight's
contracted axes and ``out_axes`` are its other axes (kept as axes, so ``B`` of a
``(d, heads, head_dim)`` einsum weight is ``(rank, heads, head_dim)``; the
initializer draws ``B`` as ``rank x out_features``, ``out_features`` their
product). A weight with batch axes (``dot_general`` batch dimensions, an einsum
letter in both operands and the output: one weight per expert) gets one pair per
batch index: ``A`` is ``(*batch, in_features, rank)`` and ``B``
``(*batch, rank, *out_axes)``. The op then computes::

    y = op(x, W) + op(dropout(x), reshape(A @ B)) * alpha / rank

which for a Dense layer is ``x @ W + dropout(x) @ A @ B * alpha / rank`` (computed
in that order, without forming ``A @ B``). For ``einsum``, ``dot``/``matmul`` and
convolutions the same formula holds with ``A @ B`` laid out as the weight; for a
convolution that is a convolution with the same window to ``rank`` channels (``A``)
followed by a 1x1 convolution (``B``). ``B`` starts at zero, so the model starts
as the base model. With ``weight_qtype`` set, the frozen base weight is stored and
computed as a :class:`~qflax.QuantizedParam` exactly as :class:`~qflax.PtqProvider`
does (QLoRA).

Where the factors live:

* Linen: in the ``params`` collection, next to the base weight, named after the
  op site (``dot_general0_lora_a``, ``dot_general0_lora_b``); :func:`split_params`
  separates them from the frozen params for ``jax.grad`` and optax. Boxed base
  weights (``nn.with_partitioning`` / ``nn.with_logical_partitioning``) give boxed
  factors (axis names below). Dropout is active when the call has the ``dropout``
  RNG stream (``rngs={"dropout": key}``; the name is ``LoraProvider(rng_collection=)``).
* NNX: as :class:`LoraParam` variables (a subclass of ``nnx.LoRAParam``) added to the
  module that holds the weight, so ``nnx.Optimizer(model, tx, wrt=LoraParam)`` and
  ``nnx.DiffState(0, LoraParam)`` select them. Stacked layers (``nnx.vmap``) get
  stacked factors. A weight on a mesh gives factors placed on it, and a weight
  with ``out_sharding`` metadata gives factors with theirs. Dropout is an
  ``nnx.Dropout`` added next to the factors
  (``dot_general0_lora_dropout``): active by default, off after ``model.eval()``
  and on again after ``model.train()``, as for any NNX dropout (not available for
  stacked layers yet).

Partitioning of the factors, as in Qwix: batch and output axes keep the weight's
axis names; ``A``'s flat input axis takes the name of the first contracted axis
and its rank axis is ``None``; ``B``'s rank axis is ``None``. A weight the module
reshapes before the op gives replicated factors.

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> import qflax
    >>> from qflax.lora import LoraProvider, LoraRule, split_params
    >>> provider = LoraProvider([LoraRule(rank=2, alpha=4.0, weight_qtype="nf4", tile_size=4)])
    >>> qmodel = qflax.quantize_model(nn.Dense(3), provider)
    >>> params = qmodel.init(jax.random.key(0), jnp.ones((1, 8)))["params"]
    >>> params["kernel"]
    QuantizedParam(nf4, shape=(8, 3), compute shape=(8, 3), packed)
    >>> params["dot_general0_lora_a"].shape, params["dot_general0_lora_b"].shape
    ((8, 2), (2, 3))
    >>> lora, frozen = split_params(params)
    >>> sorted(lora), sorted(frozen)
    (['dot_general0_lora_a', 'dot_general0_lora_b'], ['bias', 'kernel'])
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qflax._engine import module_path, registry
from qflax._engine.context import CallContext, Source
from qflax._engine.dispatch import LookupSite, OpSite, Plan, Weight
from qflax._engine.flavor import LINEN
from qflax._engine.opcall import OpCall
from qflax._params import plain
from qflax.providers._base import Provider
from qflax.providers._ptq import PtqProvider
from qflax.qparam import QuantizedParam
from qflax.rule import QuantizationRule

Initializer = Callable[..., jax.Array]
LORA_SUFFIXES = ("_lora_a", "_lora_b")
# The built-in ops a LoRA rule may adapt (the registry's ``lora`` capability).
LORA_OP_NAMES = registry.names(lora=True)
_HE_UNIFORM: Initializer = nn.initializers.he_uniform()
_ZEROS: Initializer = nn.initializers.zeros_init()


class LoraParam(nnx.LoRAParam):
    """An NNX LoRA factor (``A`` or ``B``): filter with it to train only the adapters.

    A subclass of flax's ``nnx.LoRAParam`` (the type Qwix creates), so filters
    written for either select the factors.
    """


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraRule(QuantizationRule):
    """A rule that adds low-rank adapters to the ops it selects (QLoRA with ``weight_qtype``).

    All :class:`~qflax.QuantizationRule` fields apply (``module_path``,
    ``op_names``, ``weight_qtype``, ``tile_size``, ``weight_calibration_method``);
    activations are not quantized (``act_qtype`` must stay None), and ``op_names``
    defaults to, and must be among, :data:`LORA_OP_NAMES` (no ``ragged_dot``).

    Attributes:
        rank: Rank of the adapter, an int >= 1 and at most ``min(in_features,
            out_features)`` of each selected weight (checked when the op runs).
        alpha: Scale numerator: the adapter's output is multiplied by
            ``alpha / rank``. A number > 0; None (default) means ``rank`` (scale 1).
        dropout: Probability of zeroing an input element of the adapter path
            while training, in ``[0, 1)``.
        a_initializer: ``init(key, shape, dtype)`` of ``A`` (``in x rank``); He
            (Kaiming) uniform over the ``in`` fan-in by default.
        b_initializer: Same for ``B`` (``rank x out``); zeros by default, so the
            initial output equals the base model's.

    Example:
        >>> from qflax.lora import LoraRule
        >>> LoraRule(rank=4, alpha=8.0).scale
        2.0
        >>> LoraRule(rank=0)
        Traceback (most recent call last):
        ...
        ValueError: rank=0 must be an int >= 1
    """

    op_names: Sequence[str] = LORA_OP_NAMES
    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    a_initializer: Initializer = _HE_UNIFORM
    b_initializer: Initializer = _ZEROS

    def __post_init__(self) -> None:
        super().__post_init__()
        refused = [n for n in self.op_names if not registry.get(n).lora]
        if refused:
            raise ValueError(
                f"op_names={self.op_names}: LoRA adapters are not available for "
                f"{', '.join(refused)} (ops registered without lora=True; ragged_dot has "
                f"per-expert weights, take is a lookup); allowed: {registry.names(lora=True)}"
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int | np.integer):
            raise ValueError(f"rank={self.rank!r} must be an int >= 1")
        if self.rank < 1:
            raise ValueError(f"rank={self.rank!r} must be an int >= 1")
        object.__setattr__(self, "rank", int(self.rank))
        if self.alpha is not None:
            ok = isinstance(self.alpha, int | float) and not isinstance(self.alpha, bool)
            if not ok or not math.isfinite(self.alpha) or self.alpha <= 0:
                raise ValueError(f"alpha={self.alpha!r} must be a finite number > 0 (or None)")
        ok = isinstance(self.dropout, int | float) and not isinstance(self.dropout, bool)
        if not ok or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be a number in [0, 1)")
        for field in ("a_initializer", "b_initializer"):
            if not callable(getattr(self, field)):
                raise ValueError(
                    f"{field}={getattr(self, field)!r} must be a callable init(key, shape, dtype)"
                )
        if self.act_qtype is not None:
            raise ValueError(
                f"act_qtype={self.act_qtype!r}: LoraRule quantizes only the frozen base weight "
                "(weight_qtype); activations stay float"
            )

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of the adapter's output."""
        return (self.rank if self.alpha is None else float(self.alpha)) / self.rank


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How ``A`` (``*batch, in, rank``) and ``B`` (``*batch, rank, *out_axes``) map onto the weight.

    ``in`` flattens the weight's contracted axes; ``B`` keeps the weight's output
    axes, and each index of its batch axes (experts) has its own pair of factors.
    """

    shape: tuple[int, ...]  # the weight as the op sees it
    contracting: tuple[int, ...]
    free: tuple[int, ...]  # output axes: neither contracted nor batch
    batch: tuple[int, ...] = ()

    @property
    def in_features(self) -> int:
        return math.prod(self.shape[a] for a in self.contracting)

    @property
    def out_features(self) -> int:
        return math.prod(self.shape[a] for a in self.free)

    def factor_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of ``A`` and ``B``."""
        lead = tuple(self.shape[a] for a in self.batch)
        return (*lead, self.in_features, rank), (*lead, rank, *(self.shape[a] for a in self.free))

    def init(self, which: int, init: Initializer, key: jax.Array, rank: int, dtype: Any) -> Any:
        """Factor ``which`` (0: ``A``, 1: ``B``), drawn as ``(in, rank)`` / ``(rank, out)``.

        The initializer sees the flat 2-D shape (so fans are ``in`` and ``out``),
        once per batch index.
        """
        flat = (self.in_features, rank) if which == 0 else (rank, self.out_features)
        shape = self.factor_shapes(rank)[which]
        if not self.batch:
            return init(key, flat, dtype).reshape(shape)
        keys = jax.random.split(key, math.prod(self.shape[a] for a in self.batch))
        return jax.vmap(lambda k: init(k, flat, dtype))(keys).reshape(shape)

    def delta(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """``A @ B`` (per batch index) in the weight's layout."""
        nb = len(self.batch)
        d = a @ b.reshape(b.shape[: nb + 1] + (self.out_features,))
        order = self.batch + self.contracting + self.free
        d = d.reshape(tuple(self.shape[i] for i in order))
        return jnp.transpose(d, tuple(int(i) for i in np.argsort(order)))

    def axis_names(self, names: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Partitioning of ``A`` and ``B`` for a weight partitioned as ``names``.

        Batch and output axes keep their names; ``A``'s flat input axis takes the
        first contracted axis's name (its blocks stay contiguous), as Qwix does.
        """
        lead = tuple(names[a] for a in self.batch)
        a_in = names[self.contracting[0]] if self.contracting else None
        return (*lead, a_in, None), (*lead, None, *(names[a] for a in self.free))


class LoraProvider(Provider):
    """Adds LoRA adapters on ops selected by :class:`LoraRule` (QLoRA with ``weight_qtype``).

    Plain :class:`~qflax.QuantizationRule` entries in ``rules`` behave as in
    :class:`~qflax.PtqProvider` (no adapter). A LoRA rule that matches only ops
    without a weight operand (e.g. ``q @ k.T``) is an error after the first call;
    such ops are skipped when the rule also selects weights.

    Args:
        rules: Rules, first match wins.
        rng_collection: Linen RNG stream of the adapter dropout; dropout is on when
            the call has this stream.
        seed: NNX only: seed of the ``A`` initializer (folded with each
            parameter's path).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> import qflax
        >>> from qflax.lora import LoraParam, LoraProvider, LoraRule
        >>> model = nnx.Linear(8, 3, rngs=nnx.Rngs(0))
        >>> x = jnp.ones((2, 8))
        >>> ref = model(x)
        >>> model = qflax.quantize_model(model, LoraProvider([LoraRule(rank=2)]), x)
        >>> model.dot_general0_lora_a.shape, type(model.dot_general0_lora_b).__name__
        ((8, 2), 'LoraParam')
        >>> bool(jnp.all(model(x) == ref))  # B starts at zero
        True
        >>> len(jax.tree.leaves(nnx.state(model, LoraParam)))
        2
    """

    stores_quantized_weights = True  # the frozen base of QLoRA, as PtqProvider

    def __init__(
        self,
        rules: Sequence[QuantizationRule],
        *,
        rng_collection: str = "dropout",
        seed: int = 0,
    ) -> None:
        super().__init__(rules)
        self._ptq = PtqProvider(self.rules)  # computes plain rules' ops and QLoRA bases
        self.rng_collection, self.seed = rng_collection, seed
        self._applied: set[int] = set()
        self._weightless: dict[int, list[str]] = {}

    def call_finished(self) -> None:
        """Raises for a LoRA rule that matched only ops without a weight, then warns as usual."""
        if not self._warned:
            self._check_weightless()
        super().call_finished()

    def nnx_variables(self, model: Any, ctx: CallContext) -> list[tuple[Any, str, Any]]:
        """The LoRA factors (and dropout layers) discovery asked for (see Provider)."""
        self._check_weightless()
        out: list[tuple[Any, str, Any]] = []
        for req in ctx.requests.values():
            if isinstance(req, _Adapter):
                out += _create_nnx(self.seed, model, req)
        return out

    def _check_weightless(self) -> None:
        for i, rule in enumerate(self.rules):
            if i in self._weightless and i not in self._applied:
                ops = ", ".join(sorted(set(self._weightless[i])))
                raise ValueError(
                    f"LoraRule(module_path={rule.module_path!r}, op_names={rule.op_names}) "
                    f"matched only ops without a weight operand ({ops}); LoRA adapts an op "
                    "one of whose operands is a model parameter: narrow module_path or "
                    "op_names"
                )

    def visit_op(self, ctx: CallContext, site: OpSite) -> jax.Array:
        """Adds the adapter to an op a LoRA rule selected; plain rules compute as PTQ."""
        rule = site.rule
        if not isinstance(rule, LoraRule):
            return self._ptq.visit_op(ctx, site)
        index = next(i for i, r in enumerate(self.rules) if r is rule)
        weights = [i for i, s in enumerate(site.sources) if s is not None]
        if len(weights) != 1:
            if len(weights) == 2:
                raise ValueError(
                    f"{site.where}: both operands of {site.op} are model parameters; LoRA needs "
                    "one weight and one input"
                )
            self._weightless.setdefault(index, []).append(f"{site.op} in {site.path or '<root>'!r}")
            return site.run_original()
        self._applied.add(index)
        return self._lora(ctx, site, rule, weights[0])

    def visit_lookup(self, ctx: CallContext, site: LookupSite) -> jax.Array:
        """Lookups get no adapter: they compute as PTQ."""
        return self._ptq.visit_lookup(ctx, site)

    def _lora(self, ctx: CallContext, site: OpSite, rule: LoraRule, wi: int) -> jax.Array:
        call, where = site.call, site.where
        w, x = call.operands[wi], call.operands[1 - wi]
        source = site.sources[wi]
        assert source is not None
        contracting, batch = call.contracting[wi], call.batch[wi]
        free = tuple(i for i in range(w.ndim) if i not in contracting + batch)
        layout = _Layout(tuple(w.shape), contracting, free, batch)
        limit = min(layout.in_features, layout.out_features)
        if rule.rank > limit:
            raise ValueError(
                f"{where}: rank={rule.rank} is larger than min(in_features, out_features)="
                f"{limit} of weight {source.path!r} (compute shape {layout.shape}); use a rank "
                f"in [1, {limit}]"
            )
        plan = site.plans[wi]
        if isinstance(plan, Weight):
            plans: list[Plan] = [None, None]
            plans[wi] = plan
            operands: list[Any] = [self._ptq.scaled_input(call, plans, wi, x)] * 2
            operands[wi] = self._ptq.weight(ctx, plan, w)
            base = call.run(*operands)
        else:
            base = site.run_original()
        a, b = self._factors(ctx, rule, site, source, layout)
        a, b = a.astype(x.dtype), b.astype(x.dtype)
        xd = self._dropout(ctx, rule, site, x)
        fast = _dense_like(call, wi, layout, site.original, site.args, site.kwargs)
        if fast is not None:
            h = lax.dot_general(xd, a, fast)
            delta = lax.dot_general(h, b, (((h.ndim - 1,), (0,)), ((), ())))
        else:
            d = layout.delta(a, b)
            delta = call.forward_float(xd, d) if wi == 1 else call.forward_float(d, xd)
        return base + (delta * jnp.asarray(rule.scale, delta.dtype)).astype(base.dtype)

    def _dropout(self, ctx: CallContext, rule: LoraRule, site: OpSite, x: jax.Array) -> jax.Array:
        module = site.module
        if rule.dropout == 0.0 or ctx.discovering:
            return x
        if ctx.flavor is not LINEN:
            return getattr(module, f"{site.name}_lora_dropout")(x)  # an nnx.Dropout
        if not module.has_rng(self.rng_collection):
            return x  # evaluation: no dropout stream given
        keep = 1.0 - rule.dropout
        mask = jax.random.bernoulli(module.make_rng(self.rng_collection), keep, x.shape)
        return jnp.where(mask, x / jnp.asarray(keep, x.dtype), jnp.zeros((), x.dtype))

    # -- factors -------------------------------------------------------------------
    def _factors(
        self, ctx: CallContext, rule: LoraRule, site: OpSite, source: Source, layout: _Layout
    ) -> tuple[jax.Array, jax.Array]:
        module, where = site.module, site.where
        names = (f"{site.name}_lora_a", f"{site.name}_lora_b")
        shapes = layout.factor_shapes(rule.rank)
        if ctx.flavor is LINEN:
            return self._linen_factors(ctx, rule, module, names, shapes, source, layout, where)
        if ctx.discovering:
            adapter = _Adapter(
                rule,
                names,
                shapes,
                source.path,
                bool(source.transforms),
                source.value.ndim,
                layout,
                where,
            )
            ctx.request((source.path, names), adapter)
            dtype = jnp.dtype(_float_dtype(source.value))
            return jnp.zeros(shapes[0], dtype), jnp.zeros(shapes[1], dtype)
        out = []
        for n in names:
            var = getattr(module, n, None)
            if not isinstance(var, LoraParam):
                raise ValueError(
                    f"LoRA param {where}_lora_{n[-1]} is missing: add the adapters with "
                    "qflax.quantize_model(model, LoraProvider(rules), *example_inputs)"
                )
            out.append(var.get_raw_value())
        return out[0], out[1]

    def _linen_factors(
        self,
        ctx: CallContext,
        rule: LoraRule,
        module: Any,
        names: tuple[str, str],
        shapes: tuple[tuple[int, ...], tuple[int, ...]],
        source: Source,
        layout: _Layout,
        where: str,
    ) -> tuple[jax.Array, jax.Array]:
        scope = module.scope
        if all(scope.has_variable("params", n) for n in names):
            return tuple(nn.meta.unbox(scope.get_variable("params", n)) for n in names)  # type: ignore[return-value]
        if not ctx.may_quantize_params or not scope.is_mutable_collection("params"):
            raise ValueError(
                f"LoRA params {where}_lora_a/_lora_b are missing: create them with the LoRA "
                "model's init (or apply with mutable=['params'] and rngs={'params': key})"
            )
        if not scope.has_rng("params"):
            raise ValueError(
                f"creating LoRA params {where}_lora_a/_lora_b needs the 'params' RNG stream"
            )
        dtype = jnp.dtype(_float_dtype(source.value))
        a = layout.init(0, rule.a_initializer, scope.make_rng("params"), rule.rank, dtype)
        b = layout.init(1, rule.b_initializer, scope.make_rng("params"), rule.rank, dtype)
        box = _linen_box(source)
        axes = _factor_axes(box, source, layout)
        for n, v, ax in zip(names, (a, b), axes, strict=True):
            scope.put_variable(
                "params", n, v if box is None else box.replace_boxed(v).replace(names=ax)
            )
        return a, b


def _float_dtype(value: Any) -> Any:
    return value.recipe.dtype if isinstance(value, QuantizedParam) else value.dtype


def _dense_like(
    call: OpCall,
    wi: int,
    layout: _Layout,
    original: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> Any:
    """The dimension numbers of ``x @ A`` when ``x @ A @ B`` can skip forming ``A @ B``.

    That is a ``dot_general`` with a 2-D right-hand weight contracted over axis 0
    and no batch axes (``nn.Dense``, ``nnx.Linear``): its output ends with the
    weight's output axis.
    """
    if call.name != "dot_general" or wi != 1 or len(layout.shape) != 2:
        return None
    if layout.contracting != (0,):
        return None
    dn = inspect.signature(original).bind(*args, **kwargs).arguments["dimension_numbers"]
    (lc, _), (lb, rb) = dn
    if len(lb) or len(rb):
        return None
    return ((tuple(lc), (0,)), ((), ()))


def _linen_box(source: Source) -> Any:
    raw = source.holder.get_variable("params", source.name)
    if isinstance(raw, QuantizedParam):
        raw = raw.qarray.qvalue
    return raw if isinstance(raw, nn.meta.AxisMetadata) else None


def _factor_axes(box: Any, source: Source, layout: _Layout) -> tuple[Any, Any]:
    """Axis names of ``A`` and ``B`` from the weight's (None where it has none)."""
    names = getattr(box, "names", None)
    if names is None or source.transforms or len(names) != len(layout.shape):
        names = (None,) * len(layout.shape)
    return layout.axis_names(names)


@dataclasses.dataclass(frozen=True)
class _Adapter:
    """LoRA factors of one NNX op, recorded by discovery and created afterwards."""

    rule: LoraRule
    names: tuple[str, str]
    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    path: str  # of the weight
    transformed: bool  # the op sees the weight through a transform (no sharding then)
    ndim: int  # of one layer's weight
    layout: _Layout
    where: str


def _create_nnx(seed: int, model: nnx.Module, req: _Adapter) -> list[tuple[Any, str, Any]]:
    """The factors (and dropout) of ``req`` for the module holding the weight.

    Stacked like the weight (``nnx.vmap``'d layers get stacked factors). For a
    weight with partitioning metadata (``out_sharding``) the factors get the
    matching metadata (:meth:`_Layout.axis_names`), and for a weight on a mesh
    they are placed with the matching sharding.
    """
    rule, names, layout = req.rule, req.names, req.layout
    module_name, _, attr = req.path.rpartition("/")
    real = module_path.find_nnx(model, module_name)
    if all(isinstance(getattr(real, n, None), LoraParam) for n in names):
        return []
    var = getattr(real, attr)
    raw = var.get_raw_value()
    per_layer = len(raw.recipe.shape) if isinstance(raw, QuantizedParam) else req.ndim
    full = tuple(raw.shape)
    lead = full[: len(full) - per_layer]
    dtype = jnp.dtype(_float_dtype(raw))
    sharding = getattr(raw, "sharding", None) if isinstance(raw, jax.Array) else None
    mapped = not req.transformed and len(layout.shape) == per_layer
    placed = _full_names(sharding.spec if isinstance(sharding, NamedSharding) else None, full)
    declared = _full_names(var.get_metadata().get("out_sharding"), full)
    if rule.dropout > 0 and lead:
        raise ValueError(
            f"{req.where}: dropout={rule.dropout} on stacked NNX layers (nnx.vmap / nnx.scan) "
            "is not available yet; use dropout=0.0 for them"
        )
    out: list[tuple[Any, str, Any]] = []
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(req.where.encode()))
    if rule.dropout > 0:
        rngs = nnx.Rngs(dropout=jax.random.fold_in(key, 2))
        site = names[0].removesuffix("_lora_a")
        out.append((real, f"{site}_lora_dropout", nnx.Dropout(rule.dropout, rngs=rngs)))
    for i, (n, init) in enumerate(
        zip(names, (rule.a_initializer, rule.b_initializer), strict=True)
    ):
        keys = jax.random.split(jax.random.fold_in(key, i), math.prod(lead))
        value = jax.vmap(lambda k, i=i, f=init: layout.init(i, f, k, rule.rank, dtype))(keys)
        value = value.reshape(lead + req.shapes[i])
        if mapped and placed is not None and isinstance(sharding, NamedSharding):
            spec = P(*placed[: len(lead)], *layout.axis_names(placed[len(lead) :])[i])
            value = jax.device_put(value, NamedSharding(sharding.mesh, spec))
        param = LoraParam(value)
        if mapped and declared is not None:
            param.set_metadata(
                "out_sharding", declared[: len(lead)] + layout.axis_names(declared[len(lead) :])[i]
            )
        out.append((real, n, param))
    return out


def _full_names(spec: Any, shape: tuple[int, ...]) -> tuple[Any, ...] | None:
    """A partition spec (or names tuple) padded with None to ``shape``'s rank; None if absent."""
    if spec is None:
        return None
    spec = tuple(spec)
    return spec + (None,) * (len(shape) - len(spec))


# -- Linen params ----------------------------------------------------------------------


def is_lora_param(path: Sequence[Any]) -> bool:
    """Whether a params path (tuple of keys) names a LoRA factor."""
    return bool(path) and str(path[-1]).endswith(LORA_SUFFIXES)


def split_params(params: Any) -> tuple[dict, dict]:
    """Splits Linen params into ``(lora, frozen)`` nested dicts (see :func:`merge_params`).

    Train ``lora`` with ``jax.grad`` and optax, and pass
    ``merge_params(lora, frozen)`` to the model: the frozen (possibly quantized)
    base never enters the gradient.
    """
    flat = traverse_util.flatten_dict(
        plain(params), is_leaf=lambda _, x: isinstance(x, QuantizedParam | nn.meta.AxisMetadata)
    )
    lora = {k: v for k, v in flat.items() if is_lora_param(k)}
    frozen = {k: v for k, v in flat.items() if not is_lora_param(k)}
    return traverse_util.unflatten_dict(lora), traverse_util.unflatten_dict(frozen)


def merge_params(lora: Any, frozen: Any) -> dict:
    """The inverse of :func:`split_params`."""
    is_leaf = lambda _, x: isinstance(x, QuantizedParam | nn.meta.AxisMetadata)  # noqa: E731
    flat = traverse_util.flatten_dict(plain(frozen), is_leaf=is_leaf)
    flat.update(traverse_util.flatten_dict(plain(lora), is_leaf=is_leaf))
    return traverse_util.unflatten_dict(flat)

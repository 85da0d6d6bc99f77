"""``quantize_model``: a Linen or NNX model whose calls run through a provider.

Linen: :func:`quantize_model` returns a :class:`QuantizedLinen` whose ``init``
creates quantized params (PtqProvider) or float params plus empty
``quant_stats`` (QtProvider), and whose ``apply`` computes with them. Float
params given to ``apply`` with ``mutable=["params"]`` are quantized in the model
and returned; without it they raise.

NNX: the model is quantized *in place*, one parameter at a time, so the float and
the quantized weights are never both held in full (no clone). A first, abstract
pass over the example inputs (``jax.eval_shape``: nothing is computed) finds which
parameters the rules quantize and how; then each float parameter is replaced by
its :class:`~qflax.qparam.QuantizedParam` (PtqProvider), and statistics variables
(:class:`~qflax.stats.QuantStat`) are added for static-range rules
(QtProvider). The model's class becomes a subclass whose ``methods`` run through
the provider; it is returned for convenience.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import scope as flax_scope
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qflax import stats
from qflax._engine import flavor as flavors
from qflax._engine import interception, module_path
from qflax._engine.context import CallContext, Mode
from qflax._engine.layout import leaf_axes
from qflax.providers._base import Provider
from qflax.qparam import ActScale, QuantizedParam, check_finite_weight, quantize_param


def quantize_model(
    model: nn.Module | nnx.Module,
    provider: Provider,
    *example_inputs: Any,
    methods: Sequence[str] = ("__call__",),
    **example_kwargs: Any,
) -> Any:
    """Quantizes a Flax model's ops by the provider's rules.

    Args:
        model: A Linen module (unbound) or an NNX module.
        provider: A :class:`~qflax.PtqProvider` or :class:`~qflax.QtProvider`.
        *example_inputs: NNX only: inputs of ``methods[0]``, traced abstractly to
            find the parameters to quantize. Linen models take inputs at ``init``.
        methods: Methods that run quantized.
        **example_kwargs: NNX only: keyword inputs of ``methods[0]``.

    Returns:
        A :class:`QuantizedLinen`, or the NNX model itself, quantized in place.

    Raises:
        ValueError: For a model that is neither Linen nor NNX, a missing method,
            NNX without example inputs, or rules the model cannot satisfy.

    Example:
        >>> import flax.linen as nn, jax, jax.numpy as jnp
        >>> import qflax
        >>> rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
        >>> qmodel = qflax.quantize_model(nn.Dense(4), qflax.PtqProvider(rules))
        >>> params = qmodel.init(jax.random.key(0), jnp.ones((2, 8)))["params"]
        >>> params["kernel"].qarray
        QArray(int8, shape=(8, 4), dtype=float32, scale=(1, 4))
        >>> qmodel.apply({"params": params}, jnp.ones((2, 8))).shape
        (2, 4)
    """
    if not isinstance(provider, Provider):
        raise ValueError(f"provider={provider!r} must be a qflax.PtqProvider or QtProvider")
    methods = tuple(methods)
    if not methods:
        raise ValueError("methods=() names no method to quantize")
    for m in methods:
        if not callable(getattr(type(model), m, None)):
            raise ValueError(f"methods: {type(model).__name__} has no method {m!r}")
    if flavors.of(model) is flavors.LINEN:
        return QuantizedLinen(cast(nn.Module, model), provider, methods)
    nnx_model = cast(nnx.Module, model)
    return _quantize_nnx(nnx_model, provider, methods, example_inputs, example_kwargs)


@contextlib.contextmanager
def _calling(provider: Provider, ctx: CallContext) -> Iterator[None]:
    with interception.intercept(provider.handler(ctx), values=ctx):
        yield


class QuantizedLinen:
    """A Linen model whose ``init`` and ``apply`` run through a provider.

    Attributes:
        model: The original module.
        provider: The provider.
        methods: Names of the methods that run quantized.
    """

    def __init__(self, model: nn.Module, provider: Provider, methods: tuple[str, ...]) -> None:
        self.model, self.provider, self.methods = model, provider, methods

    def __repr__(self) -> str:
        return f"QuantizedLinen({type(self.model).__name__}, {type(self.provider).__name__})"

    def _run(self, mode: Mode, method: Any, fn: Callable[[], Any]) -> Any:
        name = "__call__" if method is None else getattr(method, "__name__", method)
        if name not in self.methods:
            return fn()
        ctx = CallContext(flavors.LINEN, mode)
        with _calling(self.provider, ctx):
            out = fn()
        self.provider.call_finished()
        return out

    def init_with_output(
        self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any
    ) -> tuple[Any, Any]:
        """Like ``nn.Module.init_with_output``, with quantized params (PtqProvider).

        The float variables come from the model's own ``init`` (so they equal
        ``model.init``'s), then one quantized call converts them and creates the
        providers' variables (static scales, empty statistics).
        """
        variables = self.model.init(rngs, *args, method=method, **kwargs)
        if isinstance(rngs, jax.Array):
            rngs = {"params": rngs}
        return self._run(
            Mode.INIT,
            method,
            lambda: self.model.apply(
                variables, *args, method=method, mutable=True, rngs=rngs, **kwargs
            ),
        )

    def init(self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any) -> Any:
        """Like ``nn.Module.init``; see :meth:`init_with_output`."""
        return self.init_with_output(rngs, *args, method=method, **kwargs)[1]

    def apply(
        self, variables: Any, *args: Any, method: Any = None, mutable: Any = False, **kwargs: Any
    ) -> Any:
        """Like ``nn.Module.apply``.

        With ``mutable`` including ``"params"``, float params that the rules
        quantize are quantized in the model and returned in the updated variables.
        """
        params_mutable = flax_scope.in_filter(mutable, "params") if mutable else False
        mode = Mode.QUANTIZE if params_mutable else Mode.APPLY
        return self._run(
            mode,
            method,
            lambda: self.model.apply(variables, *args, method=method, mutable=mutable, **kwargs),
        )


# -- NNX ---------------------------------------------------------------------------


@functools.cache
def _quantized_class(cls: type, methods: tuple[str, ...]) -> type:
    """The subclass of ``cls`` whose ``methods`` run through the model's provider.

    NNX registers every Module subclass for good, so there is one class per
    ``(cls, methods)``, not per provider: the provider lives on the model
    (``_qflax_provider``) and is freed with it (a mixed-precision search makes one
    provider per candidate).
    """

    def wrap(name: str) -> Callable[..., Any]:
        original = getattr(cls, name)

        @functools.wraps(original)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            provider = self._qflax_provider
            update = bool(getattr(self, "qflax_update_stats", False))
            ctx = CallContext(flavors.NNX, Mode.APPLY, update_stats=update)
            with _calling(provider, ctx):
                out = original(self, *args, **kwargs)
            provider.call_finished()
            return out

        return method

    attrs: dict[str, Any] = {name: wrap(name) for name in methods}
    attrs["_qflax_quantized"] = True
    attrs["__qualname__"] = f"Quantized{cls.__qualname__}"
    attrs["__module__"] = cls.__module__
    return type(f"Quantized{cls.__name__}", (cls,), attrs)


def _quantize_nnx(
    model: nnx.Module,
    provider: Provider,
    methods: tuple[str, ...],
    inputs: tuple,
    kwargs: dict,
) -> nnx.Module:
    if not inputs and not kwargs:
        raise ValueError(
            "quantize_model(nnx_model, provider, *example_inputs): NNX models need example "
            f"inputs of {methods[0]!r} to find the ops to quantize"
        )
    given = type(model)
    if getattr(given, "_qflax_quantized", False):
        # Re-quantizing (e.g. a calibrated QtProvider model with a PtqProvider):
        # start from the original class, keep the variables.
        model.__class__ = given.__bases__[0]
    try:
        module_path.label_nnx(model)
        ctx = _discover(model, provider, methods[0], inputs, kwargs)
        _convert(model, provider, ctx)
    except BaseException:
        model.__class__ = given
        raise
    model._qflax_provider = provider  # type: ignore[attr-defined]
    model.__class__ = _quantized_class(type(model), methods)
    if provider.learns_statistics:
        model.qflax_update_stats = True  # type: ignore[attr-defined]
    return model


def _discover(
    model: nnx.Module, provider: Provider, method: str, inputs: tuple, kwargs: dict
) -> CallContext:
    """Runs ``method`` abstractly and records the recipes and activation sites."""
    graphdef, state = nnx.split(model)
    ctx = CallContext(flavors.NNX, Mode.DISCOVER)

    def run(state: Any) -> Any:
        m = nnx.merge(graphdef, state)
        with _calling(provider, ctx):
            return getattr(m, method)(*inputs, **kwargs)

    jax.eval_shape(run, state)
    return ctx


def _convert(model: nnx.Module, provider: Provider, ctx: CallContext) -> None:
    """Quantizes the discovered params in place and adds the activation sites' variables.

    Everything that can fail (missing or empty statistics) is checked before the
    first parameter is replaced, so a failed conversion leaves the model as it was.
    """
    lead: dict[str, tuple[int, ...]] = {}  # module path -> stacking axes (nnx.vmap'd layers)
    for path, recipe in ctx.recipes.items():
        module_name, _, attr = path.rpartition("/")
        value = getattr(module_path.find_nnx(model, module_name), attr).get_raw_value()
        if provider.stores_quantized_weights:
            check_finite_weight(value, path)
        shape = value.shape
        lead[module_name] = tuple(shape[: len(shape) - len(recipe.shape)])
    new_vars: list[tuple[Any, str, nnx.Variable]] = []
    for path, variables in ctx.sites.items():
        module = module_path.find_nnx(model, path)
        for name, (collection, value) in variables.items():
            if collection == "quant_stats":
                shape = lead.get(path, ())
                empty = jax.tree.map(
                    lambda a, s=shape: jnp.broadcast_to(a, s + a.shape), stats.empty()
                )
                new_vars.append((module, name, stats.QuantStat(empty)))
                continue
            site = value.recipe.stat
            stat_var = getattr(module, site, None)
            if not isinstance(stat_var, stats.QuantStat):
                raise ValueError(
                    f"{path}/{site}: act_static_scale needs statistics. Quantize the model with "
                    "qflax.QtProvider, run it on calibration data, then convert it with "
                    "PtqProvider"
                )
            stat = stat_var.get_raw_value()
            stats.check_seen(stat, f"{path}/{site}")
            scale = stats.scale(stat, value.recipe.qtype)
            new_vars.append((module, name, nnx.Param(ActScale(scale, value.recipe))))
    new_vars += provider.nnx_variables(model, ctx)
    if provider.stores_quantized_weights:
        for path, recipe in ctx.recipes.items():
            module_name, _, attr = path.rpartition("/")
            var = getattr(module_path.find_nnx(model, module_name), attr)
            var.set_raw_value(_sharded_like(var.get_raw_value(), recipe))
            if var.has_metadata("out_sharding"):
                # A float-layout spec does not fit codes and scales; their arrays
                # carry their own shardings now.
                var.set_metadata("out_sharding", None)
    for module, name, var in new_vars:
        setattr(module, name, var)


def _sharded_like(value: jax.Array, recipe: Any) -> QuantizedParam:
    """Quantizes ``value``; codes and scales of a mesh-sharded value stay on its mesh.

    ``qvalue`` takes the float parameter's partition spec and ``scale`` keeps it
    along per-channel axes only (see ``qflax._engine.layout.leaf_axes``).
    """
    qp = quantize_param(value, recipe)
    sharding = getattr(value, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return qp
    spec = tuple(sharding.spec) + (None,) * (value.ndim - len(sharding.spec))
    axes = leaf_axes(qp, spec)
    children, aux = qp.qarray.tree_flatten_with_keys()
    placed = [
        None
        if leaf is None
        else jax.device_put(leaf, NamedSharding(sharding.mesh, P(*axes[k.name])))
        for k, leaf in children
    ]
    return QuantizedParam(type(qp.qarray).tree_unflatten(aux, placed), recipe)

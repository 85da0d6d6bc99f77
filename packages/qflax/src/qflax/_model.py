"""``quantize_model``: a Linen or NNX model whose calls run through a provider.

Linen: :func:`quantize_model` returns an instance of a subclass of the model's
own class (and of :class:`QuantizedLinen`) whose ``methods`` run through the
provider, so it stands in for the model wherever the model is used. Its ``init``
is the model's own, in one pass: params are quantized as they are created
(PtqProvider) or kept float with empty ``quant_stats`` (QtProvider). Its
``apply`` computes with them; float params given to ``apply`` with
``mutable=["params"]`` are quantized in the model and returned, without it they
raise.

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
import dataclasses
import functools
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
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
        methods: Methods that run quantized. Linen: ``init``/``apply`` of another
            method of the model (``method="decode"``) raises rather than run it
            in float; a function given as ``method`` runs as it is, quantized
            inside the listed methods it calls.
        **example_kwargs: NNX only: keyword inputs of ``methods[0]``.

    Returns:
        Linen: an instance of ``Quantized<Model>``, a subclass of the model's class
        and of :class:`QuantizedLinen` with the same fields (one class per class
        and ``methods``; the provider is its ``qflax_provider`` field). It
        behaves like the model (``clone``, ``bind``, attributes, other
        methods); its listed methods run through the provider, in init mode
        under ``init`` (the model's own init, its ``is_initializing()`` branch
        included: params are quantized as they are created, so the float ones
        are exactly ``model.init``'s), quantizing float params in place when
        ``params`` is mutable, else applying. A listed method called from another
        one runs in the outer call. NNX: the model itself, quantized in place (its
        provider is its ``qflax_provider`` attribute, the methods ``qflax_methods``).

    Raises:
        ValueError: For a model that is neither Linen nor NNX, a missing method,
            a bound Linen module, NNX without example inputs, or rules the model
            cannot satisfy.

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
        >>> isinstance(qmodel, nn.Dense), qmodel.features, type(qmodel).__name__
        (True, 4, 'QuantizedDense')
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
        return _quantize_linen(cast(nn.Module, model), provider, methods)
    nnx_model = cast(nnx.Module, model)
    return _quantize_nnx(nnx_model, provider, methods, example_inputs, example_kwargs)


@contextlib.contextmanager
def _calling(provider: Provider, ctx: CallContext) -> Iterator[None]:
    with interception.intercept(provider.handler(ctx), values=ctx):
        yield


class _Alias:
    """A read-only class attribute that an instance attribute of the same name overrides.

    (A non-data descriptor: a model field or attribute called ``model``,
    ``provider`` or ``methods`` keeps its meaning on the quantized model.)
    """

    def __init__(self, fget: Callable[[Any], Any]) -> None:
        self.fget, self.__doc__ = fget, fget.__doc__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else self.fget(obj)


class QuantizedLinen:
    """The base of every quantized Linen model class :func:`quantize_model` makes.

    ``quantize_model(model, provider, methods=...)`` returns an instance of a
    subclass of ``type(model)`` and of this class: it has the model's fields,
    attributes and methods (``clone``, ``bind``, ``init``, ``apply``...), and its
    ``methods`` run through the provider, in a mode chosen from the scope: init
    (``is_initializing()``: the model's own init, quantizing params as they are
    created), quantize (``params`` mutable: float params are quantized in place),
    or apply. A quantized method called from another one runs in the outer call.
    Its ``model``, ``provider`` and ``methods`` are documented below.
    """

    qflax_provider: Provider
    qflax_methods: tuple[str, ...]

    @_Alias
    def provider(self) -> Provider:
        """The provider (the ``qflax_provider`` field)."""
        return self.qflax_provider

    @_Alias
    def methods(self) -> tuple[str, ...]:
        """Names of the methods that run quantized."""
        return self.qflax_methods

    @_Alias
    def model(self) -> nn.Module:
        """The original (float) module, with the same fields."""
        return _float_module(cast(nn.Module, self))


def _float_module(module: nn.Module) -> nn.Module:
    return type(module).__bases__[0](**_init_fields(module))


def _init_fields(module: nn.Module) -> dict[str, Any]:
    return {f.name: getattr(module, f.name) for f in dataclasses.fields(module) if f.init}


_linen_calls = threading.local()  # .depth: quantized Linen methods running on this thread


def _linen_mode(module: nn.Module) -> Mode:
    if module.is_initializing():
        return Mode.INIT
    return Mode.QUANTIZE if module.is_mutable_collection("params") else Mode.APPLY


def _linen_method(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` run through the module's provider, in one context per outermost call."""

    @functools.wraps(original)  # keeps Flax's wrapper marks: Flax does not wrap it again
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_linen_calls, "depth", 0)
        if depth or self.scope is None:  # nested (the outer call's context), or unbound
            return original(self, *args, **kwargs)
        provider = self.qflax_provider
        ctx = CallContext(flavors.LINEN, _linen_mode(self))
        _linen_calls.depth = depth + 1
        try:
            with _calling(provider, ctx):
                out = original(self, *args, **kwargs)
        finally:
            _linen_calls.depth = depth
        provider.call_finished()
        return out

    return method


def _entry_method(module: Any, method: Any) -> Any:
    """The ``method`` argument to hand Flax's ``init``/``apply``.

    A method of the model's class (by name, bound or as the class's function)
    must be one of the quantized ``methods`` and becomes the quantized one; any
    other function runs as it is (quantized inside the listed methods it calls).

    Raises:
        ValueError: For a method of the model that is not in ``methods``.
    """
    base = type(module).__bases__[0]
    if method is None or isinstance(method, str):
        name = "__call__" if method is None else method
    elif (
        isinstance(method, types.MethodType)
        or getattr(base, getattr(method, "__name__", ""), None) is method
    ):
        name = method.__name__
    else:
        return method
    if name not in module.qflax_methods:
        raise ValueError(
            f"method={name!r} of {base.__name__} does not run quantized: the model was "
            f"quantized with methods={module.qflax_methods!r}; quantize it with "
            f"methods=[..., {name!r}]"
        )
    return method if method is None or isinstance(method, str) else getattr(type(module), name)


def _entry(name: str) -> Callable[..., Any]:
    """``nn.Module.<name>`` (init, init_with_output, apply) with the method checked."""
    original = getattr(nn.Module, name)

    @functools.wraps(original)
    def entry(self: Any, *args: Any, method: Any = None, **kwargs: Any) -> Any:
        return original(self, *args, method=_entry_method(self, method), **kwargs)

    return nn.nowrap(entry)


def _reduce(self: Any) -> tuple[Any, ...]:
    base, fields = type(self).__bases__[0], _init_fields(self)
    return _rebuild_linen, (base, self.qflax_methods, fields, self.qflax_provider)


def _rebuild_linen(
    cls: type, methods: tuple[str, ...], fields: dict[str, Any], provider: Provider
) -> Any:
    module = _quantized_linen_class(cls, methods)(**fields)
    object.__setattr__(module, "qflax_provider", provider)
    return module


def _clone(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``Module.clone``, keeping the provider (not an init field, see below)."""
    clone = type(self).__bases__[0].clone(self, *args, **kwargs)
    object.__setattr__(clone, "qflax_provider", self.qflax_provider)
    return clone


@functools.cache
def _quantized_linen_class(cls: type, methods: tuple[str, ...]) -> type:
    """The subclass of ``cls`` whose ``methods`` run through the model's provider.

    One class per ``(cls, methods)``: the provider is a dataclass field
    (``qflax_provider``) that ``clone`` keeps and that is freed with the model. It
    is not an init field: Flax's lifted class transforms (``nn.remat(Model)``)
    rebuild the original class from the init fields of the quantized one.
    """
    attrs: dict[str, Any] = {name: _linen_method(getattr(cls, name)) for name in methods}
    attrs |= {name: _entry(name) for name in ("init", "init_with_output", "apply")}
    attrs["__reduce__"] = nn.nowrap(_reduce)
    attrs["qflax_methods"] = methods
    attrs["clone"] = nn.nowrap(_clone)
    attrs["qflax_provider"] = dataclasses.field(default=None, init=False, repr=False, compare=False)
    attrs["__annotations__"] = {"qflax_provider": Any}
    attrs["__qualname__"] = f"Quantized{cls.__qualname__}"
    attrs["__module__"] = cls.__module__
    return type(f"Quantized{cls.__name__}", (cls, QuantizedLinen), attrs)


def _quantize_linen(model: nn.Module, provider: Provider, methods: tuple[str, ...]) -> Any:
    if isinstance(model, QuantizedLinen):  # re-quantizing: start from the original class
        model = _float_module(model)
    if model.scope is not None:
        raise ValueError(
            f"model={type(model).__name__} is bound to variables; allowed: an unbound module "
            "(quantize the module, then bind or apply the quantized one)"
        )
    return _rebuild_linen(type(model), methods, _init_fields(model), provider)


# -- NNX ---------------------------------------------------------------------------


@functools.cache
def _quantized_class(cls: type, methods: tuple[str, ...]) -> type:
    """The subclass of ``cls`` whose ``methods`` run through the model's provider.

    NNX registers every Module subclass for good, so there is one class per
    ``(cls, methods)``, not per provider: the provider lives on the model
    (``qflax_provider``) and is freed with it (a mixed-precision search makes one
    provider per candidate).
    """

    def wrap(name: str) -> Callable[..., Any]:
        original = getattr(cls, name)

        @functools.wraps(original)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            provider = self.qflax_provider
            update = bool(getattr(self, "qflax_update_stats", False))
            ctx = CallContext(flavors.NNX, Mode.APPLY, update_stats=update)
            with _calling(provider, ctx):
                out = original(self, *args, **kwargs)
            provider.call_finished()
            return out

        return method

    attrs: dict[str, Any] = {name: wrap(name) for name in methods}
    attrs["_qflax_quantized"] = True
    attrs["qflax_methods"] = methods
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
    model.qflax_provider = provider  # type: ignore[attr-defined]
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
    along per-channel and tiled axes that split evenly over the mesh (see
    ``qflax._engine.layout.leaf_axes``).
    """
    qp = quantize_param(value, recipe)
    sharding = getattr(value, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return qp
    spec = tuple(sharding.spec) + (None,) * (value.ndim - len(sharding.spec))
    axes = leaf_axes(qp, spec, dict(sharding.mesh.shape))
    children, aux = qp.qarray.tree_flatten_with_keys()
    placed = [
        None
        if leaf is None
        else jax.device_put(leaf, NamedSharding(sharding.mesh, P(*axes[k.name])))
        for k, leaf in children
    ]
    return QuantizedParam(type(qp.qarray).tree_unflatten(aux, placed), recipe)

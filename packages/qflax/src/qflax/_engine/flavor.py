"""The one place that asks whether a model is Flax Linen or NNX.

A :class:`Flavor` answers, for one API, what the engine and the algorithms need:
a module's path, reading and writing the variables of a quantization site (a
static scale, a statistic), whether a collection may change in this call, an RNG
stream, a model's float params as a plain tree, and how to call a model on
batches with given variables. :func:`of` picks the flavour of a model and is the
only ``isinstance`` test on Linen or NNX modules outside this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import tracers as flax_tracers

from qflax._engine import module_path

if TYPE_CHECKING:
    from qflax._engine.context import CallContext


class Flavor:
    """What differs between Linen and NNX (see the module docstring)."""

    name: str

    def path(self, obj: object) -> str | None:
        """The path of a module of this flavour, or None for anything else."""
        raise NotImplementedError

    def get_var(self, module: Any, collection: str, name: str) -> Any:
        """The (unboxed) value of a site variable of ``module``, or None."""
        raise NotImplementedError

    def may_update(self, ctx: CallContext, module: Any, collection: str) -> bool:
        """Whether this call may change ``collection`` (Linen: mutable; NNX: statistics)."""
        raise NotImplementedError

    def put_var(
        self, ctx: CallContext, module: Any, path: str, collection: str, name: str, value: Any
    ) -> None:
        """Creates or replaces a site variable (NNX discovery records it instead)."""
        raise NotImplementedError

    def make_rng(self, module: Any, collection: str) -> jax.Array:
        """A key from ``module``'s RNG stream ``collection``."""
        raise NotImplementedError

    def check_params(self, params: Any) -> None:
        """Checks that ``params`` is what a model of this flavour needs beside itself.

        Raises:
            ValueError: Linen without params, or NNX with params.
        """
        raise NotImplementedError

    def float_tree(self, model: Any, params: Any) -> Any:
        """The float params of a model as a tree (Linen: ``params``; NNX: the model's own).

        Raises:
            ValueError: As :meth:`check_params`.
        """
        raise NotImplementedError

    def caller(
        self, model: Any, params: Any, method: str, kwargs: Mapping[str, Any]
    ) -> tuple[Any, Callable[[Any, tuple], Any]]:
        """``(variables, call)``: ``call(variables, args)`` runs ``model.method(*args, **kwargs)``.

        ``variables`` is a pytree (a Linen variables dict, an NNX state) that
        ``jax.jit`` can take as an argument. Check ``params`` with
        :meth:`float_tree` first.
        """
        raise NotImplementedError


class _Linen(Flavor):
    name = "linen"

    def path(self, obj: object) -> str | None:
        return module_path.linen_path(obj)

    def get_var(self, module: Any, collection: str, name: str) -> Any:
        scope = module.scope
        if not scope.has_variable(collection, name):
            return None
        raw = scope.get_variable(collection, name)
        return raw.unbox() if hasattr(raw, "unbox") else raw

    def may_update(self, ctx: CallContext, module: Any, collection: str) -> bool:
        return module.scope.is_mutable_collection(collection)

    def put_var(
        self, ctx: CallContext, module: Any, path: str, collection: str, name: str, value: Any
    ) -> None:
        check_linen_trace(module.scope, f"{path}/{name}" if path else name)
        module.scope.put_variable(collection, name, value)

    def make_rng(self, module: Any, collection: str) -> jax.Array:
        return module.make_rng(collection)

    def check_params(self, params: Any) -> None:
        if params is None:
            raise ValueError("a Linen model needs its float params: pass params=...")
        if not isinstance(params, Mapping):
            raise ValueError(
                f"params={type(params).__name__} is not allowed; allowed: the Linen model's "
                "float params collection, a dict like variables['params']"
            )

    def float_tree(self, model: Any, params: Any) -> Any:
        self.check_params(params)
        return params

    def caller(
        self, model: Any, params: Any, method: str, kwargs: Mapping[str, Any]
    ) -> tuple[Any, Callable[[Any, tuple], Any]]:
        def call(variables: Any, args: tuple) -> Any:
            return model.apply(variables, *args, method=method, **kwargs)

        return {"params": self.float_tree(model, params)}, call


class _Nnx(Flavor):
    name = "nnx"

    def path(self, obj: object) -> str | None:
        return module_path.nnx_path(obj)

    def get_var(self, module: Any, collection: str, name: str) -> Any:
        var = getattr(module, name, None)
        return None if var is None else var.get_raw_value()

    def may_update(self, ctx: CallContext, module: Any, collection: str) -> bool:
        return collection == "quant_stats" and ctx.update_stats

    def put_var(
        self, ctx: CallContext, module: Any, path: str, collection: str, name: str, value: Any
    ) -> None:
        if ctx.discovering:
            ctx.put_site_var(path, name, collection, value)
        else:
            getattr(module, name).set_raw_value(value)

    def make_rng(self, module: Any, collection: str) -> jax.Array:
        raise ValueError(
            "stochastic rounding in QtProvider needs a Linen model (rngs="
            f"{{{collection!r}: key}}); NNX models are not supported yet"
        )

    def check_params(self, params: Any) -> None:
        if params is not None:
            raise ValueError(
                "an NNX model carries its own params: pass params=None (got "
                f"{type(params).__name__})"
            )

    def float_tree(self, model: Any, params: Any) -> Any:
        self.check_params(params)
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def caller(
        self, model: Any, params: Any, method: str, kwargs: Mapping[str, Any]
    ) -> tuple[Any, Callable[[Any, tuple], Any]]:
        del params  # checked by float_tree
        module_path.label_nnx(model)
        graphdef, state = nnx.split(model)

        def call(variables: Any, args: tuple) -> Any:
            return getattr(nnx.merge(graphdef, variables), method)(*args, **kwargs)

        return state, call


def check_linen_trace(scope: Any, path: str) -> None:
    """Checks that variable ``path`` of ``scope`` is written at the scope's own trace level.

    Raises:
        ValueError: When the write happens inside a JAX transform that the model
            itself calls (``jax.lax.fori_loop``...): the value would leak its tracer.
    """
    if flax_tracers.current_trace() != scope.trace_level:
        raise ValueError(
            f"{path!r} is created or quantized inside a JAX transform that the model calls "
            "(jax.lax.fori_loop, while_loop, scan, cond, jax.checkpoint...); Flax does not "
            "allow this (the float model's init returns leaked tracers there too). Create the "
            "module's params before the loop (call the module once outside it), or use a Flax "
            "lifted transform (nn.scan, nn.while_loop, nn.remat, nn.cond)"
        )


LINEN: Flavor = _Linen()
NNX: Flavor = _Nnx()


def of(model: Any, name: str = "model") -> Flavor:
    """The flavour of ``model`` (argument ``name``), a Linen or NNX module.

    Raises:
        ValueError: For anything else, naming the argument and its type.
    """
    if isinstance(model, nn.Module):
        return LINEN
    if isinstance(model, nnx.Module):
        return NNX
    raise ValueError(
        f"{name}={type(model).__name__} is neither a flax.linen nor an nnx.Module; allowed: a "
        "flax.linen.Module or an nnx.Module"
    )

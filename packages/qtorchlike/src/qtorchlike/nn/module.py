"""A small stateful module system in PyTorch's shape, holding JAX arrays.

A :class:`Module` registers what is assigned to it: a :class:`Parameter`
becomes a parameter, another module a submodule, :meth:`Module.register_buffer`
adds a buffer (state that is not trained, e.g. running statistics). Names are
dotted paths (``"features.0.weight"``) in :meth:`Module.named_parameters`,
:meth:`Module.state_dict` and :meth:`Module.load_state_dict`.

Arrays are immutable: reading ``module.weight`` gives the current JAX array, and
assigning an array to a registered name replaces it. Training under
``jax.jit``/``jax.grad`` goes through :func:`qtorchlike.func.functional_call`,
which swaps arrays in and out around a forward pass.

Example:
    >>> import jax.numpy as jnp
    >>> from qtorchlike.nn import Module, Parameter
    >>> class Scale(Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gain = Parameter(jnp.ones(3))
    ...         self.register_buffer("calls", jnp.zeros((), jnp.int32))
    ...
    ...     def forward(self, x):
    ...         self.calls = self.calls + 1
    ...         return x * self.gain
    >>> m = Scale()
    >>> m(jnp.arange(3.0)).tolist()
    [0.0, 1.0, 2.0]
    >>> sorted(m.state_dict())
    ['calls', 'gain']
    >>> int(m.calls)
    1
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qtorchlike import config

__all__ = [
    "IncompatibleKeys",
    "Module",
    "Parameter",
    "RemovableHandle",
    "StateDictKeyError",
    "set_state",
]


class ParameterBox:
    """Marks an array as a trainable parameter when assigned to a module attribute.

    Use it as ``Parameter(data)``: for type checkers that call returns an array,
    which is what reading the attribute back gives.

    Args:
        data: The initial value (anything ``jnp.asarray`` accepts).
        requires_grad: ``False`` registers a parameter that optimizers and
            :func:`qtorchlike.func.trainable` leave alone (it is still saved).
    """

    __slots__ = ("data", "requires_grad")

    def __init__(self, data: Any, requires_grad: bool = True) -> None:
        self.data = jnp.asarray(data)
        self.requires_grad = requires_grad

    def __repr__(self) -> str:
        return f"Parameter(shape={tuple(self.data.shape)}, dtype={self.data.dtype})"


if TYPE_CHECKING:

    def Parameter(data: Any, requires_grad: bool = True) -> jax.Array:  # noqa: N802, D103
        ...

else:
    Parameter = ParameterBox


class IncompatibleKeys(NamedTuple):
    """What :meth:`Module.load_state_dict` did not match (as PyTorch returns it)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class RemovableHandle:
    """Returned by hook registration; :meth:`remove` unregisters the hook."""

    _ids = itertools.count()

    def __init__(self, hooks: dict[int, Callable]) -> None:
        self._hooks = hooks
        self.id = next(self._ids)

    def remove(self) -> None:
        """Unregisters the hook (a second call does nothing)."""
        self._hooks.pop(self.id, None)


class Module:
    """Base class of every layer; subclasses define :meth:`forward`.

    Attributes:
        training: ``True`` after :meth:`train`, ``False`` after :meth:`eval`.
    """

    training: bool

    def __init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "training", True)
        set_(self, "_parameters", OrderedDict())
        set_(self, "_frozen", set())
        set_(self, "_buffers", OrderedDict())
        set_(self, "_non_persistent", set())
        set_(self, "_modules", OrderedDict())
        set_(self, "_forward_hooks", OrderedDict())
        set_(self, "_forward_pre_hooks", OrderedDict())

    # -- attribute registration ----------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        if "_parameters" not in d:
            raise AttributeError(
                f"cannot assign {name!r} before Module.__init__() call; call "
                "super().__init__() first in your module's __init__"
            )
        params, buffers, modules = d["_parameters"], d["_buffers"], d["_modules"]
        if isinstance(value, ParameterBox):
            _forget(d, name)
            params[name] = value.data
            (d["_frozen"].discard if value.requires_grad else d["_frozen"].add)(name)
        elif isinstance(value, Module):
            _forget(d, name)
            modules[name] = value
            # Remembered for error messages (the first live owner of a shared module).
            owner = value.__dict__.get("_owner")
            if owner is None or owner[0]() is None:
                value.__dict__["_owner"] = (weakref.ref(self), name)
        elif name in params:
            if value is None:
                raise TypeError(
                    f"cannot assign None to parameter {name!r}; use "
                    f"register_parameter({name!r}, None)"
                )
            params[name] = jnp.asarray(value)
        elif name in buffers:
            buffers[name] = None if value is None else jnp.asarray(value)
        elif name in modules and value is None:
            modules[name] = None
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        for store in ("_parameters", "_buffers", "_modules"):
            if store in d and name in d[store]:
                return d[store][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        for store in ("_parameters", "_buffers", "_modules"):
            if name in self.__dict__[store]:
                del self.__dict__[store][name]
                return
        object.__delattr__(self, name)

    def register_buffer(self, name: str, value: Any, persistent: bool = True) -> None:
        """Adds a buffer: state saved in :meth:`state_dict` but not trained.

        Args:
            name: Attribute name.
            value: An array, or ``None`` for a buffer filled in later.
            persistent: ``False`` keeps it out of :meth:`state_dict`.
        """
        if "." in name or not name:
            raise KeyError(f"buffer name={name!r} must be a non-empty name without '.'")
        self.__dict__["_parameters"].pop(name, None)
        self.__dict__["_buffers"][name] = None if value is None else jnp.asarray(value)
        if not persistent:
            self.__dict__["_non_persistent"].add(name)
        self.__dict__.pop(name, None)

    def register_parameter(self, name: str, param: Any) -> None:
        """Adds a parameter (``None`` removes it, e.g. ``bias=False``)."""
        if param is None:
            self.__dict__["_parameters"].pop(name, None)
            object.__setattr__(self, name, None)
            return
        setattr(self, name, param)

    # -- traversal --------------------------------------------------------------------

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """Yields ``(dotted name, module)`` for this module and every descendant, once each."""
        seen: set[int] = set()
        stack = [(prefix, self)]
        while stack:
            name, module = stack.pop(0)
            if id(module) in seen:
                continue
            seen.add(id(module))
            yield name, module
            for child, sub in module._modules.items():
                if sub is not None:
                    stack.append((f"{name}.{child}" if name else child, sub))

    def modules(self) -> Iterator[Module]:
        """Yields this module and every descendant."""
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[tuple[str, Module]]:
        """Yields ``(name, module)`` for the direct submodules."""
        yield from ((n, m) for n, m in self._modules.items() if m is not None)

    def children(self) -> Iterator[Module]:
        """Yields the direct submodules."""
        yield from (m for _, m in self.named_children())

    def _named(self, store: str, persistent_only: bool = False) -> Iterator[tuple[str, Any]]:
        # Shared submodules (e.g. one quantizer proxy in two layers) appear once,
        # under their first name, as in PyTorch.
        for prefix, module in self.named_modules():
            for name, value in module.__dict__[store].items():
                if value is None or persistent_only and name in module._non_persistent:
                    continue
                yield (f"{prefix}.{name}" if prefix else name), value

    def named_parameters(self) -> Iterator[tuple[str, jax.Array]]:
        """Yields ``(dotted name, array)`` for every parameter."""
        return self._named("_parameters")

    def parameters(self) -> Iterator[jax.Array]:
        """Yields every parameter array."""
        return (v for _, v in self.named_parameters())

    def named_buffers(self) -> Iterator[tuple[str, jax.Array]]:
        """Yields ``(dotted name, array)`` for every buffer."""
        return self._named("_buffers")

    def buffers(self) -> Iterator[jax.Array]:
        """Yields every buffer array."""
        return (v for _, v in self.named_buffers())

    def trainable_names(self) -> list[str]:
        """Dotted names of the parameters that receive gradients (``requires_grad``)."""
        return [
            f"{prefix}.{name}" if prefix else name
            for prefix, module in self.named_modules()
            for name, value in module._parameters.items()
            if value is not None and name not in module._frozen
        ]

    def apply(self, fn: Callable[[Module], Any]) -> Module:
        """Calls ``fn`` on every submodule (children first) and on ``self``."""
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    # -- modes --------------------------------------------------------------------------

    def train(self, mode: bool = True) -> Module:
        """Sets training mode on this module and every descendant; returns ``self``."""
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        """Sets evaluation mode (``train(False)``); returns ``self``."""
        return self.train(False)

    # -- calling and hooks ----------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The computation; every subclass defines it."""
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the forward pre-hooks, :meth:`forward`, then the forward hooks."""
        for hook in list(self._forward_pre_hooks.values()):
            result = hook(self, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
        out = self.forward(*args, **kwargs)
        for hook in list(self._forward_hooks.values()):
            result = hook(self, args, out)
            if result is not None:
                out = result
        return out

    def register_forward_hook(self, hook: Callable[[Module, tuple, Any], Any]) -> RemovableHandle:
        """Calls ``hook(module, args, output)`` after each forward; non-None replaces the output."""
        handle = RemovableHandle(self._forward_hooks)
        self._forward_hooks[handle.id] = hook
        return handle

    def register_forward_pre_hook(self, hook: Callable[[Module, tuple], Any]) -> RemovableHandle:
        """Calls ``hook(module, args)`` before each forward; a non-None result replaces the args."""
        handle = RemovableHandle(self._forward_pre_hooks)
        self._forward_pre_hooks[handle.id] = hook
        return handle

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> OrderedDict[str, jax.Array]:
        """Every parameter and persistent buffer by dotted name (arrays, not copies)."""
        out: OrderedDict[str, jax.Array] = OrderedDict(self._named("_parameters"))
        out.update(self._named("_buffers", persistent_only=True))
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True
    ) -> IncompatibleKeys:
        """Loads arrays by dotted name; all-or-nothing.

        Every key and shape is checked before anything is assigned, so a failed
        load leaves the model unchanged. After loading, each module's
        ``_after_load(loaded_names)`` runs (quantizers use it to re-initialise
        scales from new weights, see :data:`qtorchlike.config.REINIT_ON_STATE_DICT_LOAD`).

        Non-finite weights (NaN, inf) load as they are, as in PyTorch; the weight
        quantizer that quantizes them raises a ValueError naming the parameter.
        Quantizer scales are checked during the load: a learned scale must be
        finite and > 0 (finite if stored as log2), a statistic finite and >= 0. A
        quantizer whose learned scale is re-initialised from the loaded weights
        does so during the load, so there the load fails and loads nothing.

        Args:
            state_dict: Arrays (JAX, NumPy or anything ``jnp.asarray`` takes) by name.
            strict: Require exactly the model's keys. Missing quantizer keys
                (scales, statistics) are tolerated when
                :data:`qtorchlike.config.IGNORE_MISSING_KEYS` is set, so a float
                checkpoint loads into a quantized model.

        Returns:
            The missing and unexpected keys (tolerated quantizer keys are not listed,
            as in Brevitas).

        Raises:
            TypeError: ``state_dict`` is not a mapping, ``strict`` not a bool, a key
                not a str, or a value not an array of numbers (a string, None, a
                dict...); the message names the key and its or the value's type.
            StateDictKeyError: Missing or unexpected keys under ``strict=True`` (a
                KeyError and a RuntimeError); the message lists them and the nearest
                names the model has.
            ValueError: A shape differs from the model's (the message names the key
                and both shapes), a loaded scale is non-finite or not positive (the
                message names the key and the number of bad values), or
                re-initialising a scale from the loaded weights failed (non-finite
                weights).
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"load_state_dict(state_dict={type(state_dict).__name__}): state_dict must be a "
                "mapping of dotted names to arrays (e.g. model.state_dict())"
            )
        if not isinstance(strict, bool):
            raise TypeError(f"load_state_dict(strict={strict!r}): strict must be True or False")
        odd = next((k for k in state_dict if not isinstance(k, str)), None)
        if odd is not None:
            raise TypeError(
                f"load_state_dict: key {odd!r} has type {type(odd).__name__}; allowed: str keys "
                "(dotted names such as '0.weight')"
            )
        own = self.state_dict()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        required = missing
        if config.IGNORE_MISSING_KEYS:
            # Quantizer state (scales, statistics) may be absent: a float checkpoint.
            required = [k for k in missing if not _is_quantizer_state(self, k)]
        if strict and (unexpected or required):
            raise StateDictKeyError(_key_error(required, unexpected, list(own)))
        new = {k: _loadable(k, v, own[k]) for k, v in state_dict.items() if k in own}
        for key, value in new.items():
            module, _, name = locate(self, key)
            check = getattr(module, "_check_load", None)  # quantizers check their scales
            if check is not None:
                check(name, value, key)
        set_state(self, new)
        try:
            for prefix, module in self.named_modules():
                hook = getattr(module, "_after_load", None)
                if hook is not None:
                    mine = {k[len(prefix) + 1 :] if prefix else k for k in new if _under(k, prefix)}
                    hook(mine)
        except ValueError as e:
            set_state(self, own)  # the hooks may have re-initialised scales: undo all
            raise ValueError(f"load_state_dict: {e}; nothing was loaded") from e
        except BaseException:
            set_state(self, own)
            raise
        # As in Brevitas, tolerated quantizer keys are not reported as missing either.
        return IncompatibleKeys(required, unexpected)

    # -- printing ---------------------------------------------------------------------------

    def extra_repr(self) -> str:
        """Extra text inside this module's repr (override in layers)."""
        return ""

    def __repr__(self) -> str:
        lines = [f"({n}): " + repr(m).replace("\n", "\n  ") for n, m in self.named_children()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not lines:
            return head + ")"
        return head + "\n  " + "\n  ".join(lines) + "\n)"


def _forget(d: dict, name: str) -> None:
    """Removes ``name`` from every registry (it is being re-registered as another kind)."""
    for store in ("_parameters", "_buffers", "_modules"):
        d[store].pop(name, None)
    d.pop(name, None)


def _loadable(key: str, value: Any, current: jax.Array) -> jax.Array:
    """``value`` as an array of ``current``'s shape and dtype, or a clear error naming ``key``."""
    arr = value
    if not isinstance(value, jax.Array):
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError):  # ragged lists and the like
            arr = np.asarray(None)
    kind = np.dtype(arr.dtype).kind
    allowed_kinds = "biufc" if np.dtype(current.dtype).kind == "c" else "biuf"
    if kind not in allowed_kinds:
        what = type(value).__name__
        if isinstance(value, np.ndarray | jax.Array) or kind != "O":
            what += f" of dtype {arr.dtype}"
        raise TypeError(
            f"load_state_dict: {key!r} has type {what}; allowed: an array of numbers (jax.Array, "
            f"numpy.ndarray or nested lists) of shape {tuple(current.shape)} that converts to "
            f"the model's {current.dtype}; nothing was loaded"
        )
    if arr.shape != current.shape:
        raise ValueError(
            f"load_state_dict: {key!r} has shape {tuple(arr.shape)} in the checkpoint but "
            f"{tuple(current.shape)} in the model; nothing was loaded"
        )
    return jnp.asarray(arr).astype(current.dtype)


def path_of(module: Module) -> str:
    """The dotted name under which ``module`` was first assigned, from its outermost owner.

    Used in error messages (``"0.act_quant"``); ``""`` for a module that was never
    assigned to another.
    """
    parts: list[str] = []
    seen: set[int] = set()
    while id(module) not in seen:
        seen.add(id(module))
        ref, name = module.__dict__.get("_owner", (None, ""))
        parent = ref() if ref is not None else None
        if parent is None or parent._modules.get(name) is not module:
            break
        parts.append(name)
        module = parent
    return ".".join(reversed(parts))


def _is_quantizer_state(model: Module, key: str) -> bool:
    return getattr(locate(model, key)[0], "is_quantizer", False)


def _under(key: str, prefix: str) -> bool:
    return not prefix or key.startswith(prefix + ".")


class StateDictKeyError(KeyError, RuntimeError):
    """``load_state_dict(strict=True)`` found missing or unexpected keys.

    A KeyError, and a RuntimeError like PyTorch's, so Brevitas code that catches
    either keeps working.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _key_error(missing: list[str], unexpected: list[str], own: list[str]) -> str:
    import difflib

    parts = ["load_state_dict(strict=True) found a key mismatch; nothing was loaded."]
    if missing:
        parts.append(f"Missing keys: {missing}.")
    if unexpected:
        near = {k: difflib.get_close_matches(k, own, n=2) for k in unexpected}
        hints = "; ".join(f"{k!r} (did you mean {v}?)" for k, v in near.items() if v)
        parts.append(f"Unexpected keys: {unexpected}." + (f" {hints}" if hints else ""))
    parts.append(
        "Pass strict=False to load what matches, or set qtorchlike.config.IGNORE_MISSING_KEYS "
        "(environment variable QTORCHLIKE_IGNORE_MISSING_KEYS=1) to tolerate missing "
        "quantizer keys (loading a float checkpoint)."
    )
    return " ".join(parts)


def locate(model: Module, key: str) -> tuple[Module, str, str]:
    """Returns ``(module, store, name)`` for a dotted parameter or buffer name.

    Raises:
        KeyError: If no parameter or buffer has that name.
    """
    *path, name = key.split(".")
    module = model
    for part in path:
        sub = module._modules.get(part)
        if sub is None:
            raise KeyError(f"{key!r}: {type(module).__name__} has no submodule {part!r}")
        module = sub
    for store in ("_parameters", "_buffers"):
        if name in module.__dict__[store]:
            return module, store, name
    raise KeyError(f"{key!r}: {type(module).__name__} has no parameter or buffer {name!r}")


def set_state(model: Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """Assigns arrays by dotted name without checks; returns the previous values.

    Used by :meth:`Module.load_state_dict` (after its checks) and by
    :func:`qtorchlike.func.functional_call` (which restores the old values).

    Raises:
        KeyError: If a name is neither a parameter nor a buffer (nothing is assigned).
    """
    located = {key: locate(model, key) for key in state}
    old = {}
    for key, (module, store, name) in located.items():
        old[key] = module.__dict__[store][name]
        module.__dict__[store][name] = state[key]
    return old

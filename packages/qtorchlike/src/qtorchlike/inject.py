"""Quantizers declared as classes: attributes merge along the MRO, like Brevitas' injectors.

A quantizer is a subclass of :class:`ExtendedInjector` whose class attributes
describe it (``bit_width = 8``, ``scaling_per_output_channel = True``, ...).
Inheritance and mixins compose them: Python's MRO decides which definition of
an attribute wins. Three kinds of attribute are computed when read:

* a function decorated with :func:`value` is called with the attributes named
  by its parameters (dependency injection by argument name);
* ``this.name`` refers to another attribute of the same quantizer;
* anything else is returned as is.

``Quantizer.let(**overrides)`` returns a subclass with some attributes replaced;
layers use it for prefixed keyword arguments (``weight_bit_width=4``).

Example:
    >>> from qtorchlike.inject import ExtendedInjector, this, value
    >>> class Base(ExtendedInjector):
    ...     bit_width = 8
    ...     narrow_range = True
    ...
    ...     @value
    ...     def int_max(bit_width, narrow_range):
    ...         return 2 ** (bit_width - 1) - 1
    >>> class Four(Base):
    ...     bit_width = 4
    ...     alias = this.int_max
    >>> Four.int_max, Four.alias, Four.let(bit_width=2).int_max
    (7, 7, 1)
    >>> Four.bit_widht  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    qtorchlike.inject.DependencyError: Four has no attribute 'bit_widht' ...'bit_width'?
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any


class DependencyError(AttributeError):
    """An injector attribute that cannot be resolved; the message shows the chain."""


class _Value:
    """A function whose parameters are resolved as attributes of the injector."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.params = tuple(inspect.signature(fn).parameters.values())

    def __repr__(self) -> str:
        return f"value({self.fn.__name__})"


def value(fn: Callable[..., Any]) -> Any:
    """Marks ``fn`` as a computed attribute; its arguments are injected by name.

    A parameter with a default takes the default when the quantizer has no
    attribute of that name.
    """
    return _Value(fn)


class _This:
    """``this.a.b``: the attribute ``a`` of the same quantizer, then ``.b`` of it."""

    _path: tuple[str, ...]

    def __init__(self, path: tuple[str, ...] = ()) -> None:
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str) -> _This:
        if name.startswith("__"):
            raise AttributeError(name)
        return _This((*self._path, name))

    def __repr__(self) -> str:
        return "this." + ".".join(self._path)


this: Any = _This()
"""Refers to an attribute of the quantizer being resolved (``this.bit_width``)."""

_MISSING = object()
# Names that belong to the class machinery, never to the quantizer description.
_RESERVED = frozenset({"let", "resolve", "attributes", "mro"})


def _raw(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return _MISSING


def _public_names(cls: type) -> list[str]:
    names = {n for k in cls.__mro__ if k is not object for n in k.__dict__}
    return sorted(n for n in names if not n.startswith("_") and n not in _RESERVED)


def resolve(cls: type, name: str, chain: tuple[str, ...] = (), *, instantiate: bool = True) -> Any:
    """Resolves attribute ``name`` of injector ``cls``, following ``@value`` and ``this``.

    An attribute that is (or a ``@value`` function that returns) an implementation
    class of :mod:`qtorchlike.core` (``tensor_quant = BinaryQuant``) is
    instantiated, its constructor's arguments resolved by name like a ``@value``
    function's (Brevitas' auto-wiring); ``instantiate=False`` returns the class.
    A ``@value`` function that returns ``this.name`` resolves that attribute too.

    Raises:
        DependencyError: If the attribute (or one it depends on) does not exist,
            or the dependencies form a cycle. The message shows the chain of
            attributes being resolved and the nearest existing names.
    """
    where = " -> ".join(f"{cls.__name__}.{n}" for n in (*chain, name))
    if name in chain:
        raise DependencyError(f"{cls.__name__}: circular dependency {where}")
    raw = _raw(cls, name)
    if raw is _MISSING and name == "tensor_quant" and instantiate and has(cls, "quant_type"):
        # A quantizer described by enums (qtorchlike.quant's): built as a module too.
        from qtorchlike.core import tensor_quant_of  # noqa: PLC0415 - import cycle

        return tensor_quant_of(cls)
    if raw is _MISSING:
        near = difflib.get_close_matches(name, _public_names(cls), n=3)
        hint = f"; did you mean {' or '.join(map(repr, near))}?" if near else ""
        raise DependencyError(f"{cls.__name__} has no attribute {name!r} (resolving {where}){hint}")
    out = _evaluate(cls, raw, (*chain, name))
    if instantiate and isinstance(out, type) and getattr(out, "_injectable", False):
        return _construct(cls, out, (*chain, name))
    return out


def _inject(cls: type, params: Any, chain: tuple[str, ...]) -> dict[str, Any]:
    """Keyword arguments for ``params``: each resolved by name; a default when missing."""
    kwargs = {}
    for p in params:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if p.default is not inspect.Parameter.empty and _raw(cls, p.name) is _MISSING:
            continue
        kwargs[p.name] = resolve(cls, p.name, chain)
    return kwargs


def _construct(cls: type, impl: type, chain: tuple[str, ...]) -> Any:
    params = list(inspect.signature(impl).parameters.values())
    return impl(**_inject(cls, params, chain))


def _evaluate(cls: type, raw: Any, chain: tuple[str, ...]) -> Any:
    if isinstance(raw, _This):
        head, *rest = raw._path
        out = resolve(cls, head, chain)
        for attr in rest:
            out = getattr(out, attr)
        return out
    if isinstance(raw, _Value):
        out = raw.fn(**_inject(cls, raw.params, chain))
        # Brevitas' ExtendedInjector: a value function may return this.<name>.
        return _evaluate(cls, out, chain) if isinstance(out, _This) else out
    return raw


class _InjectorMeta(type):
    def __getattribute__(cls, name: str) -> Any:
        if name.startswith("_") or name in _RESERVED:
            return super().__getattribute__(name)
        return resolve(cls, name)

    def __repr__(cls) -> str:
        return f"<quantizer {cls.__name__}>"


class ExtendedInjector(metaclass=_InjectorMeta):
    """Base class of quantizer definitions (see the module docstring)."""

    @classmethod
    def let(cls, **overrides: Any) -> type[ExtendedInjector]:
        """A subclass with ``overrides`` as attributes (functions stay plain values)."""
        return type(cls.__name__, (cls,), dict(overrides))

    @classmethod
    def attributes(cls) -> list[str]:
        """Every attribute name this quantizer defines or inherits."""
        return _public_names(cls)

    def __init__(self) -> None:
        raise TypeError(
            f"{type(self).__name__} is a quantizer definition; pass the class itself "
            "(e.g. weight_quant=Int8WeightPerTensorFloat), do not instantiate it"
        )


def has(cls: type, name: str) -> bool:
    """Whether injector ``cls`` defines or inherits ``name``."""
    return _raw(cls, name) is not _MISSING

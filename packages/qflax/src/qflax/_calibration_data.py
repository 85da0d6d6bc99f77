"""The calibration-input value that every qflax algorithm takes first.

:class:`CalibrationData` holds a model, its float params (Linen) and the batches
an algorithm runs it on, checked once when it is made. :func:`accepts_legacy`
keeps the older form of the algorithms, ``f(model, params, [rules,] batches,
method=...)``, working with a ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any, TypeVar, cast

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from qflax._engine import flavor as flavors

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True, eq=False)
class CalibrationData:
    """A model and the inputs a calibration algorithm runs it on.

    Every algorithm that runs a model on data takes one as its first argument:
    :func:`qflax.layer_stats.collect`, :func:`qflax.gptq.gptq`,
    :func:`qflax.awq.awq`, :func:`qflax.smoothquant.smoothquant`,
    :func:`qflax.report.quantization_report`,
    :func:`qflax.mixed_precision.mixed_precision` and
    :func:`qflax.presets.four_bit`. The arguments are checked here, once.

    Attributes:
        model: A Linen module (unbound) or an NNX module (not modified).
        params: Linen: the float ``params`` collection (boxed or not). NNX: None
            (the model's own params are used).
        batches: An iterable of model inputs; a tuple is passed as positional
            arguments, anything else as the single argument. A list can serve
            several algorithms; an iterator (a generator) is read once, and a
            second use raises. None: no batches (an algorithm given ``stats=``
            does not need them).
        method: The name of the model method the batches are inputs of.
        kwargs: Keyword arguments passed on every call besides each batch's
            positional ones (e.g. ``{"deterministic": True}``).

    Raises:
        ValueError: A model that is neither Linen nor NNX; params missing (Linen)
            or given (NNX); ``batches`` that is one array or not iterable; a
            ``method`` the model does not have. Each message names the argument,
            its value and what is allowed.

    Example:
        >>> import flax.linen as nn, jax, jax.numpy as jnp
        >>> import qflax
        >>> model = nn.Dense(3)
        >>> params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
        >>> data = qflax.CalibrationData(model, params, [jnp.ones((2, 4))])
        >>> [args[0].shape for args in data.inputs()]
        [(2, 4)]
        >>> qflax.CalibrationData(model, None, [jnp.ones((2, 4))])
        Traceback (most recent call last):
        ...
        ValueError: a Linen model needs its float params: pass params=...
        >>> qflax.CalibrationData(model, params, jnp.ones((2, 4)))
        Traceback (most recent call last):
        ...
        ValueError: batches must be an iterable of batches (...), not one array of shape (2, 4)
    """

    model: Any
    params: Any = dataclasses.field(default=None, repr=False)
    batches: Iterable[Any] | None = dataclasses.field(default=None, repr=False)
    method: str = "__call__"
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    _read: list[bool] = dataclasses.field(default_factory=list, init=False, repr=False)
    # How error messages name the batches: the argument the caller wrote.
    _arg: str = dataclasses.field(default="data.batches", init=False, repr=False)

    def __post_init__(self) -> None:
        flavor = flavors.of(self.model)
        flavor.check_params(self.params)
        _check_method(self.model, self.method)
        if not (isinstance(self.kwargs, Mapping) and all(isinstance(k, str) for k in self.kwargs)):
            raise ValueError(
                f"kwargs={self.kwargs!r} is not allowed; allowed: a dict of keyword arguments "
                "of the method, e.g. {'deterministic': True}"
            )
        _check_batches(self.batches, "batches")

    def __repr__(self) -> str:
        n = self.num_batches
        batches = "None" if self.batches is None else "an iterator" if n is None else f"{n}"
        return (
            f"CalibrationData(model={type(self.model).__name__}, params="
            f"{'None' if self.params is None else 'given'}, batches={batches}, "
            f"method={self.method!r}" + (f", kwargs={dict(self.kwargs)!r})" if self.kwargs else ")")
        )

    def float_tree(self) -> Any:
        """The float params as a tree (Linen: ``params``, boxed or not; NNX: the model's own)."""
        return flavors.of(self.model).float_tree(self.model, self.params)

    @property
    def num_batches(self) -> int | None:
        """How many batches there are, if ``batches`` has a length (else None)."""
        return len(self.batches) if isinstance(self.batches, Sized) else None

    def inputs(self) -> Iterator[tuple]:
        """Each batch as a tuple of positional arguments, in order.

        Raises:
            ValueError: No batches (``batches=None``, or none left in an
                iterator that an earlier call read).
        """
        if self.batches is None:
            raise ValueError(
                f"no calibration data: {self._arg}=None; pass an iterable of model inputs, e.g. "
                "qflax.CalibrationData(model, params, [x1, x2])"
            )
        if iter(self.batches) is self.batches and self._read:
            raise ValueError(
                f"no calibration data: {self._arg} is an iterator that an earlier call already "
                "read (also when that call failed); pass a list to use the same batches in "
                "several algorithms"
            )
        self._read.append(True)
        for b in self.batches:
            yield b if isinstance(b, tuple) else (b,)

    def with_batches(self, batches: Iterable[Any] | None) -> CalibrationData:
        """The same model, params and method with other batches."""
        out = CalibrationData(self.model, self.params, batches, self.method, self.kwargs)
        object.__setattr__(out, "_arg", self._arg)
        return out


def _check_batches(b: Any, name: str) -> None:
    """Raises unless ``b`` (argument ``name``) is None or an iterable of batches."""
    if isinstance(b, jax.Array | np.ndarray):
        raise ValueError(
            f"{name} must be an iterable of batches (e.g. [x], or a list of tuples of "
            f"positional inputs), not one array of shape {b.shape}"
        )
    if isinstance(b, tuple) and any(isinstance(x, jax.Array | np.ndarray) for x in b):
        raise ValueError(
            f"{name} is a tuple of {len(b)} arrays, which is ambiguous: pass [(x, y)] for one "
            "batch of several positional inputs, or a list [x1, x2] for several batches"
        )
    if b is not None and (isinstance(b, str | bytes | dict) or not isinstance(b, Iterable)):
        raise ValueError(
            f"{name}={type(b).__name__} is not allowed; allowed: an iterable of model inputs "
            "(a list, a generator), or None"
        )


def _check_method(model: Any, method: Any) -> None:
    """Raises unless ``method`` names a method of ``model``, suggesting close names."""
    if isinstance(method, str) and callable(getattr(model, method, None)):
        return
    kind = type(model).__name__
    if not isinstance(method, str):
        raise ValueError(
            f"method={method!r} is not allowed; allowed: the name (a str) of a method of "
            f"{kind}, e.g. '__call__'"
        )
    cls = type(model)
    names = [n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n, None))]
    close = difflib.get_close_matches(method, names, n=3)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ", e.g. '__call__'"
    raise ValueError(
        f"method={method!r} is not a method of {kind}; allowed: the name of one of its "
        f"methods{hint}"
    )


def _looks_like_rules(x: Any) -> bool:
    """Whether ``x`` is a sequence of rules (objects with a ``module_path``)."""
    return isinstance(x, list | tuple) and bool(x) and hasattr(x[0], "module_path")


def check(data: Any, name: str = "data") -> CalibrationData:
    """``data`` if it is a :class:`CalibrationData`.

    Raises:
        ValueError: Naming the argument, its type and how to make one.
    """
    if not isinstance(data, CalibrationData):
        raise ValueError(
            f"{name}={type(data).__name__} is not allowed; allowed: a qflax.CalibrationData, "
            "e.g. qflax.CalibrationData(model, params, batches)"
        )
    return data


def accepts_legacy(*, lead: int = 0, between: int = 1, batches: str = "calibration_batches"):
    """Lets ``fn(*lead, data, *between, ...)`` also be called the older way, with a warning.

    The older form is ``fn(*lead, model, params, *between, batches, ...,
    method=...)``; it is recognised by a Linen or NNX module where ``data`` goes
    (or a ``model=`` keyword), turned into a :class:`CalibrationData` and warned
    about with a ``DeprecationWarning`` that shows the new call.

    Args:
        lead: Positional arguments before ``data`` (``self``, ``stats``).
        between: Positional arguments between ``params`` and the batches in
            the older form (the rules: 1; none: 0).
        batches: The older form's keyword for the batches.
    """

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            first = args[lead] if len(args) > lead else kwargs.get("model")
            if not isinstance(first, nn.Module | nnx.Module):
                return fn(*args, **kwargs)
            name = fn.__qualname__.replace(".__init__", "")
            warnings.warn(
                f"{fn.__module__}.{name}(model, params, ..., {batches}, method=...) is "
                f"deprecated; pass one qflax.CalibrationData(model, params, {batches}, "
                f"method=...) in their place",
                DeprecationWarning,
                stacklevel=2,
            )
            head, rest = list(args[:lead]), list(args[lead:])
            if between and len(rest) == 2 and _looks_like_rules(rest[1]):
                raise ValueError(
                    f"{name}: got a model where the data goes; pass "
                    "qflax.CalibrationData(model, params, batches) as its first argument"
                )
            model = rest.pop(0) if rest else kwargs.pop("model")
            params = rest.pop(0) if rest else kwargs.pop("params", None)
            middle = [rest.pop(0) for _ in range(min(between, len(rest)))]
            data_batches = rest.pop(0) if rest else kwargs.pop(batches, None)
            if rest:
                raise TypeError(
                    f"{name}() takes its options as keywords after {batches}; got "
                    f"{len(rest)} more positional argument(s): {rest!r}"
                )
            method = kwargs.pop("method", "__call__")
            _check_batches(data_batches, batches)
            data = CalibrationData(model, params, data_batches, method)
            object.__setattr__(data, "_arg", batches)
            return fn(*head, data, *middle, **kwargs)

        return cast(_F, call)

    return wrap

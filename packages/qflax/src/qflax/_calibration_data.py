"""The calibration-input value that every qflax algorithm takes first.

:class:`CalibrationData` holds a model, its float params (Linen) and the batches
an algorithm runs it on, checked once when it is made. :func:`accepts_legacy`
keeps the older form of the algorithms, ``f(model, params, [rules,] batches,
method=...)``, working with a ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Sized
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
    params: Any = None
    batches: Iterable[Any] | None = None
    method: str = "__call__"
    _read: list[bool] = dataclasses.field(default_factory=list, init=False, repr=False)
    # How error messages name the batches: the argument the caller wrote.
    _arg: str = dataclasses.field(default="data.batches", init=False, repr=False)

    def __post_init__(self) -> None:
        flavor = flavors.of(self.model)
        flavor.check_params(self.params)
        if not (isinstance(self.method, str) and callable(getattr(self.model, self.method, None))):
            raise ValueError(
                f"method={self.method!r} is not a method of {type(self.model).__name__}; "
                "allowed: the name of one of its methods, e.g. '__call__'"
            )
        _check_batches(self.batches, "batches")

    @property
    def flavor(self) -> flavors.Flavor:
        """The model's :class:`~qflax._engine.flavor.Flavor` (Linen or NNX)."""
        return flavors.of(self.model)

    def float_tree(self) -> Any:
        """The float params as a tree (Linen: ``params``; NNX: the model's own)."""
        return self.flavor.float_tree(self.model, self.params)

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
                "read; pass a list to use the same batches in several algorithms"
            )
        self._read.append(True)
        for b in self.batches:
            yield b if isinstance(b, tuple) else (b,)

    def with_batches(self, batches: Iterable[Any] | None) -> CalibrationData:
        """The same model, params and method with other batches."""
        out = CalibrationData(self.model, self.params, batches, self.method)
        object.__setattr__(out, "_arg", self._arg)
        return out


def _check_batches(b: Any, name: str) -> None:
    """Raises unless ``b`` (argument ``name``) is None or an iterable of batches."""
    if isinstance(b, jax.Array | np.ndarray):
        raise ValueError(
            f"{name} must be an iterable of batches (e.g. [x], or a list of tuples of "
            f"positional inputs), not one array of shape {b.shape}"
        )
    if b is not None and (isinstance(b, str | bytes | dict) or not isinstance(b, Iterable)):
        raise ValueError(
            f"{name}={type(b).__name__} is not allowed; allowed: an iterable of model inputs "
            "(a list, a generator), or None"
        )


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
            head, rest = list(args[:lead]), list(args[lead:])
            model = rest.pop(0) if rest else kwargs.pop("model")
            params = rest.pop(0) if rest else kwargs.pop("params", None)
            middle = [rest.pop(0) for _ in range(min(between, len(rest)))]
            data_batches = rest.pop(0) if rest else kwargs.pop(batches, None)
            method = kwargs.pop("method", "__call__")
            _check_batches(data_batches, batches)
            data = CalibrationData(model, params, data_batches, method)
            object.__setattr__(data, "_arg", batches)
            name = fn.__qualname__.replace(".__init__", "")
            warnings.warn(
                f"{fn.__module__}.{name}(model, params, ..., {batches}, method=...) is "
                f"deprecated; pass one qflax.CalibrationData(model, params, {batches}, "
                f"method=...) in their place",
                DeprecationWarning,
                stacklevel=2,
            )
            return fn(*head, data, *middle, *rest, **kwargs)

        return cast(_F, call)

    return wrap

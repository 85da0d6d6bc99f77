"""Module paths of the ops in a jaxpr, for Linen and NNX models alike.

Rules and error messages name the module that computes an op. A jaxpr records
it in each equation's name stack. Linen pushes a named scope for every module
call (``Net/blk/proj``: the root class, then the path); NNX pushes none, so
:func:`module_scopes` adds the same scopes while a function is traced: for every
call of a method of an NNX module (other than the module already on top), it
enters ``jax.named_scope`` with the attribute path under which the caller holds
the module (``layers/0``; the class name for the root). It uses a thread-local
profile hook, so neither the modules nor their classes are changed and other
threads are unaffected.

:func:`module_path` turns a name stack into the ``/``-joined path that a
:class:`qlitert.Rule` matches (the root's name dropped), the same path qflax's
rules match. :class:`SiteKey` names a quantization site by its order, its op and
its name stack.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from qlitert import scopes
    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.head = nnx.Linear(3, 2, rngs=rngs)
    ...
    ...     def __call__(self, x):
    ...         return self.head(x)
    >>> net = Net(nnx.Rngs(0))
    >>> with scopes.module_scopes():
    ...     jaxpr = jax.make_jaxpr(net)(jnp.ones((1, 3)))
    >>> eqn = jaxpr.jaxpr.eqns[0]
    >>> str(eqn.primitive), scopes.module_path(eqn.source_info.name_stack)
    ('dot_general', 'head')
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import jax
from flax import nnx


def module_path(name_stack: Any) -> str:
    """The module path of a name stack: ``"Net/blk/proj"`` → ``"blk/proj"``."""
    parts = [p for p in str(name_stack).split("/") if p]
    return "/".join(parts[1:])


@dataclasses.dataclass(frozen=True)
class SiteKey:
    """The name of a quantization site: where a function's computation is quantized.

    ``str(key)`` (``"<index>:<label>@<name stack>"``) is the site's key in
    :attr:`qlitert.Calibration.ranges`, in its :meth:`~qlitert.Calibration.state`
    and in messages; :meth:`parse` reads such a key back.

    Attributes:
        index: The order in which the function computes the site (from 0).
        label: What is quantized: the op (``"add"``, ``"dot_general.lhs"``...),
            ``"input0"``, ``"output0"``...
        name_stack: The JAX name stack of the op (``"Net/blk/proj"``), ``""`` at
            the function's boundary.

    Example:
        >>> from qlitert import SiteKey
        >>> key = SiteKey.parse("3:add@Net/blk")
        >>> key.index, key.label, key.module_path, key.scopes
        (3, 'add', 'blk', ('Net', 'blk'))
        >>> str(SiteKey(0, "input0"))
        '0:input0@'
    """

    index: int
    label: str
    name_stack: str = ""

    def __str__(self) -> str:
        """The key as the calibration shows it: ``"<index>:<label>@<name stack>"``."""
        return f"{self.index}:{self.label}@{self.name_stack}"

    @property
    def module_path(self) -> str:
        """The path of the module that computes the site (:func:`module_path`)."""
        return module_path(self.name_stack)

    @property
    def scopes(self) -> tuple[str, ...]:
        """The named scopes of :attr:`name_stack`, outermost first."""
        return tuple(p for p in self.name_stack.split("/") if p)

    @classmethod
    def parse(cls, key: str) -> SiteKey:
        """The :class:`SiteKey` whose ``str`` is ``key``.

        Raises:
            ValueError: If ``key`` is not ``"<index>:<label>@<name stack>"``.
        """
        index, colon, rest = str(key).partition(":")
        label, at, stack = rest.partition("@")
        if not (colon and at and label and index.isdigit()):
            raise ValueError(
                f"key={key!r} is not a site key; allowed: '<index>:<label>@<name stack>', "
                "e.g. '3:add@Net/blk' (the keys of Calibration.ranges)"
            )
        return cls(int(index), label, stack)


def _attribute_path(parent: object, child: object) -> str:
    """The attribute (``name`` or ``name/index``) under which ``parent`` holds ``child``."""
    for name, value in vars(parent).items():
        if value is child:
            return name
        if isinstance(value, (list, tuple, nnx.List)):
            for i, item in enumerate(value):
                if item is child:
                    return f"{name}/{i}"
    return type(child).__name__  # held elsewhere (e.g. a closure): name it by its class


class _Profiler:
    """A ``sys.setprofile`` hook that enters a named scope per NNX module call."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.stack: list[tuple[FrameType, object, Any]] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.previous is not None:
            self.previous(frame, event, arg)
        if event == "call":
            code = frame.f_code
            if not code.co_argcount or code.co_varnames[0] != "self":
                return
            module = frame.f_locals.get("self")
            if not isinstance(module, nnx.Module):
                return
            if self.stack and self.stack[-1][1] is module:
                return  # a method calling another method of the same module
            name = _attribute_path(self.stack[-1][1], module) if self.stack else None
            scope = jax.named_scope(name or type(module).__name__)
            scope.__enter__()
            self.stack.append((frame, module, scope))
        elif event == "return" and self.stack and self.stack[-1][0] is frame:
            self.stack.pop()[2].__exit__(None, None, None)

    def close(self) -> None:
        while self.stack:
            self.stack.pop()[2].__exit__(None, None, None)


@contextlib.contextmanager
def module_scopes() -> Iterator[None]:
    """While active (this thread only), NNX module calls push named scopes."""
    profiler = _Profiler(sys.getprofile())
    sys.setprofile(profiler)
    try:
        yield
    finally:
        sys.setprofile(profiler.previous)
        profiler.close()

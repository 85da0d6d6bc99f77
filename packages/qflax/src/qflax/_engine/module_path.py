"""Finding the module that called an intercepted op, as a ``/``-joined path.

Both Flax APIs are served by one mechanism: walk the Python call stack from the
op outwards and take the first frame whose ``self`` is a module with a known
path. Linen modules know their own path (``module.path``, e.g.
``("encoder", "layers_0")``); NNX modules do not, so :func:`label_nnx` stores each
module's path in the module first (list indices included, e.g.
``layers/0/linear``) and :func:`nnx_path` reads it back. The stack is walked only
while tracing, so the cost is paid once per compiled model, not per step.

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> from qflax._engine import interception, module_path
    >>> class Net(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(2, name="head")(x)
    >>> seen = []
    >>> def handler(name, original, args, kwargs):
    ...     seen.append((name, module_path.calling_module_path(module_path.linen_path)))
    ...     return original(*args, **kwargs)
    >>> params = Net().init(jax.random.key(0), jnp.ones((1, 3)))
    >>> with interception.intercept(handler):
    ...     _ = Net().apply(params, jnp.ones((1, 3)))
    >>> seen
    [('dot_general', 'head')]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
from flax import nnx

Resolver = Callable[[object], str | None]


def linen_path(obj: object) -> str | None:
    """The path of a bound Linen module (``""`` for the root), or None for anything else."""
    if isinstance(obj, nn.Module) and obj.scope is not None:
        return "/".join(str(p) for p in obj.path)
    return None


def calling_module(resolver: Resolver, *, skip: int = 1) -> tuple[object, str] | None:
    """The innermost module on the call stack and its path, or None if there is none.

    Args:
        resolver: ``obj -> path | None`` (:func:`linen_path` or :func:`nnx_path`).
        skip: Frames to skip (this function's caller is frame 1).
    """
    frame = sys._getframe(skip)  # noqa: SLF001 - the stack is the only record of the caller
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None:
            path = resolver(obj)
            if path is not None:
                return obj, path
        frame = frame.f_back
    return None


def calling_module_path(resolver: Resolver, *, skip: int = 1) -> str | None:
    """The path of the innermost module on the call stack, or None if there is none.

    Args:
        resolver: As in :func:`calling_module`.
        skip: Frames to skip (this function's caller is frame 1).
    """
    found = calling_module(resolver, skip=skip + 1)
    return None if found is None else found[1]


PATH_ATTRIBUTE = "_qflax_path"


def label_nnx(model: nnx.Module) -> None:
    """Stores each module's path in the module (attribute ``_qflax_path``).

    The path is static data of the graph, so it survives ``nnx.split`` /
    ``nnx.merge`` and reaches the fresh module objects that ``nnx.jit``,
    ``nnx.scan`` and ``nnx.vmap`` build, where object identities would not be
    recognised. A module reachable by several paths keeps the first.
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model={type(model).__name__} is not an nnx.Module")
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and not hasattr(node, PATH_ATTRIBUTE):
            setattr(node, PATH_ATTRIBUTE, "/".join(str(p) for p in path))


def nnx_path(obj: object) -> str | None:
    """The path :func:`label_nnx` stored in an NNX module, or None."""
    return getattr(obj, PATH_ATTRIBUTE, None) if isinstance(obj, nnx.Module) else None


def find_nnx(model: nnx.Module, path: str) -> Any:
    """The submodule of ``model`` at the ``/``-joined ``path`` (``""``: the model)."""
    node: Any = model
    for part in path.split("/") if path else ():
        node = getattr(node, part) if hasattr(node, part) else node[int(part)]
    return node

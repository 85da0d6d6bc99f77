"""Interception of the JAX ops a model calls, during one call, on one thread.

The contract::

    with intercept(handler):
        out = model_call(...)

Inside the block, on the calling thread only, every call of ``lax.dot_general``,
``jnp.einsum``, ``jnp.dot``, ``jnp.matmul`` (and so the ``@`` operator),
``lax.conv_general_dilated``, ``lax.ragged_dot``, ``jnp.take`` and array indexing
(``x[idx]``, ``x.at[idx].get()``; both reported as ``"take"``) becomes
``handler(op_name, original, args, kwargs)``, whose return value is the op's
result (``original(*args, **kwargs)`` runs the unmodified op). Ops called while a
handler runs (e.g. the ``dot_general`` inside ``einsum``, or qcore's own ops) are
not intercepted again, so each user-level op is seen once, under its own name.
Other threads, code outside the block, and Pallas kernels (traced inside
``pallas_call``) run the unmodified ops.

A second, optional handler sees how values reach the ops::

    with intercept(handler, values=value_handler):
        ...

``value_handler(name, original, args, kwargs)`` receives, under the names in
:data:`VALUE_NAMES`, the reads and writes of model variables (``linen_get_variable`` /
``linen_put_variable``: ``flax.core.scope.Scope.get_variable`` / ``put_variable``;
``nnx_get_value``:
``nnx.Variable.get_value``) and the transforms a module applies to a weight
before the op (``convert_element_type``, ``reshape``, ``transpose``), and returns
their result. Providers use it to hand modules a stand-in for a quantized weight
and to recognise that stand-in (cast or reshaped) when it reaches an op. Value
calls made inside either handler are not reported.

How (and why it does not depend on JAX's trace cache): each op function gets its
code object replaced, once, by a trampoline with the same signature that consults
a thread-local handler, so every alias of the function (``nn.Dense``'s default
``dot_general``, ``jax.lax.dot_general``, ``jnp.einsum``'s internal reference)
sees it. ``jnp.matmul``, ``jnp.dot`` and ``einsum``'s inner ``dot_general`` run
inside jitted wrappers whose cached traces would skip any Python-level hook, so
the block runs under ``jax.disable_jit()``: the wrappers' Python bodies run every
time, while an outer ``jax.jit`` around the model call still compiles the whole
model into one computation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import scope as _scope
from flax.typing import MISSING, Missing
from jax._src.lax import convolution as _convolution
from jax._src.lax import lax as _lax
from jax._src.numpy import indexing as _indexing

Handler = Callable[[str, Callable[..., Any], tuple, dict], Any]

OP_NAMES: tuple[str, ...] = (
    "dot_general",
    "einsum",
    "dot",
    "matmul",
    "conv_general_dilated",
    "ragged_dot",
    "take",
)
# The ops a rule applies to unless it names others: every contraction and
# convolution. Table lookups ("take": ``jnp.take``, as ``nn.Embed`` calls it, and
# indexing ``table[ids]``) are quantized only by rules that name them, so existing
# rules keep tables float.
DEFAULT_OP_NAMES: tuple[str, ...] = OP_NAMES[:-1]
VALUE_NAMES: tuple[str, ...] = (
    "linen_get_variable",
    "linen_put_variable",
    "nnx_get_value",
    "convert_element_type",
    "reshape",
    "transpose",
)

_DISPATCH = "__qflax_intercept__"
_state = threading.local()
_install_lock = threading.Lock()
_originals: list[tuple[str, Callable[..., Any]]] = []


def _targets() -> list[tuple[str, types.FunctionType]]:
    """(op name, Python function) pairs whose code is replaced."""

    def python_function(f: Any) -> types.FunctionType:
        f = getattr(f, "__wrapped__", f)  # jnp.matmul / jnp.dot are jit wrappers
        if not isinstance(f, types.FunctionType):
            raise TypeError(f"cannot intercept {f!r}: not a Python function")
        return f

    targets = [
        ("dot_general", python_function(_lax.dot_general)),
        ("ragged_dot", python_function(_lax.ragged_dot)),
        ("conv_general_dilated", python_function(_convolution.conv_general_dilated)),
        ("einsum", python_function(jnp.einsum)),
        ("matmul", python_function(jnp.matmul)),
        ("dot", python_function(jnp.dot)),
        ("take", python_function(jnp.take)),
        ("take", python_function(_indexing.rewriting_take)),
        ("linen_get_variable", python_function(_scope.Scope.get_variable)),
        ("linen_put_variable", python_function(_scope.Scope.put_variable)),
        ("nnx_get_value", python_function(nnx.Variable.get_value)),
        ("convert_element_type", python_function(_lax._convert_element_type)),
        ("reshape", python_function(_lax.reshape)),
        ("transpose", python_function(_lax.transpose)),
    ]
    try:
        from jax._src.pallas import pallas_call as _pallas  # noqa: PLC0415 - optional
    except ImportError:  # pragma: no cover - Pallas ships with jax 0.10
        return targets
    return [*targets, (_PALLAS, python_function(_pallas.pallas_call))]


# pallas_call is not an op: it is patched so that user kernels are traced with
# interception suspended (a kernel's jnp.dot must stay the kernel's own).
_PALLAS = "pallas_call"
_VALUES = frozenset(VALUE_NAMES)


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    previous = getattr(_state, "busy", False)
    _state.busy = True
    try:
        yield
    finally:
        _state.busy = previous


def _guard_kernel(kernel: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(kernel)
    def traced_without_interception(*args: Any, **kwargs: Any) -> Any:
        with _suspended():
            return kernel(*args, **kwargs)

    return traced_without_interception


def _trampoline_code(f: types.FunctionType, index: int) -> types.CodeType:
    """A code object with ``f``'s signature that forwards to the dispatcher."""
    sig = inspect.signature(f)
    params, positional, star, keywords = [], [], None, []
    seen_kw_only = False
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            params.append(p.name)
            positional.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            params.append(f"*{p.name}")
            star = p.name
            seen_kw_only = True
        elif p.kind is p.KEYWORD_ONLY:
            if not seen_kw_only:
                params.append("*")
                seen_kw_only = True
            params.append(p.name)
            keywords.append(p.name)
        else:
            raise TypeError(f"cannot intercept {f.__qualname__}: it takes **{p.name}")
    # Re-insert '/' after the positional-only parameters.
    n_pos_only = sum(p.kind is p.POSITIONAL_ONLY for p in sig.parameters.values())
    if n_pos_only:
        params.insert(n_pos_only, "/")
    args = "(" + "".join(f"{n}, " for n in positional) + ")"
    if star:
        args = f"({''.join(f'{n}, ' for n in positional)}*{star})"
    kwargs = "{" + ", ".join(f"{k!r}: {k}" for k in keywords) + "}"
    body = f"    return {_DISPATCH}({index}, {args}, {kwargs})\n"
    src = f"def {f.__name__}({', '.join(params)}):\n{body}"
    namespace: dict[str, Any] = {}
    exec(compile(src, f"<qflax interception of {f.__qualname__}>", "exec"), {}, namespace)  # noqa: S102
    code = namespace[f.__name__].__code__
    if code.co_argcount != f.__code__.co_argcount or code.co_kwonlyargcount != (
        f.__code__.co_kwonlyargcount
    ):
        raise TypeError(f"cannot intercept {f.__qualname__}: signature mismatch")
    return code


def _dispatch(index: int, args: tuple, kwargs: dict) -> Any:
    name, original = _originals[index]
    handler = getattr(_state, "handler", None)
    if handler is None or getattr(_state, "busy", False):
        return original(*args, **kwargs)
    if name == _PALLAS:
        return original(_guard_kernel(args[0]), *args[1:], **kwargs)
    if name in _VALUES:
        handler = _state.values
        if handler is None:
            return original(*args, **kwargs)
        if name == "nnx_get_value" and _indexed_read(args, kwargs):
            # ``variable[ids]``: the whole value is read (and reported), then indexed
            # outside the handlers, so that a lookup reaches the op handler as "take".
            return _dispatch(index, args, {})[kwargs["index"]]
    _state.busy = True
    try:
        # Handlers run with jit enabled: their jitted helpers (qcore's ops) then
        # compile as one computation each, exactly as they do outside the block.
        with jax.disable_jit(False):
            return handler(name, original, args, kwargs)
    finally:
        _state.busy = False


def _indexed_read(args: tuple, kwargs: dict) -> bool:
    """Whether an ``nnx.Variable.get_value`` call is a lookup (``variable[ids]``)."""
    index = kwargs.get("index", MISSING)
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    if isinstance(index, Missing) or not args or "on_get_value" in args[0].get_metadata():
        return False
    return isinstance(index, jax.Array | np.ndarray) and jnp.issubdtype(index.dtype, jnp.integer)


def install() -> None:
    """Replaces the op functions' code with trampolines (idempotent, thread-safe).

    Until a thread enters :func:`intercept`, the trampolines call the original
    code, so installing changes no result.
    """
    with _install_lock:
        if _originals:
            return
        targets = _targets()
        for index, (name, f) in enumerate(targets):
            copy = types.FunctionType(
                f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__
            )
            copy.__kwdefaults__ = f.__kwdefaults__
            copy.__dict__.update(f.__dict__)
            _originals.append((name, copy))
            f.__globals__[_DISPATCH] = _dispatch
            f.__code__ = _trampoline_code(f, index)


@contextlib.contextmanager
def intercept(handler: Handler, *, values: Handler | None = None) -> Iterator[None]:
    """Routes this thread's op calls to ``handler`` inside the block (see the module doc).

    Args:
        handler: Called for every op in :data:`OP_NAMES`.
        values: Called for every value read or transform in :data:`VALUE_NAMES`;
            None lets them run unmodified.

    Raises:
        RuntimeError: If this thread is already inside an ``intercept`` block.
    """
    install()
    if getattr(_state, "handler", None) is not None:
        raise RuntimeError("intercept() blocks cannot be nested on one thread")
    _state.handler, _state.values, _state.busy = handler, values, False
    try:
        with jax.disable_jit():
            yield
    finally:
        _state.handler, _state.values, _state.busy = None, None, False

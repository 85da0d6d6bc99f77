"""Interception of the JAX ops a model calls, during one call, on one thread.

The contract::

    with intercept(handler):
        out = model_call(...)

Inside the block, on the calling thread only, every call of a function that an
op of :mod:`qflax._engine.registry` names (built in: ``lax.dot_general``,
``lax.dot``, ``jnp.einsum``, ``jnp.dot``, ``jnp.matmul`` (and so the ``@``
operator), ``jnp.vecdot``,
``lax.conv_general_dilated``, ``lax.ragged_dot``, ``jnp.take`` and array indexing
(``x[idx]``, ``x.at[idx].get()``; both reported as ``"take"``)) becomes
``handler(op_name, original, args, kwargs)``, whose return value is the op's
result (``original(*args, **kwargs)`` runs the unmodified op). Ops called while a
handler runs (e.g. the ``dot_general`` inside ``einsum``, or qcore's own ops) are
not intercepted again, so each user-level op is seen once, under its own name;
neither are ops that qcore's code calls outside a handler (code a handler made
that JAX traces later, such as a training op's ``custom_vjp`` rules under
``jax.checkpoint``). qflax's own code is not exempt: it forwards model calls
(the pairwise parts of a split einsum, a checkpointed function) whose ops must be
seen.
Other threads, code outside the block, and Pallas kernels (traced inside
``pallas_call``) run the unmodified ops.

A second, optional handler sees how values reach the ops::

    with intercept(handler, values=value_handler):
        ...

``value_handler(name, original, args, kwargs)`` receives, under the names in
:data:`VALUE_NAMES`, the reads and writes of model variables (``linen_get_variable`` /
``linen_put_variable``: ``flax.core.scope.Scope.get_variable`` / ``put_variable``;
``nnx_get_value``:
``nnx.Variable.get_value``), the transforms a module applies to a weight
before the op (``convert_element_type``, ``reshape``, ``transpose``, ``squeeze``,
``expand_dims``, ``with_sharding_constraint``: unboxing a partitioned param applies
one), ``jax.checkpoint``'s call of its function (``checkpoint``:
``_remat_static_argnums``, whose returned function is the one traced) and every
other primitive applied (``bind``: ``Primitive.bind``), and returns their result.
Providers use it to hand modules a stand-in for a quantized weight, to recognise
that stand-in (cast or reshaped) when it reaches an op, and to warn when a weight
reaches an op through a transform they cannot follow. Value calls made inside
either handler are not reported.

Blocks nest: inside an inner block (also one opened by a handler) its handlers
replace the outer block's, which take over again when it ends.

How (and why it does not depend on JAX's trace cache): while at least one block
is open, on any thread, each op function's code object is replaced by a
trampoline with the same signature that consults a thread-local handler, so every
alias of the function (``nn.Dense``'s default ``dot_general``,
``jax.lax.dot_general``, ``jnp.einsum``'s internal reference) sees it. When the
last open block ends, every function gets its original code object back, so code
outside quantized calls runs JAX's functions unmodified and pays nothing (the
trampolines are made once and reused by later blocks). ``jnp.matmul``,
``jnp.dot`` and ``einsum``'s inner ``dot_general`` run inside jitted wrappers
whose cached traces would skip any Python-level hook, so the block runs under
``jax.disable_jit()``: the wrappers' Python bodies run every time, while an outer
``jax.jit`` around the model call still compiles the whole model into one
computation. Two things keep that block from changing what the model does: Linen
initializers (``Scope.param``/``Scope.variable``) run as outside it (jit enabled,
nothing intercepted), and ``lax.scan``/``lax.while_loop`` run traced, as outside
it, with only their bodies inside (under ``disable_jit`` JAX would run them as
Python loops).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
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
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import core as _core
from jax._src.lax import lax as _lax
from jax._src.lax.control_flow import loops as _loops

from qflax._engine import registry

Handler = Callable[[str, Callable[..., Any], tuple, dict], Any]

VALUE_NAMES: tuple[str, ...] = (
    "linen_get_variable",
    "linen_put_variable",
    "nnx_get_value",
    "convert_element_type",
    "reshape",
    "transpose",
    "with_sharding_constraint",
    "squeeze",
    "expand_dims",
    "checkpoint",
    "bind",
)

_DISPATCH = "__qflax_intercept__"
_state = threading.local()
# Guards the installation state below.
_install_lock = threading.Lock()
# (op name, copy of the function with its original code) for every trampoline ever
# made, at the index the trampoline passes to ``_dispatch``. Only appended to: a call
# already inside a trampoline when its function is restored still finds its original.
_originals: list[tuple[str, Callable[..., Any]]] = []
# function -> (op name, original code, trampoline code): trampolines are made once.
_trampolines: dict[types.FunctionType, tuple[str, types.CodeType, types.CodeType]] = {}
# (function, original code) of the functions now running a trampoline.
_installed: list[tuple[types.FunctionType, types.CodeType]] = []
_open_blocks = 0  # intercept() blocks open, on all threads
_pinned = False  # install() was called and uninstall() was not since


def _targets() -> list[tuple[str, types.FunctionType]]:
    """(op name, Python function) pairs whose code is replaced."""

    def python_function(f: Any) -> types.FunctionType:
        f = getattr(f, "__wrapped__", f)  # jnp.matmul / jnp.dot are jit wrappers
        if not isinstance(f, types.FunctionType):
            raise TypeError(f"cannot intercept {f!r}: not a Python function")
        return f

    targets = [(op.name, f) for op in registry.ops() for f in registry.target_functions(op)]
    targets += [
        ("linen_get_variable", python_function(_scope.Scope.get_variable)),
        ("linen_put_variable", python_function(_scope.Scope.put_variable)),
        ("nnx_get_value", python_function(nnx.Variable.get_value)),
        ("convert_element_type", python_function(_lax._convert_element_type)),
        ("reshape", python_function(_lax.reshape)),
        ("transpose", python_function(_lax.transpose)),
        ("with_sharding_constraint", python_function(jax.lax.with_sharding_constraint)),
        (_PARAM, python_function(_scope.Scope.param)),
        (_VARIABLE, python_function(_scope.Scope.variable)),
        ("scan", python_function(_loops.scan)),
        ("while_loop", python_function(_loops.while_loop)),
        ("squeeze", python_function(_lax.squeeze)),
        ("expand_dims", python_function(_lax.expand_dims)),
        ("checkpoint", python_function(_ad_checkpoint._remat_static_argnums)),  # noqa: SLF001
        ("bind", python_function(_core.Primitive.bind)),
    ]
    try:
        from jax._src.pallas import pallas_call as _pallas  # noqa: PLC0415 - optional
    except ImportError:  # pragma: no cover - Pallas ships with jax 0.10
        return targets
    return [*targets, (_PALLAS, python_function(_pallas.pallas_call))]


# pallas_call is not an op: it is patched so that user kernels are traced with
# interception suspended (a kernel's jnp.dot must stay the kernel's own).
_PALLAS = "pallas_call"
# Linen's Scope.param / Scope.variable are not ops either: they are patched so that
# initializers run as they do outside quantized calls (jit enabled, nothing
# intercepted), so a quantized init creates exactly ``model.init``'s float params
# (initializers run under ``disable_jit`` differ in the last bit). The index is
# that of ``init_fn`` in the arguments.
_PARAM, _VARIABLE = "linen_param", "linen_variable"
_INIT_FN = {_PARAM: 2, _VARIABLE: 3}
# Loops run as they do outside quantized calls (traced: under ``disable_jit`` JAX runs
# them as Python loops, which changes what a model does, e.g. the params Flax's
# ``nn.scan`` creates at init), their bodies as inside (``disable_jit``,
# intercepted). The indices are those of the functions in the arguments.
_BODIES = {"scan": (0,), "while_loop": (0, 1)}
_VALUES = frozenset(VALUE_NAMES)
_JAX_PACKAGES = frozenset({"jax", "jaxlib"})
_OWN_PACKAGES = frozenset({"qcore"})


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    previous = getattr(_state, "busy", False)
    _state.busy = True
    try:
        yield
    finally:
        _state.busy = previous


def _guard(fn: Callable[..., Any] | None, *, enable_jit: bool = False) -> Any:
    """``fn`` run with interception suspended (and jit enabled if ``enable_jit``)."""
    if fn is None:  # Scope.variable without an initializer
        return None

    @functools.wraps(fn)
    def run_without_interception(*args: Any, **kwargs: Any) -> Any:
        jit = jax.disable_jit(False) if enable_jit else contextlib.nullcontext()
        with _suspended(), jit:
            return fn(*args, **kwargs)

    return run_without_interception


def _disabling_jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run_with_jit_disabled(*args: Any, **kwargs: Any) -> Any:
        with jax.disable_jit():
            return fn(*args, **kwargs)

    return run_with_jit_disabled


def _trampoline_code(f: types.FunctionType, index: int) -> types.CodeType:
    """A code object with ``f``'s signature that forwards to the dispatcher."""
    sig = inspect.signature(f)
    params, positional, star, keywords, double = [], [], None, [], None
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
        else:  # only qflax's own targets (Scope.param, Primitive.bind...): ops take none
            params.append(f"**{p.name}")
            double = p.name
    # Re-insert '/' after the positional-only parameters.
    n_pos_only = sum(p.kind is p.POSITIONAL_ONLY for p in sig.parameters.values())
    if n_pos_only:
        params.insert(n_pos_only, "/")
    args = "(" + "".join(f"{n}, " for n in positional) + ")"
    if star:
        args = f"({''.join(f'{n}, ' for n in positional)}*{star},)"
    entries = [f"{k!r}: {k}" for k in keywords] + ([f"**{double}"] if double else [])
    kwargs = "{" + ", ".join(entries) + "}"
    body = f"    return {_DISPATCH}({index}, {args}, {kwargs})\n"
    src = f"def trampoline({', '.join(params)}):\n{body}"
    namespace: dict[str, Any] = {}
    exec(compile(src, f"<qflax interception of {f.__qualname__}>", "exec"), {}, namespace)  # noqa: S102
    # Named like f (a lambda's name is not an identifier, so the source cannot say it).
    code = namespace["trampoline"].__code__.replace(
        co_name=f.__code__.co_name, co_qualname=f.__code__.co_qualname
    )
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
    if _called_by_quantization():
        with _suspended():
            return original(*args, **kwargs)
    if name == _PALLAS:
        return original(_guard(args[0]), *args[1:], **kwargs)
    if name in _BODIES:
        loop_args = list(args)
        for i in _BODIES[name]:
            loop_args[i] = _disabling_jit(args[i])
        with jax.disable_jit(False):
            return original(*loop_args, **kwargs)
    if name in _INIT_FN:
        i = _INIT_FN[name]
        return original(*args[:i], _guard(args[i], enable_jit=True), *args[i + 1 :], **kwargs)
    if name in _VALUES:
        handler = _state.values
        if handler is None:
            return original(*args, **kwargs)
        if name == "bind":  # every primitive: no jit context switch on this hot path
            _state.busy = True
            try:
                return handler(name, original, args, kwargs)
            finally:
                _state.busy = False
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


def run_inside(original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``original(*args, **kwargs)`` from an op handler, with the ops it calls intercepted.

    For a call that is several ops rather than one (see ``OpDef.split``): the
    registered ops and value transforms it calls reach this thread's handlers as if
    the model had called them.
    """
    previous = getattr(_state, "busy", False)
    _state.busy = False
    try:
        with jax.disable_jit():
            return original(*args, **kwargs)
    finally:
        _state.busy = previous


def _called_by_quantization() -> bool:
    """Whether qcore's code made the call (JAX's frames skipped; see the module docstring).

    Handlers run with interception suspended, but JAX may trace code a handler made
    after the handler returned: the rules of a training op's ``custom_vjp`` are traced
    when ``jax.checkpoint`` (``nn.remat``) or a jitted ``scan`` takes the JVP of its
    body, still inside the block. Their ops (e.g. qcore's int8 × int8 contraction)
    are the quantization's own computation, never the model's.
    """
    frame = sys._getframe(2)  # above _dispatch: the trampoline (a JAX function), its caller
    while frame is not None:
        package = frame.f_globals.get("__name__", "").partition(".")[0]
        if package not in _JAX_PACKAGES:
            return package in _OWN_PACKAGES
        frame = frame.f_back
    return False


def _indexed_read(args: tuple, kwargs: dict) -> bool:
    """Whether an ``nnx.Variable.get_value`` call is a lookup (``variable[ids]``)."""
    index = kwargs.get("index", MISSING)
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    if isinstance(index, Missing) or not args or "on_get_value" in args[0].get_metadata():
        return False
    return isinstance(index, jax.Array | np.ndarray) and jnp.issubdtype(index.dtype, jnp.integer)


def _trampoline(name: str, f: types.FunctionType) -> types.CodeType:
    """``f``'s trampoline code, made on first use (and again if ``f``'s code changed)."""
    made = _trampolines.get(f)
    if made is None or made[0] != name or made[1] is not f.__code__:
        copy = types.FunctionType(
            f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__
        )
        copy.__kwdefaults__ = f.__kwdefaults__
        copy.__dict__.update(f.__dict__)
        _originals.append((name, copy))
        made = (name, f.__code__, _trampoline_code(f, len(_originals) - 1))
        _trampolines[f] = made
    return made[2]


def _install_locked() -> None:
    if _installed:
        return
    try:
        for name, f in _targets():
            if any(f is g for g, _ in _installed):
                # Replacing twice would restore the first trampoline, not the original.
                raise ValueError(f"{f.__qualname__} is intercepted twice (as {name!r})")
            trampoline = _trampoline(name, f)
            f.__globals__[_DISPATCH] = _dispatch
            _installed.append((f, f.__code__))
            f.__code__ = trampoline
        registry.frozen.set()
    except BaseException:
        _uninstall_locked()
        raise


def _uninstall_locked() -> None:
    for f, code in _installed:
        f.__code__ = code
    _installed.clear()
    registry.frozen.clear()


def install() -> None:
    """Replaces the op functions' code with trampolines until :func:`uninstall`.

    :func:`intercept` installs them itself for as long as a block is open; this
    keeps them installed in between as well (idempotent, thread-safe). Outside
    blocks the trampolines call the original code, so installing changes no result.

    Example:
        >>> import jax.numpy as jnp
        >>> from qflax._engine import interception
        >>> interception.install()
        >>> jnp.einsum.__code__.co_filename
        '<qflax interception of einsum>'
        >>> interception.uninstall()
        >>> jnp.einsum.__code__.co_filename.startswith("<qflax")
        False
    """
    global _pinned
    with _install_lock:
        _install_locked()
        _pinned = True


def uninstall() -> None:
    """Undoes :func:`install`: restores the op functions' original code objects.

    Blocks still open keep the trampolines until the last of them ends. Idempotent
    and thread-safe.
    """
    global _pinned
    with _install_lock:
        _pinned = False
        if not _open_blocks:
            _uninstall_locked()


@contextlib.contextmanager
def _open_block() -> Iterator[None]:
    """Counts an open block: installs on the first, restores after the last."""
    global _open_blocks
    with _install_lock:
        _install_locked()
        _open_blocks += 1
    try:
        yield
    finally:
        with _install_lock:
            _open_blocks -= 1
            if not (_open_blocks or _pinned):
                _uninstall_locked()


@contextlib.contextmanager
def intercept(handler: Handler, *, values: Handler | None = None) -> Iterator[None]:
    """Routes this thread's op calls to ``handler`` inside the block (see the module doc).

    Blocks nest: an inner block's handlers replace the outer block's until it ends.
    The op functions run trampolines only while a block is open, on any thread.

    Args:
        handler: Called for every op of the registry.
        values: Called for every value read or transform in :data:`VALUE_NAMES`;
            None lets them run unmodified.

    Example:
        >>> import jax.numpy as jnp
        >>> from qflax._engine import interception
        >>> def doubled(name, original, args, kwargs):
        ...     print(name)
        ...     return 2 * original(*args, **kwargs)
        >>> with interception.intercept(doubled):
        ...     out = jnp.ones((1, 3)) @ jnp.ones((3, 1))
        matmul
        >>> out
        Array([[6.]], dtype=float32)
        >>> jnp.ones((1, 3)) @ jnp.ones((3, 1))  # outside the block: unmodified
        Array([[3.]], dtype=float32)
    """
    outer = (
        getattr(_state, "handler", None),
        getattr(_state, "values", None),
        getattr(_state, "busy", False),
    )
    with _open_block():
        _state.handler, _state.values, _state.busy = handler, values, False
        try:
            with jax.disable_jit():
                yield
        finally:
            _state.handler, _state.values, _state.busy = outer

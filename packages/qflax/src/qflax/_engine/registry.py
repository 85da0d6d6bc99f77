"""The ops qflax intercepts, in one table.

An :class:`OpDef` says everything qflax needs to know about an op: its name (what
rules' ``op_names`` select), the Python functions interception replaces, how a call
binds to an :class:`~qflax.OpCall` (or a :class:`~qflax._engine.opcall.TakeCall`
for a table lookup), whether rules select it by default, and what else can handle
it (calibration statistics for GPTQ/AWQ/SmoothQuant, LoRA adapters). Interception,
rule validation, calibration and LoRA read this table; adding an op is one
:func:`register` call (plus, if it needs one, its qcore op).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import types
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax._src.lax import convolution as _convolution
from jax._src.lax import lax as _lax
from jax._src.numpy import indexing as _indexing
from jax._src.numpy import tensor_contractions as _contractions

from qflax._engine import opcall
from qflax._engine.opcall import OpCall, TakeCall


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpDef:
    """One op qflax can quantize.

    Attributes:
        name: What rules' ``op_names`` select (an identifier, unique).
        targets: Returns a tuple of the Python functions whose calls are this op
            (each alias of a function sees interception: its code object is replaced
            while a quantized call runs). Called and checked by :func:`register`,
            and again each time interception is installed. A function belongs to
            one op, and calls inside it are not seen by other ops' rules.
        bind: Turns the call's arguments, bound by name with the target's
            signature, into an :class:`~qflax.OpCall` (two operands, contracted
            axes, how to run it quantized and for training) named ``name``, a
            :class:`~qflax.TakeCall` for a lookup, or None to run the call as it
            is. It must describe the whole call (anything else the target computes
            is not run when the op is quantized) and pass the operands as the call
            received them (a weight is recognised by identity: a transposed or
            scaled weight is an activation). ``nnx.Variable`` arguments arrive as
            their values.
        default: Whether rules that do not name their ``op_names`` select it.
        lookup: A table lookup (one operand, a parameter looked up by ids),
            quantized as a weight with one scale per row; else a contraction.
        calibration: Whether :func:`qflax.layer_stats.collect` (GPTQ, AWQ,
            SmoothQuant) gathers input statistics for its weight.
        lora: Whether a :class:`~qflax.LoraRule` may adapt it.
        split: Given the call's arguments by name, whether the call is several ops
            rather than one (an einsum of three operands is its pairwise
            contractions): it is then no site, and the ops it calls are intercepted
            under their own names. None: every call is one op.
    """

    name: str
    targets: Callable[[], tuple[Callable[..., Any], ...]]
    bind: Callable[[dict[str, Any]], OpCall | TakeCall | None]
    default: bool = True
    lookup: bool = False
    calibration: bool = False
    lora: bool = False
    split: Callable[[dict[str, Any]], bool] | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name.isidentifier()):
            raise ValueError(f"name={self.name!r} is not allowed; allowed: a Python identifier")
        for field in ("targets", "bind"):
            if not callable(getattr(self, field)):
                raise ValueError(f"{field}={getattr(self, field)!r} is not callable")
        if self.split is not None and not callable(self.split):
            raise ValueError(f"split={self.split!r} is not allowed; allowed: a callable or None")
        if self.lookup and (self.lora or self.calibration):
            raise ValueError(
                f"op {self.name!r}: lookup=True ops take no lora or calibration capability "
                "(a lookup has no input to adapt or to gather statistics of); allowed: "
                "lookup=True with lora=False and calibration=False"
            )


def target_functions(op: OpDef) -> tuple[types.FunctionType, ...]:
    """The Python functions ``op.targets()`` names (jit wrappers unwrapped), checked.

    Raises:
        ValueError: Naming the op and the target, for anything interception cannot
            replace: not a tuple, not a Python function (builtins, NumPy ufuncs,
            methods), a closure, a function taking ``**kwargs``, one named twice.
    """
    got = op.targets()
    where = f"targets of op {op.name!r}"
    if not isinstance(got, tuple | list):
        raise ValueError(f"{where} must return a tuple of functions, got {got!r}")
    out = []
    for f in got:
        g = getattr(f, "__wrapped__", f)  # jnp.matmul / jnp.dot are jit wrappers
        if not isinstance(g, types.FunctionType):
            raise ValueError(
                f"{where} returned {f!r}, which is not a Python function; allowed: functions "
                "defined with def or lambda (not builtins, NumPy ufuncs or bound methods)"
            )
        if g.__code__.co_freevars:
            raise ValueError(
                f"{where} returned {g.__qualname__}, a closure (it reads "
                f"{', '.join(g.__code__.co_freevars)} of an enclosing function); allowed: "
                "functions without free variables, e.g. defined at module level"
            )
        keywords = [
            p.name for p in inspect.signature(g).parameters.values() if p.kind is p.VAR_KEYWORD
        ]
        if keywords:
            raise ValueError(
                f"{where} returned {g.__qualname__}, which takes **{keywords[0]}; allowed: "
                "functions whose parameters are named (positional, *args, keyword-only)"
            )
        if g in out:
            raise ValueError(f"{where} returned {g.__qualname__} named twice; name it once")
        out.append(g)
    return tuple(out)


_OPS: dict[str, OpDef] = {}
_lock = threading.Lock()
# Set by interception while its trampolines are installed: the op table is read then.
frozen = threading.Event()


def register(op: OpDef) -> OpDef:
    """Adds an op to the table (see :class:`OpDef`); returns it.

    Example:
        >>> import jax.numpy as jnp
        >>> import qflax
        >>> def project(x, w):  # a model's own contraction
        ...     return jnp.einsum("bk,kn->bn", x, w)
        >>> def bind(a):  # the arguments by name
        ...     return qflax.OpCall.from_einsum("project", "bk,kn->bn", a["x"], a["w"])
        >>> op = qflax.register_op(
        ...     qflax.OpDef(name="project", targets=lambda: (project,), bind=bind)
        ... )
        >>> "project" in qflax.op_names()
        True
        >>> qflax.unregister_op("project")

    Raises:
        ValueError: If an op of that name is registered already or ``op`` is not
            an :class:`OpDef`.
        RuntimeError: While a quantized call runs (interception reads the table
            when it is installed).
    """
    if not isinstance(op, OpDef):
        raise ValueError(f"op={op!r} is not allowed; allowed: a qflax.OpDef")
    functions = target_functions(op)
    with _lock:
        if op.name in _OPS:
            raise ValueError(f"an op named {op.name!r} is registered already; choose another name")
        for other in _OPS.values():
            for f in set(functions) & set(target_functions(other)):
                raise ValueError(
                    f"targets of op {op.name!r} returned {f.__qualname__}, but op "
                    f"{other.name!r} intercepts it already; allowed: functions no other op "
                    "names (a function is one op)"
                )
        if frozen.is_set():
            raise RuntimeError(
                f"cannot register op {op.name!r} while a quantized call runs; register ops "
                "before calling a quantized model"
            )
        _OPS[op.name] = op
    return op


def unregister(name: str) -> None:
    """Removes a registered op (built-in ops cannot be removed).

    Raises:
        ValueError: For a built-in op or a name that is not registered.
        RuntimeError: While a quantized call runs.
    """
    with _lock:
        if frozen.is_set():
            raise RuntimeError(f"cannot unregister op {name!r} while a quantized call runs")
        if name in BUILTIN_NAMES or name not in _OPS:
            raise ValueError(
                f"name={name!r} is not allowed; allowed: a registered op that is not built in "
                f"({sorted(set(_OPS) - set(BUILTIN_NAMES))})"
            )
        del _OPS[name]


def get(name: str) -> OpDef:
    """The registered op ``name``."""
    return _OPS[name]


def ops() -> tuple[OpDef, ...]:
    """Every registered op, built-in ones first, in registration order."""
    return tuple(_OPS.values())


def names(
    *, default: bool | None = None, calibration: bool | None = None, lora: bool | None = None
) -> tuple[str, ...]:
    """Names of the registered ops, optionally only those with the given capabilities.

    Example:
        >>> import qflax
        >>> qflax.op_names(lora=True)
        ('dot_general', 'einsum', 'dot', 'matmul', 'vecdot', 'conv_general_dilated')
    """
    want = {"default": default, "calibration": calibration, "lora": lora}
    return tuple(
        op.name
        for op in _OPS.values()
        if all(v is None or getattr(op, k) == v for k, v in want.items())
    )


def _builtin(name: str, target: Callable[[], tuple[Any, ...]], bind: Any, **caps: Any) -> None:
    register(OpDef(name=name, targets=target, bind=bind, **caps))


_MATMUL = {"calibration": True, "lora": True}
# lax.dot is dot_general with default dimension numbers; jnp.tensordot, jnp.inner,
# jnp.vdot, jnp.matvec and jnp.vecmat call lax.dot_general with the operands as
# given (or transposed, reshaped: followed), so they need no entry of their own.
_builtin("dot_general", lambda: (_lax.dot_general, _lax.dot), opcall.dot_general, **_MATMUL)
# An einsum of more than two operands (jnp.linalg.multi_dot's) is its pairwise
# dot_generals.
_builtin("einsum", lambda: (jnp.einsum,), opcall.einsum, split=opcall.einsum_splits, **_MATMUL)
_builtin("dot", lambda: (jnp.dot,), opcall.dot_like("dot"), **_MATMUL)
_builtin("matmul", lambda: (jnp.matmul,), opcall.dot_like("matmul"), **_MATMUL)
_builtin("vecdot", lambda: (_contractions.vecdot,), opcall.vecdot, **_MATMUL)
_builtin(
    "conv_general_dilated", lambda: (_convolution.conv_general_dilated,), opcall.conv, lora=True
)
_builtin("ragged_dot", lambda: (_lax.ragged_dot,), opcall.ragged_dot)
# Table lookups: jnp.take (as nn.Embed calls it) and indexing table[ids]. Quantized
# only by rules that name them, so existing rules keep tables float.
_builtin(
    "take",
    lambda: (jnp.take, _indexing.rewriting_take),
    opcall.take,
    default=False,
    lookup=True,
)
BUILTIN_NAMES: tuple[str, ...] = tuple(_OPS)
BUILTIN_DEFAULT_NAMES: tuple[str, ...] = names(default=True)

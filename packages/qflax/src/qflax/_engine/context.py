"""The state of one quantized model call: where each weight operand came from.

A :class:`CallContext` serves as the value handler of
:func:`qflax._engine.interception.intercept`. It sees every read of a model parameter
(Linen ``Scope.get_variable`` / ``put_variable``, NNX ``Variable.get_value``) and
records the value handed to the module under the parameter's path; a
:class:`~qflax.qparam.QuantizedParam` is handed over as its stand-in (see
:func:`~qflax.qparam.stand_in`). It follows the recorded values through casts,
reshapes and transposes, so when an op receives one of them,
:meth:`CallContext.source` names the parameter and the layout change. Values are
tracked by identity and kept alive until the call ends, so an id is never reused.

It also names the activation quantization sites of each module (``dot_general0``,
``einsum1``, ... in call order per module object) and reads and writes the
variables that belong to them (static scales, statistics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax._src import core as _core

from qflax._engine import layout, module_path
from qflax._engine.flavor import Flavor, check_linen_trace
from qflax.qparam import QuantizedParam, Transform, stand_in


class Mode(enum.Enum):
    """What a call may do with float parameters that rules quantize."""

    APPLY = "apply"  # params are read-only: a float weight where a quantized one is due raises
    INIT = "init"  # Linen init: create quantized params and empty statistics
    QUANTIZE = "quantize"  # Linen apply with mutable params: quantize float params in place
    DISCOVER = "discover"  # NNX: record recipes and sites (abstract run), write nothing


@dataclasses.dataclass(frozen=True)
class Source:
    """A model parameter as an op received it.

    Attributes:
        path: The parameter's ``/``-joined path (module path + name).
        value: The stored value (unboxed): a float array or a QuantizedParam.
        holder: The Linen scope or the NNX variable holding it.
        name: The parameter's name in its module.
        transforms: Reshapes/transposes applied between the read and the op (what
            becomes the recipe's ``transforms``).
        trace: The JAX trace the parameter was read in, when the op runs in
            another (inside a ``jax.checkpoint``); None when it is the same.
    """

    path: str
    value: Any
    holder: Any
    name: str
    transforms: tuple[Transform, ...] = ()
    trace: Any = None


class CallContext:
    """Value handler and bookkeeping of one model call (see the module docstring).

    Providers ask it policy questions (:attr:`discovering`, :attr:`creates_variables`,
    :attr:`may_quantize_params`) rather than reading its :class:`Mode`, and leave
    what an NNX discovery pass finds in its record through :meth:`record_recipe`,
    :meth:`put_site_var` and :meth:`request`.
    """

    def __init__(self, flavor: Flavor, mode: Mode, *, update_stats: bool = False) -> None:
        self.flavor = flavor
        self.mode = mode
        self.update_stats = update_stats
        self._values: dict[int, tuple[Any, Source]] = {}
        # Values computed from a parameter in a way that cannot be followed (w * 1.0):
        # id -> (value, the parameter's source, what was done to it).
        self._derived: dict[int, tuple[Any, Source, str]] = {}
        self._counters: dict[int, tuple[Any, dict[str, int]]] = {}
        # DISCOVER results: param path -> recipe; module path -> site variables.
        self.recipes: dict[str, Any] = {}
        # Params quantized during this call (path -> (float value, QuantizedParam)),
        # so that a second op on the same value (a tied embedding's attend) reuses it.
        self.written: dict[str, Any] = {}
        self.sites: dict[str, dict[str, Any]] = {}
        # DISCOVER results a provider creates itself afterwards (key -> request),
        # see Provider.nnx_variables.
        self.requests: dict[Any, Any] = {}

    # -- policy --------------------------------------------------------------------
    @property
    def discovering(self) -> bool:
        """An abstract pass (NNX ``quantize_model``): record what is due, write nothing."""
        return self.mode is Mode.DISCOVER

    @property
    def creates_variables(self) -> bool:
        """Whether the call creates the providers' variables (Linen init, NNX discovery)."""
        return self.mode in (Mode.INIT, Mode.DISCOVER)

    @property
    def may_quantize_params(self) -> bool:
        """Whether a float param that a rule quantizes may be quantized now (else it raises)."""
        return self.mode is not Mode.APPLY

    # -- record --------------------------------------------------------------------
    def record_recipe(self, path: str, recipe: Any) -> Any:
        """Records how param ``path`` is quantized; returns the first recipe recorded for it."""
        return self.recipes.setdefault(path, recipe)

    def put_site_var(self, path: str, name: str, collection: str, value: Any) -> None:
        """Records a site variable of module ``path`` that discovery found due."""
        self.sites.setdefault(path, {})[name] = (collection, value)

    def request(self, key: Any, value: Any) -> None:
        """Records a provider's own request (see ``Provider.nnx_variables``), once per key."""
        self.requests.setdefault(key, value)

    # -- value handler -----------------------------------------------------------
    def __call__(self, name: str, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Runs a reported value read or transform and records what it returns."""
        if name == "checkpoint":
            return self._checkpoint(original(*args, **kwargs))
        out = original(*args, **kwargs)
        if name == "bind":
            self._bind(args, out)
        elif name == "linen_get_variable":
            scope, col, key = _linen_args(args, kwargs, ("col", "name"))
            return self._linen_read(scope, col, key, out)
        elif name == "linen_put_variable":
            scope, col, key, value = _linen_args(args, kwargs, ("col", "name", "value"))
            self._linen_read(scope, col, key, value)
        elif name == "nnx_get_value":
            return self._nnx_read(args[0], out)
        elif name == "transpose":
            value, perm = args[0], (args[1] if len(args) > 1 else kwargs["permutation"])
            self.follow(value, out, ("transpose", tuple(int(p) for p in perm)))
        elif name in ("convert_element_type", "with_sharding_constraint"):
            self.follow(args[0], out, None)
        else:  # reshape, squeeze, expand_dims: the same values in another shape
            same = tuple(out.shape) == tuple(getattr(args[0], "shape", ()))
            self.follow(args[0], out, None if same else ("reshape", tuple(out.shape)))
        return out

    def follow(self, value: Any, out: Any, step: Transform | None, trace: Any = None) -> None:
        """Records ``out`` as ``value`` after ``step`` (a reshape, a transpose, or None).

        ``trace``: the trace ``value`` lives in, when ``out`` is its tracer in another.
        """
        src = self.source(value)
        if src is not None:
            steps = src.transforms + ((step,) if step is not None else ())
            self._keep(out, dataclasses.replace(src, transforms=steps, trace=src.trace or trace))
            return
        entry = self._derived.get(id(value))
        if entry is not None and entry[0] is value:
            self._derived[id(out)] = (out, entry[1], entry[2])

    def taint(self, values: tuple, out: Any, how: str) -> None:
        """Records ``out`` as computed from a parameter by ``how`` (not followed).

        Only when ``values`` hold a parameter (or a value computed from one) and
        nothing but other such values and scalars: ``w * 1.0`` and ``w * g`` stay
        weights that an op may receive, ``x * scale`` (an activation) does not.
        """
        found = None
        for v in values:
            src = self.source(v)
            mine = (src, how) if src is not None else self.derived(v)
            if mine is not None:
                found = found or mine
            elif getattr(v, "ndim", 0) > 0:
                return  # an activation (or a constant array) takes part
        if found is None:
            return
        for o in out if isinstance(out, list | tuple) else (out,):
            self._derived[id(o)] = (o, *found)

    def derived(self, operand: Any) -> tuple[Source, str] | None:
        """The parameter ``operand`` was computed from in a way not followed, and how."""
        entry = self._derived.get(id(operand))
        return (entry[1], entry[2]) if entry is not None and entry[0] is operand else None

    def _bind(self, args: tuple, out: Any) -> None:
        operands = args[1:]
        if any(id(v) in self._values or id(v) in self._derived for v in operands):
            self.taint(operands, out, args[0].name)

    def _checkpoint(self, made: tuple[Callable[..., Any], Any]) -> tuple[Callable[..., Any], Any]:
        """``jax.checkpoint``'s function, made to follow its arguments into its trace.

        Each argument's tracer inside the checkpointed function is the argument
        itself (by position) and is recorded so; a new function per call also keeps
        JAX's trace cache of the checkpointed function from serving (or keeping) a
        trace made outside this quantized call.
        """
        fun, outer = made
        trace = _core.unsafe_get_current_trace()

        def traced(*args: Any, **kwargs: Any) -> Any:
            for o, i in zip(jax.tree.leaves(outer), jax.tree.leaves(args), strict=False):
                self.follow(o, i, None, trace)
            return fun(*args, **kwargs)

        return traced, outer

    def _keep(self, value: Any, source: Source) -> None:
        self._values[id(value)] = (value, source)

    def _linen_read(self, scope: Any, col: str, key: str, raw: Any) -> Any:
        if col != "params" or raw is None:
            return raw
        boxed = isinstance(raw, nn.meta.AxisMetadata)
        value = raw.unbox() if boxed else raw
        path = "/".join([*map(str, scope.path), key])
        # Boxed values are returned unboxed: unboxing a logically partitioned value
        # adds a sharding constraint (a new array each time), so the module must
        # receive the very array recorded here.
        if isinstance(value, QuantizedParam):
            value = nn.meta.unbox(value)  # its leaves carry their own partitioning
            s = stand_in(value)
            self._keep(s, Source(path, value, scope, key))
            return s
        if isinstance(value, jax.Array):
            self._keep(value, Source(path, value, scope, key))
            inner = getattr(raw, "value", None) if boxed else None
            if isinstance(inner, jax.Array):
                # A param just created (put_variable) reaches the module unboxed by
                # Scope.param: a sharding constraint of the boxed array, followed.
                self._keep(inner, Source(path, inner, scope, key))
            return value
        return raw

    def _nnx_read(self, var: nnx.Variable, out: Any) -> Any:
        raw = var.get_raw_value()
        if not isinstance(raw, QuantizedParam) and not isinstance(out, jax.Array):
            return out
        owner = _nnx_owner(var)
        if owner is None:
            return out
        module, attr = owner
        base = module_path.nnx_path(module) or ""
        path = f"{base}/{attr}" if base else attr
        if isinstance(raw, QuantizedParam):
            s = stand_in(raw)
            self._keep(s, Source(path, raw, var, attr))
            return s
        self._keep(out, Source(path, out, var, attr))
        return out

    @staticmethod
    def in_read_trace(source: Source) -> contextlib.AbstractContextManager[Any]:
        """A context that computes in the trace ``source`` was read in.

        A param's quantized value is written to the params, so it must not be a
        tracer of the ``jax.checkpoint`` the op runs in.
        """
        if source.trace is None:
            return contextlib.nullcontext()
        return _core.set_current_trace(source.trace)

    def read(self, value: Any) -> Any:
        """``value``, or, for an NNX variable passed to an op as it is, its recorded value."""
        if not isinstance(value, nnx.Variable):
            return value
        return self._nnx_read(value, value.get_value())

    # -- queries used by the providers ---------------------------------------------
    def source(self, operand: Any) -> Source | None:
        """The parameter an op operand was read from, or None for an activation."""
        entry = self._values.get(id(operand))
        return entry[1] if entry is not None and entry[0] is operand else None

    def site(self, module: Any, op_name: str) -> str:
        """The next quantization site name of ``op_name`` in ``module`` (``einsum0``...)."""
        _, counts = self._counters.setdefault(id(module), (module, {}))
        k = counts.get(op_name, 0)
        counts[op_name] = k + 1
        return f"{op_name}{k}"

    def calling_module(self) -> tuple[Any, str] | None:
        """The innermost module on the stack and its path."""
        return module_path.calling_module(self.flavor.path, skip=2)

    def write_param(self, source: Source, value: QuantizedParam) -> None:
        """Replaces a Linen parameter, in INIT/QUANTIZE mode (see :func:`box_leaves`)."""
        scope = source.holder
        with self.in_read_trace(source):  # a weight followed into jax.checkpoint
            check_linen_trace(scope, source.path)
        raw = scope.get_variable("params", source.name)
        if isinstance(raw, nn.meta.AxisMetadata):
            value = layout.box_leaves(raw, value)
        scope.put_variable("params", source.name, value)


def _linen_args(args: tuple, kwargs: dict, names: tuple[str, ...]) -> tuple:
    values = list(args[1:]) + [kwargs[n] for n in names[len(args) - 1 :] if n in kwargs]
    return (args[0], *values[: len(names)])


def _nnx_owner(var: nnx.Variable) -> tuple[nnx.Module, str] | None:
    """The labelled module on the stack that holds ``var``, and the attribute name."""
    frame = sys._getframe(2)  # noqa: SLF001
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, nnx.Module) and module_path.nnx_path(obj) is not None:
            for attr, value in vars(obj).items():
                if value is var:
                    return obj, attr
        frame = frame.f_back
    return None

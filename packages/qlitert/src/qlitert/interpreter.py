"""The jaxpr interpreter behind :func:`qlitert.calibrate`, ``annotate`` and ``qat``.

It runs a function's jaxpr equation by equation and decides, for every value,
how TFLite's integer kernels will represent it (:class:`Rep`): a constant
(weight), a quantized tensor with its parameters, a *pending* value (a
matmul/convolution output waiting for the bias add, batch norm and ReLU that
TFLite fuses into the kernel), or float. Where TFLite quantizes, it inserts a
quantization *site*: observed (calibrate), annotated with a ``quant.fake_quant``
composite (annotate), or fake-quantized with a straight-through gradient (QAT).
The types of each site come from the rules matched by the module path of the
op that produces it (:mod:`qlitert.rules`, :mod:`qlitert.scopes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import extend as jex

from qlitert import qdq, rules, scopes
from qlitert.calibration import Calibration, update_range

# Ops whose output has its input's scale (TFLite shares it).
PRESERVING = {
    "reshape", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice",
    "reduce_window_max", "copy", "copy_p", "broadcast_in_dim", "pad", "gather",
    "reduce_max", "rev", "stop_gradient",
}  # fmt: skip
# Ops that compute a new value: inputs quantized, output quantized at its own range.
COMPUTING = {
    "add", "sub", "mul", "concatenate", "tanh", "logistic", "max", "min", "neg",
    "square", "integer_pow", "rsqrt", "sqrt", "exp", "abs", "log",
}  # fmt: skip
CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# (kernel, activation type) -> the output (scale, zero point) LiteRT's builtin kernel
# requires (XNNPACK accepts others, so a calibrated range loads only under it).
_FIXED_OUTPUT = {
    ("softmax", "int8"): (1 / 256, -128),
    ("softmax", "int16"): (1 / 32768, 0),
    ("log_softmax", "int8"): (16 / 256, 127),
    ("logistic", "int8"): (1 / 256, -128),
    ("logistic", "int16"): (1 / 32768, 0),
    ("tanh", "int16"): (1 / 32768, 0),  # its int16 kernel checks the scale is 2^-15
}
# int16 ops whose LiteRT kernel takes operands of one shape (litert-converter 0.5.0
# refuses a broadcasting int16 ADD): smaller operands are broadcast first.
_SAME_SHAPE_INT16 = ("add",)
# An additive mask's fill: a constant at most this (finfo.min, -1e9, BERT's -10000)
# masks what it is added to; the add becomes a select (Interpreter.masked).
MASK_FILL = -1e3


class UnsupportedOpError(ValueError):
    """An op qlitert cannot quantize for LiteRT (strict mode)."""


@dataclasses.dataclass
class Rep:
    """How a value is represented: const (a weight), q (quantized), pending, float, int.

    ``origin`` is the equation that produced a pending value (its rule decides
    the type of the value's site); ``inherit`` is the window size of an average
    pooling, whose output keeps its input's parameters. ``qtype`` is the qcore
    name of a quantized value's LiteRT type. ``source`` holds the integer values
    of an integer array converted to float (a mask), which a comparison or a
    conversion back to integers uses instead of the quantized floats.
    """

    kind: str
    scale: Any = None
    zero_point: Any = None
    qtype: str = "int8"
    inherit: int = 0  # the pooling window's size
    origin: Any = None
    source: Any = None


@dataclasses.dataclass
class _Deferred:
    """A matmul/convolution with a constant weight, not computed yet.

    Per-output-channel affine constants that follow it (bias adds, batch-norm
    ``sub``/``mul``) are folded in: ``y = op(x, w * scale) + offset``, so the weight
    is quantized *after* folding, as TFLite's converter folds batch norm.

    A matmul whose weight has several output axes (``nn.DenseGeneral`` with
    ``features=(heads, head_dim)``) runs as a Dense on the weight with those axes
    flattened (``params``: its dimension numbers), then a reshape to ``shape``; its
    output channels are the result's last axes, of sizes ``channels``.
    """

    eqn: Any
    x: Any
    w: Any
    w_axis: int
    out_axis: int
    scale: Any = None
    offset: Any = None
    params: dict[str, Any] | None = None
    shape: tuple[int, ...] | None = None
    channels: tuple[int, ...] = ()


class Interpreter:
    """Runs a jaxpr, inserting (annotate), observing (calibrate) or training (QAT) sites.

    Args:
        calibration: The ranges (and the rules they were made with).
        observe: Record ranges instead of quantizing (calibration).
        strict: Raise on ops that cannot be quantized.
        train: Straight-through fake quantization for QAT.
        state: In training, ``site -> [lo, hi, count]`` (traced); updated into
            ``new_state`` when ``update_ranges``.
    """

    def __init__(
        self,
        calibration: Calibration,
        *,
        observe: bool,
        strict: bool,
        train: bool = False,
        state: dict[str, Any] | None = None,
        update_ranges: bool = False,
    ) -> None:
        self.cal, self.observing, self.strict, self.train = calibration, observe, strict, train
        self.state, self.update_ranges = state, update_ranges
        self.new_state: dict[str, Any] = {}
        self.counter = 0
        self.used_rules: set[int] = set()
        self.op_paths: dict[int, str] = {}  # id of each typed equation -> its module path
        self.seen: set[str | None] = set()  # the types used: "int8", "int16", "int4", None
        # The ops computed in float: (name, whether qlitert chose it: an island).
        self.float_ops: list[tuple[str, bool]] = []
        self.outer: list[str] = []  # name stacks of the calls being interpreted

    # -- where and how -------------------------------------------------------

    def where(self, eqn: Any | None) -> str:
        """The name stack of ``eqn`` (its caller's inside calls that record none)."""
        stack = "" if eqn is None else str(eqn.source_info.name_stack)
        return stack or (self.outer[-1] if self.outer else "")

    def describe(self, eqn: Any | None) -> str:
        """The module of ``eqn`` for messages: its path, or the root's class name."""
        where = self.where(eqn)
        path = scopes.module_path(where)
        if path:
            return repr(path)
        root = where.split("/")[0]
        return f"'' (the root module{' ' + root if root else ''})"

    def types(self, eqn: Any | None) -> rules.OpTypes:
        """The LiteRT types of ``eqn``'s outputs and weights (``None``: the boundary)."""
        path = scopes.module_path(self.where(eqn))
        if eqn is not None:
            self.op_paths[id(eqn)] = path
        i, types = rules.lookup(self.cal.rules, path)
        if i is not None:
            self.used_rules.add(i)
        return types

    # -- quantization --------------------------------------------------------

    def fq(self, x: Any, q: Rep, site: str, *, pool_count: int | None = None) -> Any:
        """Fake quantization with ``q``'s (per-tensor) parameters: annotation or QAT.

        ``site`` names it in the layer-by-layer validation's reports.
        """
        if self.train:
            qmin, qmax = qdq.RANGES[q.qtype]
            scale, zp = (_scalar(v) for v in (q.scale, q.zero_point))
            y = qdq.quantize_dequantize(
                jax.lax.stop_gradient(x), scale, zp, qmin, qmax, pool_count=pool_count
            )
            return _ste(x, jax.lax.stop_gradient(y))
        return qdq.fake_quant(
            x, q.scale, q.zero_point, qtype=q.qtype, pool_count=pool_count, site=site
        )

    def key(self, eqn: Any | None, label: str) -> str:
        """The next site's name: its :class:`~qlitert.scopes.SiteKey`, rendered."""
        key = scopes.SiteKey(self.counter, label, self.where(eqn))
        self.counter += 1
        return str(key)

    def site(
        self,
        x: Any,
        eqn: Any | None,
        label: str,
        types: rules.OpTypes | None = None,
        *,
        checked: bool = True,
    ) -> tuple[Any, Rep]:
        """A quantization site on ``x`` (float when the rule's ``act_qtype`` is None).

        ``checked=False``: the layer-by-layer validation does not look for its tensor
        (the converter may fold it away).
        """
        key = self.key(eqn, label)
        qtype = (types or self.types(eqn)).act
        self.seen.add(qtype)
        if qtype is None:
            return x, Rep("float")
        if self.observing:
            self.cal.observe(key, np.asarray(x))
            return x, Rep("q", qtype=qtype)
        if self.train and self.state is not None:
            if key not in self.state:
                self.cal.params(key)  # raises the "never calibrated" error
            entry = self.state[key]
            if self.update_ranges:
                entry = update_range(entry, x, self.cal.momentum)
            self.new_state[key] = entry
            scale, zp = jax.lax.stop_gradient(qdq.range_params(entry[0], entry[1], qtype))
            q = Rep("q", scale, zp, qtype)
        else:
            scale, zp = self.cal.params(key, qtype)
            q = Rep("q", scale, zp, qtype)
        with contextlib.nullcontext() if checked else qdq._untapped():
            return self.fq(x, q, key), q

    def materialize(
        self, x: Any, q: Rep, eqn: Any | None, label: str, *, float_op: bool = False
    ) -> tuple[Any, Rep]:
        """``x`` as an input of ``eqn``: quantized, unless ``eqn`` computes in float.

        A quantized input of another type than ``eqn``'s (int8 into a 16x8 op, or
        back) gets a site of ``eqn``'s type: a requantization. An optimization
        barrier separates it from the producer's site, so that litert-converter
        0.5.0 keeps both (without one it merges consecutive quantizations into the
        last, converting the producer with the consumer's type): it writes a
        DEQUANTIZE / QUANTIZE pair, which :func:`qlitert.converter.fuse_requantizations`
        makes one integer QUANTIZE.
        """
        x, q = self._materialize(x, q, eqn, label, float_op=float_op)
        if eqn is None or float_op or q.kind != "q":
            return x, q
        types = self.types(eqn)
        if types.act is not None and types.act != q.qtype:
            return self.site(jax.lax.optimization_barrier(x), eqn, f"{label}.requantized", types)
        return x, q

    def _materialize(self, x: Any, q: Rep, eqn: Any | None, label: str, *, float_op: bool) -> tuple:
        if q.kind == "int":  # indices, counts: not quantized
            return x, q
        if q.inherit:  # TFLite's AVERAGE_POOL_2D keeps its input's scale: no new site
            done = dataclasses.replace(q, kind="q", inherit=0, origin=None)
            if self.observing:
                return x, done
            return self.fq(x, done, f"{label} (pooled)", pool_count=q.inherit), done
        if q.kind == "pending":  # the producer's rule types its output
            return self.site(x, eqn, label, self.types(q.origin))
        if float_op or q.kind == "q":
            return x, q
        return self.site(x, eqn, label if q.kind == "float" else f"{label}.const")

    def weight(self, w: Any, axis: int | None, qtype: str | None, eqn: Any) -> Any:
        """A matmul/convolution weight of ``eqn``: symmetric narrow range, per output channel.

        Raises:
            ValueError: For a concrete weight holding NaN or inf (naming the module).
        """
        self.seen.add(qtype)
        if self.observing or qtype is None:
            return w
        if self.train:
            return _ste_weight(w, axis, qdq.RANGES[qtype][1])
        w = np.asarray(w, np.float32)
        bad = int(w.size - np.count_nonzero(np.isfinite(w)))
        if bad:
            raise ValueError(
                f"the weight of {eqn.primitive.name} in module {self.describe(eqn)} has {bad} "
                "non-finite values (NaN or inf); quantizing would hide them: fix or mask the "
                "weights first"
            )
        if axis is None:
            absmax = max(float(np.max(np.abs(w))), 1e-12)
            scale = np.array([absmax / qdq.RANGES[qtype][1]], np.float32)
            return qdq.fake_quant(jnp.asarray(w), scale, narrow_range=True, qtype=qtype)
        return qdq.fake_quant(
            jnp.asarray(w),
            qdq.weight_scales(w, axis, qtype),
            narrow_range=True,
            axis=axis,
            qtype=qtype,
        )

    # -- the jaxpr -----------------------------------------------------------

    def run(
        self, jaxpr: Any, consts: list[Any], args: list[tuple[Any, Rep]]
    ) -> list[tuple[Any, Rep]]:
        """Interprets ``jaxpr``; returns its outputs with their representations."""
        env: dict[Any, tuple[Any, Rep]] = {}

        def read_raw(v: Any) -> tuple[Any, Rep]:
            if isinstance(v, jex.core.Literal):
                return v.val, Rep("const")
            return env[v]

        def read(v: Any) -> tuple[Any, Rep]:
            return self.realize(read_raw(v))

        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = (c, Rep("const"))
        for v, a in zip(jaxpr.invars, args, strict=True):
            env[v] = a
        eqns, i = list(jaxpr.eqns), 0
        while i < len(eqns):
            kind, n = _match(eqns, i)
            if kind in _INT8_ONLY and self.types(eqns[i + n - 1]).act == "int16":
                kind = None  # LiteRT has no int16 kernel for it: its ops one by one
            if kind is not None:
                block = eqns[i : i + n]
                env[block[-1].outvars[0]] = self.fused(kind, block, read)
                i += n
                continue
            eqn = eqns[i]
            ins = [read_raw(v) for v in eqn.invars]
            outs = self.eqn(eqn, ins)
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
            i += 1
        return [read(v) for v in jaxpr.outvars]

    def fused(self, kind: str, block: list[Any], read: Callable[[Any], Any]) -> tuple[Any, Rep]:
        """A softmax or GELU block: one TFLite kernel, quantized input and output only."""
        types = self.types(block[-1])
        x, q = read(_block_input(block))
        x, q = self.materialize(x, q, block[0], kind, float_op=types.act is None)
        fence = _fence(types.act is None and q.kind == "q")
        if types.act is None:
            self.float_ops.append((kind, False))
        x = fence(x)

        def replay(x: Any) -> Any:
            local: dict[Any, Any] = {_block_input(block): x}

            def value(v: Any) -> Any:
                if isinstance(v, jex.core.Literal):
                    return v.val
                return local[v] if v in local else read(v)[0]

            for eqn in block:
                ins = [value(v) for v in eqn.invars]
                kept = _unbounded(eqn.primitive.name, ins)
                if kept is not None:
                    # the max's initial -inf: left in, the converter does not recognise
                    # the block as one LOG_SOFTMAX kernel
                    local[eqn.outvars[0]] = ins[kept]
                    continue
                for v, o in zip(eqn.outvars, _bind(eqn, ins), strict=True):
                    local[v] = o
            return local[block[-1].outvars[0]]

        y = _moved_softmax(block, x) if kind == "softmax" else None
        if kind == "gelu_exact" and not self.train:  # (jax.grad cannot go through composites)
            # litert-converter 0.5.0 expands erfc into float arithmetic, but lowers
            # PyTorch's exact gelu composite (approximate="none") to one GELU kernel.
            gelu = jax.lax.composite(lambda v, **_: replay(v), name="aten.gelu.default")
            y = gelu(x, approximate="none")
        y = fence(replay(x) if y is None else y)
        if kind not in ("softmax", "log_softmax") or types.act is None:
            return self.site(y, block[-1], kind, types)
        if kind == "log_softmax" and types.act != "int8":
            raise UnsupportedOpError(
                f"log_softmax in module {self.describe(block[-1])} computes in "
                f"{types.act}; LiteRT's LOG_SOFTMAX kernel takes int8 only"
            )
        return self.fixed_site(y, block[-1], kind, types.act)

    def fixed_site(self, y: Any, eqn: Any, kind: str, qtype: str | None) -> tuple[Any, Rep]:
        """A site whose parameters LiteRT's kernel fixes (numbered as the others)."""
        if qtype is None or (kind, qtype) not in _FIXED_OUTPUT:
            raise UnsupportedOpError(f"{kind} has no fixed {qtype} output parameters in LiteRT")
        key = self.key(eqn, kind)
        scale, zero_point = _FIXED_OUTPUT[kind, qtype]
        fixed = Rep("q", np.array([scale], np.float32), np.array([zero_point], np.int64), qtype)
        return (y if self.observing else self.fq(y, fixed, key)), fixed

    def realize(self, entry: tuple[Any, Rep]) -> tuple[Any, Rep]:
        """Computes a deferred contraction (with its folded constants)."""
        d, q = entry
        if not isinstance(d, _Deferred):
            return entry
        w = d.w
        if d.scale is not None:
            with jax.ensure_compile_time_eval():  # a concrete weight stays concrete
                w = w * _along(d.scale, np.ndim(w), d.w_axis)
        w = self.weight(w, d.w_axis, self.types(d.eqn).weight, d.eqn)
        y = d.eqn.primitive.bind(d.x, w, **(d.params or d.eqn.params))
        if d.offset is not None:
            y = y + jnp.asarray(_along(d.offset, y.ndim, d.out_axis), y.dtype)
        return (y if d.shape is None else jnp.reshape(y, d.shape)), q

    def fold(self, eqn: Any, ins: list[tuple[Any, Rep]]) -> list[tuple[Any, Rep]] | None:
        """Folds ``deferred (+|-|*|/) constant`` into the deferred contraction, if it fits."""
        name = eqn.primitive.name
        if name not in ("add", "sub", "mul", "div") or len(ins) != 2:
            return None
        (x, qx), (c, qc) = ins
        if not isinstance(x, _Deferred) and name in ("add", "mul"):
            (c, qc), (x, qx) = ins
        if not isinstance(x, _Deferred) or qc.kind != "const":
            return None
        if self.types(eqn).act is None and self.types(x.eqn).act is not None:
            return None  # a float module's op after a quantized contraction: float
        # Constants stay numpy (static composite attributes) unless training traces them.
        xp: Any = jnp if self.train else np
        ndim = eqn.outvars[0].aval.ndim
        channels = x.channels or (eqn.outvars[0].aval.shape[x.out_axis],)
        first = x.out_axis if x.shape is None else ndim - len(channels)
        v = _channel_vector(xp, c, ndim, first, channels)
        if v is None:
            return None
        n = int(np.prod(channels))
        one, zero = xp.ones((n,), xp.float32), xp.zeros((n,), xp.float32)
        scale = one if x.scale is None else x.scale
        offset = zero if x.offset is None else x.offset
        if name == "add":
            offset = offset + v
        elif name == "sub":
            offset = offset - v
        elif name == "mul":
            scale, offset = scale * v, offset * v
        else:
            scale, offset = scale / v, offset / v
        return [(dataclasses.replace(x, scale=scale, offset=offset), qx)]

    def eqn(self, eqn: Any, ins: list[tuple[Any, Rep]]) -> list[tuple[Any, Rep]]:
        """One equation: how TFLite computes it decides where its sites go."""
        folded = self.fold(eqn, ins)
        if folded is not None:
            return folded
        ins = [self.realize(e) for e in ins]
        name = eqn.primitive.name
        values = [x for x, _ in ins]
        kinds = [q.kind for _, q in ins]
        inner = next((eqn.params[k] for k in CALLS if k in eqn.params), None)
        if eqn.params.get("name") in NAMED_KERNELS and all(k == "const" for k in kinds[1:]):
            types = self.types(eqn)
            x, q = self.materialize(values[0], ins[0][1], eqn, name, float_op=types.act is None)
            fence = _fence(types.act is None and q.kind == "q")
            if types.act is None:
                self.float_ops.append((str(eqn.params["name"]), False))
            out = fence(_bind(eqn, [fence(x), *values[1:]])[0])
            return [self.site(out, eqn, str(eqn.params["name"]), types)]
        if name == "scan":
            return self.scan(eqn, ins)
        if name == "while":  # (a fixed-length loop is a scan, unrolled above)
            what = (
                "op 'while' (jax.lax.while_loop: no static trip count to unroll; allowed: "
                "jax.lax.scan, fori_loop with static bounds, nn.RNN)"
            )
            return self.unsupported(eqn, ins, what)
        if inner is not None:
            closed = inner if hasattr(inner, "jaxpr") else None
            jaxpr = closed.jaxpr if closed is not None else inner
            consts = list(closed.consts) if closed is not None else []
            skip = eqn.params.get("num_consts", 0) if name.startswith("custom_vjp") else 0
            self.outer.append(self.where(eqn))
            try:
                return self.run(jaxpr, consts, ins[skip:] if skip else ins)
            finally:
                self.outer.pop()
        if all(k == "const" for k in kinds):  # constant folding (bias reshapes...)
            # Eagerly, even inside jax.export's trace: folded weights must stay
            # concrete to become static composite attributes.
            with jax.ensure_compile_time_eval():
                return [(o, Rep("const")) for o in _bind(eqn, values)]
        if name == "convert_element_type" and jnp.issubdtype(eqn.params["new_dtype"], jnp.floating):
            if kinds[0] != "int":
                return [ins[0]]  # float to float: the same values, the same site
            # Integers to float (a mask): LiteRT's CAST, then a quantization site of its own.
            types = self.types(eqn)
            if types.act is None:
                return self.float_op(eqn, ins)
            # Unchecked: a mask compared again goes back to its integers, and the
            # converter drops the quantized copy nothing reads (its codes are exact).
            y, q = self.site(_bind(eqn, values)[0], eqn, name, types, checked=False)
            return [(y, dataclasses.replace(q, source=values[0]))]
        back = _from_integers(eqn, ins)
        if back is not None:  # a mask converted to float, compared or converted back
            return [(o, Rep("int")) for o in _bind(eqn, back)]
        if all(k in ("int", "const") for k in kinds) and _integer(eqn.outvars):
            return [(o, Rep("int")) for o in _bind(eqn, values)]  # index arithmetic, masks
        types = self.types(eqn)
        if "masked" in kinds:
            masked = self.masked(eqn, ins, types)
            if masked is not None:
                return masked
            ins = [(x, Rep("float")) if q.kind == "masked" else (x, q) for x, q in ins]
            kinds = [q.kind for _, q in ins]
        clamp = self.clamp(eqn, ins, types)
        if clamp is not None:
            return [clamp]
        if types.act is None and name not in PRESERVING:
            return self.float_op(eqn, ins)
        dilation = tuple(eqn.params.get("lhs_dilation") or ())
        if name == "conv_general_dilated" and any(d != 1 for d in dilation):
            return [self.transposed(eqn, ins, types)]
        if name in ("dot_general", "conv_general_dilated"):
            return [self.contraction(eqn, ins, types)]
        kept = _unbounded(name, values)
        if kept is not None:
            # max(x, -inf) and min(x, inf) (jnp.max's initial=-inf) are x: an infinite
            # constant has no quantization parameters.
            return [ins[kept]]
        if name == "reduce_window_sum":  # average pool (with the div): input's scale
            if any(lo or hi for lo, hi in eqn.params["padding"]):
                return self.unsupported(eqn, ins, "average pooling with padding ('SAME')")
            x, q = self.materialize(values[0], ins[0][1], eqn, name)
            n = int(np.prod(eqn.params["window_dimensions"]))
            return [(_bind(eqn, [x])[0], dataclasses.replace(q, kind="pending", inherit=n))]
        if name == "reduce_sum":  # a mean (with a div) or a sum: a new scale
            x, _ = self.materialize(values[0], ins[0][1], eqn, name)
            return [(_bind(eqn, [x])[0], Rep("pending", origin=eqn))]
        if name == "div" and kinds[0] != "const" and kinds[1] == "const":
            if _pool_or_mean(ins[0][1], values[1]):  # AVERAGE_POOL_2D or MEAN
                return [(_bind(eqn, values)[0], ins[0][1])]
            if ins[0][1].inherit:
                what = f"a window sum divided by another number than its size {ins[0][1].inherit}"
                return self.unsupported(eqn, ins, what)
            return [self.reciprocal_mul(eqn, ins, types)]
        if name in PRESERVING and kinds[0] == "pending" and name != "reduce_max":
            # same values: quantize later
            return [(o, ins[0][1]) for o in _preserve(eqn, values)]
        if name in PRESERVING and kinds[0] in ("q", "float", "const", "pending"):
            # (A constant here is a table that gather/dynamic_slice look up: int8 too.)
            x, q = self.materialize(values[0], ins[0][1], eqn, name)
            return [(o, q) for o in _preserve(eqn, [x, *values[1:]])]
        if name == "select_n" and kinds[0] == "int":  # jnp.where(mask, x, y)
            return [self.select(eqn, ins, types)]
        if name == "concatenate" and types.act == "int16":
            what = "an int16 concatenate (litert-converter 0.5.0 has no int16 CONCATENATION)"
            return self.unsupported(eqn, ins, what)
        if name == "concatenate":
            # TFLite's CONCATENATION shares one scale: the converter writes a matmul/
            # convolution output feeding it at the concat's scale (one rounding) and
            # requantizes quantized inputs, which fake quantization of the result
            # after the concat mirrors.
            # (An add read by the concat and by another op has one output tensor, with
            # the other reader's parameters: it is quantized before the concat.)
            xs = [
                x if _raw_into_concat(q) else self.materialize(x, q, eqn, name)[0] for x, q in ins
            ]
            return [self.site(_bind(eqn, xs)[0], eqn, name, types)]
        if name == "integer_pow" and eqn.params["y"] > 2:
            # litert-converter 0.5.0 turns x**3 into two MULs with no quantization
            # between them (float); one site per product keeps every MUL integer.
            x, _ = self.materialize(values[0], ins[0][1], eqn, name)
            y, q = x, ins[0][1]
            for _ in range(int(eqn.params["y"]) - 1):
                y, q = self.site(y * x, eqn, name, types)
            return [(y, q)]
        if name == "rsqrt" and types.act == "int16":
            # LiteRT 2.3.0's int16 RSQRT misses the exact value by up to 44 steps on
            # [0.5, 1.7] and by thousands on [0.01, 10]: a LayerNorm's rsqrt (one
            # value per row) is computed in float, between a DEQUANTIZE and a QUANTIZE.
            return self.float_op(eqn, ins, island=True)
        if name in COMPUTING:
            if types.act == "int16" and name in _SAME_SHAPE_INT16:
                ins = [self.same_shape(e, eqn) for e in ins]
            xs = [self.materialize(x, q, eqn, name)[0] for x, q in ins]
            if name == "rsqrt":  # LiteRT's RSQRT of code zero is its largest value, not inf
                xs = [jnp.maximum(xs[0], jnp.finfo(xs[0].dtype).tiny)]
            out = _bind(eqn, xs)[0]
            if (name, types.act) in _FIXED_OUTPUT:
                return [self.fixed_site(out, eqn, name, types.act)]
            if name in _DEFERRED_ADDS and types.act == "int8":
                # Quantized where it is read, like a matmul: a ReLU after a residual
                # add is the ADD's fused activation (litert-converter 0.5.0 fuses it
                # and gives the ADD the ReLU's parameters).
                return [(out, Rep("pending", origin=eqn))]
            return [self.site(out, eqn, name, types)]
        return self.unsupported(eqn, ins, f"op {name!r}")

    def clamp(self, eqn: Any, ins: list[tuple[Any, Rep]], types: Any) -> tuple[Any, Rep] | None:
        """A clamp keeping its input's quantization parameters, or None (another op).

        A clamp is ``max``/``min`` of an activation and a constant (ReLU, ReLU6, clip).

        A quantized clamp costs no quantization of its own: right after a quantized
        producer whose site is not placed yet (a matmul, a convolution, an int8 add)
        it is fused into it (exact on the producer's codes); after any other
        quantized op, or a requantization to its type (an int16 LayerNorm read by an
        int8 ReLU), it keeps its input's parameters: LiteRT's ``MAXIMUM``/``MINIMUM``
        share one scale between input and output, and a ``QUANTIZE`` takes no fused
        activation. After a float module's op it is quantized after the clamp, as
        that op's output would be. A float module's clamp is a float op (None).
        """
        kinds = sorted(q.kind for _, q in ins)
        if eqn.primitive.name not in ("max", "min") or kinds not in (
            ["const", "pending"],
            ["const", "q"],
            ["const", "float"],
        ):
            return None
        values = [x for x, _ in ins]
        i = next(k for k, (_, q) in enumerate(ins) if q.kind != "const")
        q = ins[i][1]
        if types.act is None:
            return None  # a float module's clamp: a float op
        if q.kind == "pending" and not q.inherit:
            return _bind(eqn, values)[0], q
        if q.kind == "float":
            # After a float module: computed in float, then quantized once, like a
            # float op's output read by a quantized one.
            return _bind(eqn, values)[0], Rep("pending", origin=eqn)
        if q.kind != "q":
            return None
        values[i], q = self.materialize(values[i], q, eqn, eqn.primitive.name)
        y = _bind(eqn, values)[0]
        if self.observing:
            return y, q
        # The same parameters again (exact: the clamp's constant is on the grid), so
        # that the converter sees a quantized output and keeps the op integer.
        return self.fq(y, q, f"{eqn.primitive.name} (clamped)@{self.where(eqn)}"), q

    def same_shape(self, entry: tuple[Any, Rep], eqn: Any) -> tuple[Any, Rep]:
        """An operand of an int16 ``eqn`` whose kernel takes one shape, broadcast to it.

        A constant is stored at the full shape. An activation is broadcast behind an
        optimization barrier and quantized again with its own parameters:
        litert-converter 0.5.0 folds a plain broadcast back into the int16 ``ADD``
        (whose kernel then refuses it); with the barrier it writes DEQUANTIZE, a
        float ``BROADCAST_TO`` and QUANTIZE, which
        :func:`qlitert.converter.integer_broadcasts` makes one int16 ``BROADCAST_TO``.
        """
        x, q = entry
        shape = tuple(eqn.outvars[0].aval.shape)
        if np.shape(x) == shape:
            return entry
        if q.kind == "const":  # a full constant (a broadcast view stays a broadcast)
            return np.array(np.broadcast_to(np.asarray(x), shape)), q
        label = f"{eqn.primitive.name}.broadcast"
        x, q = self.materialize(x, q, eqn, label)
        y = jax.lax.optimization_barrier(jnp.broadcast_to(x, shape))
        if self.observing or q.kind != "q":
            return y, q
        return self.fq(y, q, f"{label} (to {shape})"), q

    def scan(self, eqn: Any, ins: list[tuple[Any, Rep]]) -> list[tuple[Any, Rep]]:
        """A fixed-length ``jax.lax.scan`` (``nn.RNN``, ``fori_loop``), unrolled.

        The body runs once per step on the step's slices, carrying the carry, as an
        exported model then does (each step's ops get sites of their own). The
        stacked outputs get one site: LiteRT's CONCATENATION shares one scale.
        """
        p = eqn.params
        closed, n_consts, n_carry = p["jaxpr"], p["num_consts"], p["num_carry"]
        consts, carry = ins[:n_consts], ins[n_consts : n_consts + n_carry]
        xs = [
            self.materialize(x, q, eqn, "scan") if q.kind == "pending" else (x, q)
            for x, q in ins[n_consts + n_carry :]
        ]
        steps = range(p["length"] - 1, -1, -1) if p["reverse"] else range(p["length"])
        ys: list[list[tuple[Any, Rep]]] = []
        self.outer.append(self.where(eqn))
        try:
            for t in steps:
                sliced = [(_step(x, q, t), q) for x, q in xs]
                outs = self.run(closed.jaxpr, list(closed.consts), [*consts, *carry, *sliced])
                carry, y = outs[:n_carry], outs[n_carry:]
                ys.append(y)
        finally:
            self.outer.pop()
        if p["reverse"]:
            ys.reverse()
        stacked = []
        for j, outvar in enumerate(eqn.outvars[n_carry:]):
            column = [y[j] for y in ys]
            kinds = {q.kind for _, q in column}
            if kinds <= {"const"}:
                with jax.ensure_compile_time_eval():
                    stacked.append((jnp.stack([x for x, _ in column]), Rep("const")))
            elif kinds <= {"int"} or self.types(eqn).act is None:
                stacked.append((jnp.stack([x for x, _ in column]), Rep(column[0][1].kind)))
            else:
                xs_j = [self.materialize(x, q, eqn, "scan")[0] for x, q in column]
                stacked.append(self.site(jnp.stack(xs_j).astype(outvar.aval.dtype), eqn, "scan"))
        return [*carry, *stacked]

    def select(
        self,
        eqn: Any,
        ins: list[tuple[Any, Rep]],
        types: rules.OpTypes,
        bind: Callable[[Any, list[Any]], Any] | None = None,
    ) -> tuple:
        """``select_n`` on an integer or boolean predicate: LiteRT's int8 SELECT_V2.

        With one non-constant case (``jnp.where(mask, scores, big_negative)``), the
        output keeps its scale and the constants are quantized with it: an
        attention mask's ``finfo.min`` becomes the range's minimum, not a range
        of 1e38 that would leave the scores no resolution. With constant cases
        only, each one number (``jnp.where(mask, 0.0, finfo.min)``, BERT's additive
        mask), the value is *masked*: an add consumes it (:meth:`masked`).
        Otherwise the output has a site of its own, the converter requantizing the
        cases to it. ``bind(predicate, cases)`` computes the select (default: ``eqn``).
        """
        (p, _), cases = ins[0], ins[1:]
        live = [i for i, (_, q) in enumerate(cases) if q.kind != "const"]
        fills = [_uniform(c) for c, _ in cases]
        if not live and bind is None and all(f is not None for f in fills):
            return _bind(eqn, [p, *[c for c, _ in cases]])[0], Rep("masked", source=(p, fills))
        if bind is None:
            bind = lambda p, xs: _bind(eqn, [p, *xs])[0]  # noqa: E731 - the default
        if len(live) != 1:
            xs = [self.materialize(x, q, eqn, "select_n")[0] for x, q in cases]
            return self.site(bind(p, xs), eqn, "select_n", types)
        x, q = self.materialize(*cases[live[0]], eqn, "select_n")
        xs = []
        for i, (c, _) in enumerate(cases):
            if i == live[0]:
                xs.append(x)
            elif self.observing:  # no parameters yet: the range the site will have
                xs.append(jnp.clip(jnp.asarray(c, x.dtype), jnp.min(x), jnp.max(x)))
            else:
                with jax.ensure_compile_time_eval():
                    c = jnp.broadcast_to(jnp.asarray(c, x.dtype), np.shape(x))
                xs.append(self.fq(c, q, "select_n.const"))
        return bind(p, xs), q

    def masked(
        self, eqn: Any, ins: list[tuple[Any, Rep]], types: rules.OpTypes
    ) -> list[tuple[Any, Rep]] | None:
        """An op on a *masked* value (see :meth:`select`), or None to quantize it as usual.

        A shape op (a reshape, a broadcast) applies to the predicate too. An add of an
        activation ``x`` and a mask whose cases are 0 and fills of at most
        :data:`MASK_FILL` (``scores + where(mask, 0, finfo.min)``) is the select
        ``where(mask, x, fill)``: the fill becomes the lowest value of ``x``'s range,
        instead of a range of 1e38 that would leave ``x`` no resolution.
        """
        name = eqn.primitive.name
        (x, q), rest = ins[0], ins[1:]
        if name in PRESERVING and q.kind == "masked":
            p, fills = q.source
            shaped = _preserve(eqn, [x, *[v for v, _ in rest]])[0]
            p = _preserve(eqn, [p, *[v for v, _ in rest]])[0]
            return [(shaped, Rep("masked", source=(p, fills)))]
        if name != "add" or sorted(k.kind for _, k in ins) == ["masked", "masked"]:
            return None
        (x, q), (_, m) = ins if ins[1][1].kind == "masked" else ins[::-1]
        p, fills = m.source
        if sorted(f == 0 for f in fills) != [False, True] or max(fills) != 0:
            return None
        shape = tuple(eqn.outvars[0].aval.shape)
        if min(fills) > MASK_FILL or np.shape(x) != shape:
            return None
        p = jnp.broadcast_to(p, shape)  # lax.add broadcasts dimensions of size 1
        dtype = eqn.outvars[0].aval.dtype
        cases = [
            (x, q) if f == 0 else (np.full(np.shape(x), f, dtype), Rep("const")) for f in fills
        ]
        select = lambda p, xs: jax.lax.select_n(p, *xs)  # noqa: E731
        return [self.select(eqn, [(p, Rep("int")), *cases], types, bind=select)]

    def reciprocal_mul(self, eqn: Any, ins: list[tuple[Any, Rep]], types: rules.OpTypes) -> tuple:
        """``x / c`` as LiteRT computes it: an int8 MUL by the quantized reciprocal ``1 / c``.

        (The converter turns a division by a constant into that MUL; quantizing ``c``
        itself would quantize another constant than the kernel's.)
        """
        (x, q), (c, _) = ins
        with jax.ensure_compile_time_eval():  # a concrete constant stays concrete
            dtype = eqn.outvars[0].aval.dtype
            r = jnp.asarray(1, dtype) / jnp.asarray(c, dtype)
        x, _ = self.materialize(x, q, eqn, "div")
        r, _ = self.materialize(r, Rep("const"), eqn, "div")
        return self.site(jax.lax.mul(x, jnp.broadcast_to(r, np.shape(x))), eqn, "div", types)

    def unsupported(self, eqn: Any, ins: list[tuple[Any, Rep]], what: str) -> list:
        """Raises (strict), or computes ``eqn`` in float."""
        if self.strict:
            raise UnsupportedOpError(
                f"{what} in module {self.describe(eqn)} cannot be quantized for LiteRT by "
                "qlitert; pass strict=False to leave it in float, or a rule without "
                "act_qtype for its module"
            )
        return self.float_op(eqn, ins)

    def float_op(
        self, eqn: Any, ins: list[tuple[Any, Rep]], *, island: bool = False
    ) -> list[tuple[Any, Rep]]:
        """``eqn`` computed in float: quantized inputs are dequantized, output float.

        An op reading a quantized value gets optimization barriers around it (so does
        an ``island``): litert-converter 0.5.0 otherwise converts an op between two
        quantizations with their type (a float module's ``tanh`` or softmax after an
        int8 Dense became an int8 kernel, an int16 module's float ``rsqrt`` an int16
        ``RSQRT``). Ops reading only float values get none, so float modules keep
        the converter's fusions (a bias add into its ``FULLY_CONNECTED``).
        """
        name = eqn.primitive.name
        self.seen.add(None)
        self.float_ops.append((name, island))
        xs = [self.materialize(x, q, eqn, name, float_op=True) for x, q in ins]
        barrier = _fence(island or any(q.kind == "q" for _, q in xs))
        values = [barrier(x) if q.kind == "q" else x for x, q in xs]
        # An integer result (argmax, a comparison's indices) is data, not a float
        # activation: it is never quantized.
        outs = zip(_bind(eqn, values), eqn.outvars, strict=True)
        return [(o, Rep("int")) if _integer([v]) else (barrier(o), Rep("float")) for o, v in outs]

    def transposed(self, eqn: Any, ins: list[tuple[Any, Rep]], types: rules.OpTypes) -> tuple:
        """A strided transposed convolution (``lhs_dilation``): zeros inserted, then a convolution.

        litert-converter 0.5.0 turns ``lhs_dilation`` into a ``TRANSPOSE_CONV`` that
        LiteRT refuses to load ('SAME' padding: ``computed_input_height !=
        SizeOfDimension(input, 1)``), keeps in float ('VALID') or cannot convert
        (explicit padding). Dilating the quantized input first (int8 ``RESHAPE``,
        ``PAD`` with the zero point, ``SLICE``: zero is exact) leaves a plain
        convolution, the same sums.
        """
        (x, qx), w = ins
        x, qx = self.materialize(x, qx, eqn, f"{eqn.primitive.name}.lhs")
        spatial = eqn.params["dimension_numbers"].lhs_spec[2:]
        for axis, d in zip(spatial, eqn.params["lhs_dilation"], strict=True):
            x = _dilate(x, int(axis), int(d))
        ones = (1,) * len(eqn.params["lhs_dilation"])
        return self.contraction(
            eqn.replace(params={**eqn.params, "lhs_dilation": ones}), [(x, qx), w], types
        )

    def contraction(self, eqn: Any, ins: list[tuple[Any, Rep]], types: rules.OpTypes) -> tuple:
        """A matmul/convolution: a constant weight is deferred to fold what follows."""
        (a, qa), (b, qb) = ins
        name = eqn.primitive.name
        pending = Rep("pending", origin=eqn)
        if qa.kind == "const" and qb.kind != "const":
            # A constant on the left (e.g. jax.image.resize's interpolation matrices):
            # the converter transposes around a FULLY_CONNECTED; one scale, no folding.
            b, _ = self.materialize(b, qb, eqn, f"{name}.rhs")
            return _bind(eqn, [self.weight(a, None, types.weight, eqn), b])[0], pending
        a, _ = self.materialize(a, qa, eqn, f"{name}.lhs")
        w_axis = _out_axis(eqn, np.ndim(b)) if qb.kind == "const" else None
        if qb.kind == "const" and w_axis is not None:
            return _Deferred(eqn, a, b, w_axis, _result_axis(eqn)), pending
        flat = _flatten_outputs(eqn, b) if qb.kind == "const" else None
        if flat is not None:
            w, params, channels = flat
            shape = eqn.outvars[0].aval.shape
            out = len(shape) - len(channels)  # the flat result's channel axis
            d = _Deferred(eqn, a, w, np.ndim(w) - 1, out, params=params, shape=shape)
            return dataclasses.replace(d, channels=channels), pending
        if qb.kind == "const":
            b = self.weight(b, w_axis, types.weight, eqn)
        else:
            b, _ = self.materialize(b, qb, eqn, f"{name}.rhs")
        return _bind(eqn, [a, b])[0], pending


# Primitive sequences of jax.nn.softmax and of gelu (Flax's tanh approximation, and
# the exact one) in jax 0.10.2's jaxprs; the converter turns each into one SOFTMAX /
# GELU kernel when no quantization sits inside.
_FUSED = {
    "softmax": [
        ["reduce_max", "max", "broadcast_in_dim", "stop_gradient", "sub", "exp",
         "reduce_sum", "broadcast_in_dim", "div"],
        ["reduce_max", "broadcast_in_dim", "stop_gradient", "sub", "exp", "reduce_sum",
         "broadcast_in_dim", "div"],
        # under vmap (nnx.MultiHeadAttention): the input and its max are transposed
        ["reduce_max", "max", "transpose", "broadcast_in_dim", "stop_gradient", "transpose",
         "sub", "exp", "reduce_sum", "broadcast_in_dim", "div"],
    ],
    "log_softmax": [
        ["reduce_max", "max", "broadcast_in_dim", "stop_gradient", "sub", "exp",
         "reduce_sum", "broadcast_in_dim", "log", "sub"],
        ["reduce_max", "broadcast_in_dim", "stop_gradient", "sub", "exp", "reduce_sum",
         "broadcast_in_dim", "log", "sub"],
    ],
    "gelu": [["integer_pow", "mul", "add", "mul", "tanh", "add", "mul", "mul"]],
    # jax.nn.gelu(approximate=False): x / 2 * erfc(-x / sqrt(2))
    "gelu_exact": [["mul", "neg", "mul", "erfc", "mul"]],
}  # fmt: skip
_INPUT_USES = {"softmax": 2, "log_softmax": 2, "gelu": 3, "gelu_exact": 2}
# Blocks whose one kernel takes int8 only (litert-converter 0.5.0's GELU).
_INT8_ONLY = ("gelu", "gelu_exact")
# jax.nn functions that run as named jit calls and that the converter turns into
# one int8 kernel (LEAKY_RELU, HARD_SWISH) when only their input and output are
# quantized.
NAMED_KERNELS = ("leaky_relu", "hard_silu", "hard_swish")


def _block_input(block: list[Any]) -> Any:
    """The input of a fused block: its first op's first variable (exact gelu's ``0.5 * x``)."""
    return next(v for v in block[0].invars if not isinstance(v, jex.core.Literal))


def _match(eqns: list[Any], i: int) -> tuple[str | None, int]:
    """The fused block (softmax, gelu) starting at ``eqns[i]``, and its length."""
    for kind, sequences in _FUSED.items():
        for names in sequences:
            block = eqns[i : i + len(names)]
            if [e.primitive.name for e in block] != names:
                continue
            x = _block_input(block)
            # The block's input feeds exactly these ops: softmax's reduce_max and sub;
            # gelu's integer_pow, first add and last mul; exact gelu's mul and neg.
            if sum(x in e.invars for e in block) == _INPUT_USES[kind]:
                return kind, len(names)
    return None, 0


def _moved_softmax(block: list[Any], x: Any) -> Any:
    """A softmax whose input is transposed inside it (vmap), as ``softmax(transpose(x))``.

    The converter fuses only the plain sequence into one SOFTMAX: with the
    transposes inside, it left a float SUB and SOFTMAX. None for a plain block.
    """
    x_var = _block_input(block)
    moves = [e for e in block if e.primitive.name == "transpose" and e.invars[0] is x_var]
    if not moves:
        return None
    perm = tuple(moves[0].params["permutation"])
    axes = tuple(perm.index(a) for a in block[0].params["axes"])
    return jax.nn.softmax(jnp.transpose(x, perm), axis=axes)


def _dilate(x: Any, axis: int, d: int) -> Any:
    """``x`` with ``d - 1`` zeros between its entries along ``axis`` (as ``lhs_dilation``).

    ``x`` is reshaped to ``(before * n, 1, after)`` and padded to ``(before * n, d,
    after)``: a three-dimensional ``PAD`` whatever the rank of ``x``.
    """
    n = x.shape[axis]
    if d == 1 or n == 1:
        return x
    before, after = int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis + 1 :]))
    y = jnp.pad(jnp.reshape(x, (before * n, 1, after)), ((0, 0), (0, d - 1), (0, 0)))
    y = jnp.reshape(y, (*x.shape[:axis], n * d, *x.shape[axis + 1 :]))
    return jax.lax.slice_in_dim(y, 0, (n - 1) * d + 1, axis=axis)


def _out_axis(eqn: Any, ndim: int) -> int | None:
    """The weight's output-channel axis (None: several, use one scale)."""
    if eqn.primitive.name == "conv_general_dilated":
        return int(eqn.params["dimension_numbers"].rhs_spec[0])
    (_, rc), (_, rb) = eqn.params["dimension_numbers"]
    free = [i for i in range(ndim) if i not in rc and i not in rb]
    return free[0] if len(free) == 1 and not rb else None


def _flatten_outputs(eqn: Any, w: Any) -> tuple[Any, dict[str, Any], tuple[int, ...]] | None:
    """A matmul weight with several output axes as one (the converter's FULLY_CONNECTED).

    Returns the weight as ``(contracted axes..., outputs)``, the dimension numbers
    that contract it, and the output axes' sizes; None for a convolution, a batched
    matmul or a weight with one output axis.
    """
    if eqn.primitive.name != "dot_general":
        return None
    (lc, rc), (_, rb) = eqn.params["dimension_numbers"]
    free = [i for i in range(np.ndim(w)) if i not in rc]
    if rb or len(free) < 2:
        return None
    kept = sorted(rc)
    channels = tuple(int(np.shape(w)[i]) for i in free)
    with jax.ensure_compile_time_eval():  # a concrete weight stays concrete
        flat = jnp.transpose(w, (*kept, *free))
        flat = jnp.reshape(flat, (*flat.shape[: len(kept)], -1))
    numbers = ((tuple(lc), tuple(kept.index(a) for a in rc)), ((), ()))
    return flat, dict(eqn.params, dimension_numbers=numbers), channels


def _result_axis(eqn: Any) -> int:
    """The output axis holding a contraction's output channels."""
    if eqn.primitive.name == "conv_general_dilated":
        return int(eqn.params["dimension_numbers"].out_spec[1])
    return eqn.outvars[0].aval.ndim - 1  # dot_general: the weight's free axis comes last


def _channel_vector(xp: Any, c: Any, ndim: int, axis: int, channels: tuple[int, ...]) -> Any:
    """``c`` as one flat vector if it varies at most along the channel axes of a result.

    The channel axes of the ``ndim`` result start at ``axis`` and have sizes
    ``channels`` (one axis, or a DenseGeneral's several).
    """
    shape = tuple(np.shape(c))
    if len(shape) > ndim:
        return None
    full = (1,) * (ndim - len(shape)) + shape
    inside = full[axis : axis + len(channels)]
    if any(d != 1 for i, d in enumerate(full) if not axis <= i < axis + len(channels)):
        return None
    if any(d not in (1, n) for d, n in zip(inside, channels, strict=True)):
        return None
    v = xp.broadcast_to(xp.reshape(xp.asarray(c, xp.float32), inside), channels)
    return xp.reshape(v, (-1,))


_COMPARISONS = ("eq", "ne", "gt", "ge", "lt", "le")


def _from_integers(eqn: Any, ins: list[tuple[Any, Rep]]) -> list[Any] | None:
    """The integer operands of a comparison or integer conversion of a float mask.

    ``jnp.where(mask.astype(jnp.float32), ...)`` compares the float mask with 0, and
    Flax converts it back to bool: both are done on the integers it was converted
    from (int32; constants must be integers), not on its quantized floats. None if
    ``eqn`` is not such an op.
    """
    name = eqn.primitive.name
    if not any(q.source is not None for _, q in ins) or not _integer(eqn.outvars):
        return None
    for (_, q), v in zip(ins, eqn.invars, strict=True):
        if q.source is not None and np.shape(q.source) != tuple(v.aval.shape):
            return None  # reshaped or broadcast since the conversion: not followed
    if name == "convert_element_type" and len(ins) == 1:
        return [ins[0][1].source]
    if name not in _COMPARISONS:
        return None
    values = []
    for x, q in ins:
        if q.source is not None:
            values.append(jax.lax.convert_element_type(q.source, jnp.int32))
        elif q.kind == "const" and np.all(np.asarray(x) == np.round(np.asarray(x))):
            values.append(np.asarray(x).astype(np.int32))
        else:
            return None
    return values


def _step(x: Any, q: Rep, t: int) -> Any:
    """Step ``t`` of a scanned input (a constant stays concrete)."""
    if q.kind == "const":
        with jax.ensure_compile_time_eval():
            return jnp.asarray(x)[t]
    return x[t]


def _pool_or_mean(q: Rep, c: Any) -> bool:
    """Whether dividing ``q``'s pending sum by ``c`` is an average pooling or a mean.

    The converter makes ``reduce_window_sum`` / window size one AVERAGE_POOL_2D and
    ``reduce_sum`` / count one MEAN; another divisor is a MUL by its reciprocal.
    """
    if q.kind != "pending" or np.size(c) == 0:
        return False
    try:
        c = np.asarray(c, np.float64)
    except TypeError:  # traced (QAT): not a count
        return False
    if not np.all(c == c.flat[0]):
        return False
    if q.inherit:
        return bool(c.flat[0] == q.inherit)
    origin = q.origin
    if origin is None or origin.primitive.name != "reduce_sum":
        return False
    shape = origin.invars[0].aval.shape
    return bool(c.flat[0] == np.prod([shape[a] for a in origin.params["axes"]]))


def _along(v: Any, ndim: int, axis: int) -> Any:
    """A per-channel vector shaped to broadcast along ``axis`` of an ``ndim`` array."""
    shape = [1] * ndim
    shape[axis] = -1
    return v.reshape(shape)


def _scalar(v: Any) -> jax.Array:
    return jnp.reshape(jnp.asarray(v, jnp.float32), ())


def _integer(avals: list[Any]) -> bool:
    """Whether all are integer or boolean (indices, masks): never quantized."""
    return all(jnp.issubdtype(v.aval.dtype, jnp.integer) or v.aval.dtype == bool for v in avals)


_DEFERRED_ADDS = ("add", "sub")


def _raw_into_concat(q: Rep) -> bool:
    """Whether a pending value enters a concatenate unquantized.

    A matmul/convolution output does: the converter writes it at the concat's
    scale, one rounding.
    """
    if q.kind != "pending" or q.inherit:
        return False
    return q.origin is None or q.origin.primitive.name not in _DEFERRED_ADDS


def _fence(on: bool) -> Callable[[Any], Any]:
    """``jax.lax.optimization_barrier`` if ``on``, else the identity."""
    return jax.lax.optimization_barrier if on else (lambda v: v)


def _unbounded(name: str, values: list[Any]) -> int | None:
    """For ``max(x, -inf)`` or ``min(x, inf)``: the index of ``x``; else None."""
    if len(values) != 2:
        return None
    bound = [_no_op_bound(name, v) for v in values]
    return bound.index(False) if bound.count(True) == 1 else None


def _no_op_bound(name: str, v: Any) -> bool:
    """Whether ``v`` is a concrete ``-inf`` (for ``max``) or ``inf`` (``min``): a no-op."""
    if name not in ("max", "min"):
        return False
    if isinstance(v, jex.core.Literal):
        v = v.val
    try:
        c = np.asarray(v, np.float64)
    except TypeError:  # a traced value (TracerArrayConversionError)
        return False
    return c.size > 0 and bool(np.all(c == (-np.inf if name == "max" else np.inf)))


def _uniform(c: Any) -> float | None:
    """The one number a constant array holds, or None (several, or not concrete)."""
    try:
        a = np.asarray(c)
    except jax.errors.TracerArrayConversionError:
        return None
    if a.size == 0 or not np.all(a == a.reshape(-1)[0]):
        return None
    return float(a.reshape(-1)[0])


def _preserve(eqn: Any, values: list[Any]) -> list[Any]:
    """A preserving op's result; a reversal as a gather of reversed indices.

    litert-converter 0.5.0 keeps StableHLO's ``reverse`` (``x[..., ::-1]``) as a
    float32 ``REVERSE_V2`` between a DEQUANTIZE and a QUANTIZE; a gather becomes an
    int8 ``GATHER_ND``. The values are the same.
    """
    if eqn.primitive.name != "rev":
        return _bind(eqn, values)
    x = values[0]
    for d in eqn.params["dimensions"]:
        x = jnp.take(x, np.arange(x.shape[d] - 1, -1, -1), axis=d, mode="clip")
    return [x]


def _bind(eqn: Any, values: list[Any]) -> list[Any]:
    out = eqn.primitive.bind(*values, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


@jax.custom_vjp
def _ste(x: Any, fq: Any) -> Any:
    """``fq`` forward, identity gradient to ``x`` (straight-through estimator)."""
    return fq


_ste.defvjp(lambda x, fq: (fq, None), lambda _, g: (g, jnp.zeros_like(g)))


def _ste_weight(w: Any, axis: int | None, qmax: int) -> Any:
    """Symmetric narrow-range fake quantization of a traced weight, with an STE."""
    reduce = tuple(a for a in range(w.ndim) if a != axis) if axis is not None else None
    absmax = jax.lax.stop_gradient(jnp.max(jnp.abs(w), axis=reduce, keepdims=True))
    scale = jnp.where(absmax > 0, absmax / qmax, 1.0)
    q = jnp.clip(qdq.round_half_away(w / scale), -qmax, qmax) * scale
    return _ste(w, jax.lax.stop_gradient(qdq.nan_blocks(w, q, scale.shape)))

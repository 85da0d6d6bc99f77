"""Static-range int8 annotation of a JAX function for LiteRT: calibrate, then annotate.

Works on the function's jaxpr, so any Flax (Linen or NNX) or plain JAX model
whose parameters are closed over can be converted::

    fn = lambda x: model.apply(params, x)
    cal = calibrate(fn, batches)  # per-tensor ranges of every activation
    tfl = qlitert.export(annotate(fn, cal), example)

:func:`annotate` inserts :func:`qlitert.qdq.fake_quant` where TFLite's integer
kernels quantize (*tensor-centric*: each site is an op's output):

* the inputs; weights of ``dot_general`` / ``conv_general_dilated`` (symmetric,
  narrow range, one scale per output channel);
* the output of a matmul or convolution *after* a following bias add, inference
  batch norm (per-channel constants folded into the weight before it is
  quantized, and into the bias) and ReLU / ReLU6 (TFLite fuses them, so no
  quantization sits between);
* the output of every other computing op (add, sub, mul, concatenate, tanh,
  logistic...), and of means (``reduce_sum`` followed by a division, which the
  converter turns into ``MEAN``);
* nothing new after scale-preserving ops (reshape, transpose, squeeze, slicing,
  max pooling, and average pooling — ``reduce_window_sum`` and a division, which
  becomes ``AVERAGE_POOL_2D``, requantized to its input's scale): they keep their
  input's scale, as TFLite's kernels do.

Ranges are moving averages of each batch's min and max (:func:`calibrate`).
``strict=True`` raises on an op this module cannot quantize, naming the op and
the module path (Linen name stack). ``jax.nn.softmax`` (output scale 1/256, zero
point -128) and Flax's ``gelu`` become single ``SOFTMAX`` / ``GELU`` kernels; layer
norm becomes int8 ``MEAN`` / ``SUB`` / ``MUL`` / ``RSQRT`` ops.

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
    >>> import qlitert
    >>> model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(4)])
    >>> x = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    >>> params = model.init(jax.random.key(0), x)
    >>> fn = lambda x: model.apply(params, x)
    >>> cal = qlitert.calibrate(fn, [x])
    >>> tfl = qlitert.export(qlitert.annotate(fn, cal), x)
    >>> qlitert.inspect(tfl).op_names()
    ['QUANTIZE', 'FULLY_CONNECTED', 'FULLY_CONNECTED', 'DEQUANTIZE']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import extend as jex

from qlitert import qdq

# Ops whose output has its input's scale (TFLite shares it).
PRESERVING = {
    "reshape", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice",
    "reduce_window_max", "copy", "copy_p", "broadcast_in_dim",
}  # fmt: skip
# Ops that compute a new value: inputs quantized, output quantized at its own range.
COMPUTING = {
    "add", "sub", "mul", "concatenate", "tanh", "logistic", "max", "min", "neg",
    "square", "integer_pow", "rsqrt", "sqrt", "exp", "abs",
}  # fmt: skip
CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


class UnsupportedOpError(ValueError):
    """An op qlitert cannot quantize for LiteRT (strict mode)."""


@dataclasses.dataclass
class Calibration:
    """Per-site activation ranges: moving averages of per-batch min and max.

    Attributes:
        ranges: ``site -> [lo, hi]``.
        counts: ``site -> batches seen``.
        momentum: Weight of the old value once ``1 / (1 - momentum)`` batches were
            seen (a cumulative average before that).
    """

    ranges: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    momentum: float = 0.99

    def observe(self, site: str, x: Any) -> None:
        """Folds one batch's range of ``x`` into ``site``'s moving average."""
        lo, hi = float(np.min(x)), float(np.max(x))
        n = self.counts.get(site, 0)
        rate = max(1.0 / (n + 1), 1.0 - self.momentum)
        old = self.ranges.get(site, [lo, hi])
        self.ranges[site] = [old[0] + (lo - old[0]) * rate, old[1] + (hi - old[1]) * rate]
        self.counts[site] = n + 1

    def params(self, site: str) -> tuple[np.ndarray, np.ndarray]:
        """TFLite ``(scale, zero_point)`` of a calibrated site.

        Raises:
            KeyError: If no calibration batch reached the site.
        """
        if site not in self.ranges:
            raise KeyError(
                f"site {site!r} was never calibrated: run calibrate() on the same function"
            )
        lo, hi = self.ranges[site]
        return qdq.activation_params(lo, hi)


@dataclasses.dataclass
class _Q:
    """How a value is represented: const (a weight), q (quantized), pending, float."""

    kind: str
    scale: Any = None
    zero_point: Any = None
    inherit: bool = False  # pending with its input's scale (average pooling)


@dataclasses.dataclass
class _Deferred:
    """A matmul/convolution with a constant weight, not computed yet.

    Per-output-channel affine constants that follow it (bias adds, batch-norm
    ``sub``/``mul``) are folded in: ``y = op(x, w * scale) + offset``, so the weight
    is quantized *after* folding, as TFLite's converter folds batch norm.
    """

    eqn: Any
    x: Any
    w: Any
    w_axis: int
    out_axis: int
    scale: Any = None
    offset: Any = None


class _Interpreter:
    """Runs a jaxpr, inserting (annotate) or observing (calibrate) quantization sites."""

    def __init__(
        self, calibration: Calibration, *, observe: bool, strict: bool, train: bool = False
    ) -> None:
        self.cal, self.observing, self.strict, self.train = calibration, observe, strict, train
        self.counter = 0

    def fq(self, x: Any, scale: Any, zp: Any, **kw: Any) -> Any:
        """Fake quantization: the annotation, or its numerics with an STE (training)."""
        if self.train:
            fq = qdq.fake_quant(jax.lax.stop_gradient(x), scale, zp, composite=False, **kw)
            return _ste(x, fq)
        return qdq.fake_quant(x, scale, zp, **kw)

    def site(self, x: Any, eqn: Any | None, label: str) -> tuple[Any, _Q]:
        where = "" if eqn is None else str(eqn.source_info.name_stack)
        key = f"{self.counter}:{label}@{where}"
        self.counter += 1
        if self.observing:
            self.cal.observe(key, np.asarray(x))
            return x, _Q("q")
        scale, zp = self.cal.params(key)
        return self.fq(x, scale, zp), _Q("q", scale, zp)

    def materialize(self, x: Any, q: _Q, eqn: Any, label: str) -> tuple[Any, _Q]:
        if q.inherit:  # TFLite's AVERAGE_POOL_2D keeps its input's scale: no new site
            done = _Q("q", q.scale, q.zero_point)
            if self.observing:
                return x, done
            return self.fq(x, q.scale, q.zero_point, round_codes=True), done
        if q.kind in ("pending", "float"):
            return self.site(x, eqn, label)
        if q.kind == "const":
            return self.site(x, eqn, f"{label}.const")
        return x, q

    def weight(self, w: Any, axis: int | None) -> Any:
        if self.observing:
            return w
        if self.train:
            return _ste_weight(w, axis)
        w = np.asarray(w, np.float32)
        if axis is None:
            scale = np.array([max(float(np.max(np.abs(w))), 1e-12) / 127], np.float32)
            return qdq.fake_quant(jnp.asarray(w), scale, narrow_range=True)
        return qdq.fake_quant(
            jnp.asarray(w), qdq.weight_scales(w, axis), narrow_range=True, axis=axis
        )

    def run(
        self, jaxpr: Any, consts: list[Any], args: list[tuple[Any, _Q]]
    ) -> list[tuple[Any, _Q]]:
        env: dict[Any, tuple[Any, _Q]] = {}

        def read_raw(v: Any) -> tuple[Any, _Q]:
            if isinstance(v, jex.core.Literal):
                return v.val, _Q("const")
            return env[v]

        def read(v: Any) -> tuple[Any, _Q]:
            return self.realize(read_raw(v))

        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = (c, _Q("const"))
        for v, a in zip(jaxpr.invars, args, strict=True):
            env[v] = a
        eqns, i = list(jaxpr.eqns), 0
        while i < len(eqns):
            kind, n = _match(eqns, i)
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

    def fused(self, kind: str, block: list[Any], read: Callable[[Any], Any]) -> tuple[Any, _Q]:
        """A softmax or GELU block: one TFLite kernel, quantized input and output only."""
        x, q = read(block[0].invars[0])
        x, _ = self.materialize(x, q, block[0], kind)
        local: dict[Any, Any] = {block[0].invars[0]: x}

        def value(v: Any) -> Any:
            if isinstance(v, jex.core.Literal):
                return v.val
            return local[v] if v in local else read(v)[0]

        for eqn in block:
            for v, o in zip(eqn.outvars, _bind(eqn, [value(v) for v in eqn.invars]), strict=True):
                local[v] = o
        y = local[block[-1].outvars[0]]
        if kind != "softmax":
            return self.site(y, block[-1], kind)
        # TFLite's int8 SOFTMAX has a fixed output scale 1/256 and zero point -128.
        scale, zp = np.array([1 / 256], np.float32), np.array([-128], np.int64)
        return (y if self.observing else self.fq(y, scale, zp)), _Q("q", scale, zp)

    def realize(self, entry: tuple[Any, _Q]) -> tuple[Any, _Q]:
        """Computes a deferred contraction (with its folded constants)."""
        d, q = entry
        if not isinstance(d, _Deferred):
            return entry
        w = d.w
        if d.scale is not None:
            with jax.ensure_compile_time_eval():  # a concrete weight stays concrete
                w = w * _along(d.scale, np.ndim(w), d.w_axis)
        y = _bind(d.eqn, [d.x, self.weight(w, d.w_axis)])[0]
        if d.offset is not None:
            y = y + jnp.asarray(_along(d.offset, y.ndim, d.out_axis), y.dtype)
        return y, q

    def fold(self, eqn: Any, ins: list[tuple[Any, _Q]]) -> list[tuple[Any, _Q]] | None:
        """Folds ``deferred (+|-|*|/) constant`` into the deferred contraction, if it fits."""
        name = eqn.primitive.name
        if name not in ("add", "sub", "mul", "div") or len(ins) != 2:
            return None
        (x, qx), (c, qc) = ins
        if not isinstance(x, _Deferred) and name in ("add", "mul"):
            (c, qc), (x, qx) = ins
        if not isinstance(x, _Deferred) or qc.kind != "const":
            return None
        # Constants stay numpy (static composite attributes) unless training traces them.
        xp: Any = jnp if self.train else np
        n = eqn.outvars[0].aval.shape[x.out_axis]
        v = _channel_vector(xp, c, eqn.outvars[0].aval.ndim, x.out_axis, n)
        if v is None:
            return None
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

    def eqn(self, eqn: Any, ins: list[tuple[Any, _Q]]) -> list[tuple[Any, _Q]]:
        folded = self.fold(eqn, ins)
        if folded is not None:
            return folded
        ins = [self.realize(e) for e in ins]
        name = eqn.primitive.name
        values = [x for x, _ in ins]
        kinds = [q.kind for _, q in ins]
        inner = next((eqn.params[k] for k in CALLS if k in eqn.params), None)
        if inner is not None:
            closed = inner if hasattr(inner, "jaxpr") else None
            jaxpr = closed.jaxpr if closed is not None else inner
            consts = list(closed.consts) if closed is not None else []
            skip = eqn.params.get("num_consts", 0) if name.startswith("custom_vjp") else 0
            return self.run(jaxpr, consts, ins[skip:] if skip else ins)
        if all(k == "const" for k in kinds):  # constant folding (bias reshapes...)
            # Eagerly, even inside jax.export's trace: folded weights must stay
            # concrete to become static composite attributes.
            with jax.ensure_compile_time_eval():
                return [(o, _Q("const")) for o in _bind(eqn, values)]
        if name in ("dot_general", "conv_general_dilated"):
            return [self.contraction(eqn, ins)]
        if name in ("max", "min") and sorted(kinds) == ["const", "pending"]:
            return [(_bind(eqn, values)[0], _Q("pending"))]  # ReLU / ReLU6: fused
        if name == "reduce_window_sum":  # average pool (with the div): input's scale
            x, q = self.materialize(values[0], ins[0][1], eqn, name)
            return [(_bind(eqn, [x])[0], _Q("pending", q.scale, q.zero_point, inherit=True))]
        if name == "reduce_sum":  # mean (with the div): a new scale
            x, _ = self.materialize(values[0], ins[0][1], eqn, name)
            return [(_bind(eqn, [x])[0], _Q("pending"))]
        if name == "div" and kinds == ["pending", "const"]:
            return [(_bind(eqn, values)[0], ins[0][1])]
        if name in PRESERVING and kinds[0] == "pending":  # same values: quantize later
            return [(o, ins[0][1]) for o in _bind(eqn, values)]
        if name in PRESERVING and kinds[0] in ("q", "float"):
            x, q = self.materialize(values[0], ins[0][1], eqn, name)
            return [(o, q) for o in _bind(eqn, [x, *values[1:]])]
        if name == "convert_element_type" and jnp.issubdtype(eqn.params["new_dtype"], jnp.floating):
            return [ins[0]]
        if name in COMPUTING:
            xs = [self.materialize(x, q, eqn, name)[0] for x, q in ins]
            out = _bind(eqn, xs)[0]
            return [self.site(out, eqn, name)]
        if self.strict:
            raise UnsupportedOpError(
                f"op {name!r} in module {str(eqn.source_info.name_stack) or '(top level)'!r} "
                "cannot be quantized for LiteRT by qlitert yet; pass strict=False to leave "
                "it in float"
            )
        xs = [self.materialize(x, q, eqn, name)[0] for x, q in ins]
        return [(o, _Q("float")) for o in _bind(eqn, xs)]

    def contraction(self, eqn: Any, ins: list[tuple[Any, _Q]]) -> tuple[Any, _Q]:
        (a, qa), (b, qb) = ins
        name = eqn.primitive.name
        if qa.kind == "const" and qb.kind != "const":
            raise UnsupportedOpError(
                f"{name} with the weight on the left in module "
                f"{str(eqn.source_info.name_stack)!r}: TFLite kernels take it on the right"
            )
        a, _ = self.materialize(a, qa, eqn, f"{name}.lhs")
        w_axis = _out_axis(eqn, np.ndim(b)) if qb.kind == "const" else None
        if qb.kind == "const" and w_axis is not None:
            out_axis = _result_axis(eqn)
            return _Deferred(eqn, a, b, w_axis, out_axis), _Q("pending")
        if qb.kind == "const":
            b = self.weight(b, w_axis)
        else:
            b, _ = self.materialize(b, qb, eqn, f"{name}.rhs")
        return _bind(eqn, [a, b])[0], _Q("pending")


# Primitive sequences of jax.nn.softmax and of Flax's (tanh-approximated) gelu in
# jax 0.10.2's jaxprs; the converter turns each into one SOFTMAX / GELU kernel when
# no quantization sits inside.
_FUSED = {
    "softmax": [
        ["reduce_max", "max", "broadcast_in_dim", "stop_gradient", "sub", "exp",
         "reduce_sum", "broadcast_in_dim", "div"],
        ["reduce_max", "broadcast_in_dim", "stop_gradient", "sub", "exp", "reduce_sum",
         "broadcast_in_dim", "div"],
    ],
    "gelu": [["integer_pow", "mul", "add", "mul", "tanh", "add", "mul", "mul"]],
}  # fmt: skip
_INPUT_USES = {"softmax": 2, "gelu": 3}


def _match(eqns: list[Any], i: int) -> tuple[str | None, int]:
    """The fused block (softmax, gelu) starting at ``eqns[i]``, and its length."""
    for kind, sequences in _FUSED.items():
        for names in sequences:
            block = eqns[i : i + len(names)]
            if [e.primitive.name for e in block] != names:
                continue
            x = block[0].invars[0]
            # The block's input feeds exactly these ops: softmax's reduce_max and sub;
            # gelu's integer_pow, first add and last mul.
            if sum(x in e.invars for e in block) == _INPUT_USES[kind]:
                return kind, len(names)
    return None, 0


def _out_axis(eqn: Any, ndim: int) -> int | None:
    """The weight's output-channel axis (None: several, use one scale)."""
    if eqn.primitive.name == "conv_general_dilated":
        return int(eqn.params["dimension_numbers"].rhs_spec[0])
    (_, rc), (_, rb) = eqn.params["dimension_numbers"]
    free = [i for i in range(ndim) if i not in rc and i not in rb]
    return free[0] if len(free) == 1 and not rb else None


def _result_axis(eqn: Any) -> int:
    """The output axis holding a contraction's output channels."""
    if eqn.primitive.name == "conv_general_dilated":
        return int(eqn.params["dimension_numbers"].out_spec[1])
    return eqn.outvars[0].aval.ndim - 1  # dot_general: the weight's free axis comes last


def _channel_vector(xp: Any, c: Any, ndim: int, axis: int, n: int) -> Any:
    """``c`` as an ``(n,)`` vector if it varies at most along ``axis`` of an ``ndim`` result."""
    shape = tuple(np.shape(c))
    if len(shape) > ndim:
        return None
    full = (1,) * (ndim - len(shape)) + shape
    if any(d != 1 for i, d in enumerate(full) if i != axis) or full[axis] not in (1, n):
        return None
    return xp.broadcast_to(xp.reshape(xp.asarray(c, xp.float32), (-1,)), (n,))


def _along(v: Any, ndim: int, axis: int) -> Any:
    """A per-channel vector shaped to broadcast along ``axis`` of an ``ndim`` array."""
    shape = [1] * ndim
    shape[axis] = -1
    return v.reshape(shape)


def _bind(eqn: Any, values: list[Any]) -> list[Any]:
    out = eqn.primitive.bind(*values, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _interpret(
    fn: Callable[..., Any],
    inputs: tuple,
    interp: _Interpreter,
    *,
    int8_io: bool = False,
    params: Any = None,
) -> Any:
    """Runs ``fn(*inputs)`` (or ``fn(params, *inputs)``) through ``interp``."""
    # fn is the float model: traced at float inputs even when ``inputs`` are codes.
    specs = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32) if int8_io else x for x in inputs]
    if params is None:
        closed = jax.make_jaxpr(fn)(*specs)
        args: list[tuple[Any, _Q]] = []
        out_tree = jax.tree.structure(jax.eval_shape(fn, *specs))
    else:
        closed = jax.make_jaxpr(fn)(params, *specs)
        args = [(p, _Q("const")) for p in jax.tree.leaves(params)]  # weights, traced
        out_tree = jax.tree.structure(jax.eval_shape(fn, params, *specs))
    for i, x in enumerate(inputs):
        if int8_io:  # codes in: dequantized with the input site's parameters
            key = f"{interp.counter}:input{i}@"
            interp.counter += 1
            scale, zp = interp.cal.params(key)
            args.append((qdq.dequantize(x, scale, zp), _Q("q", scale, zp)))
        else:
            args.append(interp.site(x, None, f"input{i}"))
    outs = interp.run(closed.jaxpr, list(closed.consts), args)
    results = []
    for i, (x, q) in enumerate(outs):
        if q.kind != "q" or q.inherit:
            x, q = interp.materialize(x, q, None, f"output{i}")
        if int8_io:
            x = qdq.quantize(x, q.scale, q.zero_point)
        results.append(x)
    return jax.tree.unflatten(out_tree, results)


@jax.custom_vjp
def _ste(x: Any, fq: Any) -> Any:
    """``fq`` forward, identity gradient to ``x`` (straight-through estimator)."""
    return fq


_ste.defvjp(lambda x, fq: (fq, None), lambda _, g: (g, jnp.zeros_like(g)))


def _ste_weight(w: Any, axis: int | None) -> Any:
    """Symmetric narrow-range int8 fake quantization of a traced weight, with an STE."""
    reduce = tuple(a for a in range(w.ndim) if a != axis) if axis is not None else None
    absmax = jax.lax.stop_gradient(jnp.max(jnp.abs(w), axis=reduce, keepdims=True))
    scale = jnp.where(absmax > 0, absmax / 127, 1.0)
    q = jnp.clip(qdq.round_half_away(w / scale), -127, 127) * scale
    return _ste(w, jax.lax.stop_gradient(q))


def calibrate(
    fn: Callable[..., Any],
    batches: Iterable[Any],
    *,
    momentum: float = 0.99,
    strict: bool = True,
) -> Calibration:
    """Ranges of every quantization site of ``fn`` over ``batches`` (float model).

    Args:
        fn: The function, parameters closed over.
        batches: Inputs: arrays, or tuples of arrays for several inputs.
        momentum: See :class:`Calibration`.
        strict: As in :func:`annotate` (use the same value for both).
    """
    cal = Calibration(momentum=momentum)
    for batch in batches:
        inputs = batch if isinstance(batch, tuple) else (batch,)
        interp = _Interpreter(cal, observe=True, strict=strict)
        _interpret(fn, tuple(np.asarray(x) for x in inputs), interp)
    if not cal.counts:
        raise ValueError("batches is empty: calibrate needs at least one batch")
    return cal


def annotate(
    fn: Callable[..., Any],
    calibration: Calibration,
    *,
    strict: bool = True,
    int8_io: bool = False,
) -> Callable[..., Any]:
    """``fn`` with fake quantization at every TFLite quantization site.

    Args:
        fn: The function, parameters closed over.
        calibration: From :func:`calibrate` on the same function.
        strict: Raise on ops that cannot be quantized (else leave them float).
        int8_io: The annotated function takes and returns int8 codes (quantized
            with the input and output sites' parameters), so the exported model has
            integer inputs and outputs and no QUANTIZE / DEQUANTIZE ops.

    Raises:
        UnsupportedOpError: In strict mode, for an op that cannot be quantized.
    """

    def annotated(*inputs: Any) -> Any:
        interp = _Interpreter(calibration, observe=False, strict=strict)
        return _interpret(fn, inputs, interp, int8_io=int8_io)

    return annotated


def qat(apply_fn: Callable[..., Any], calibration: Calibration) -> Callable[..., Any]:
    """A trainable ``f(params, *inputs)``: ``apply_fn`` with the LiteRT quantization.

    Weights are fake-quantized per output channel from their current values and
    activations at the calibrated sites, with straight-through gradients, so
    training sees the integer model's rounding. Re-:func:`calibrate` the trained
    model before :func:`annotate` and export.

    Args:
        apply_fn: ``apply_fn(params, *inputs)``, e.g. a Linen ``model.apply``.
        calibration: From :func:`calibrate` on ``lambda *x: apply_fn(params, *x)``.
    """

    def trainable(params: Any, *inputs: Any) -> Any:
        interp = _Interpreter(calibration, observe=False, strict=True, train=True)
        return _interpret(apply_fn, inputs, interp, params=params)

    return trainable

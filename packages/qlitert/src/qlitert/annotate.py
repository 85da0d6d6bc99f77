"""Static-range quantization of a JAX function for LiteRT: calibrate, annotate, QAT.

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
  logistic...), and of means and sums;
* nothing new after scale-preserving ops (reshape, transpose, squeeze, slicing,
  gather, pad, max pooling, and average pooling — ``reduce_window_sum`` and a
  division, which becomes ``AVERAGE_POOL_2D``, requantized to its input's scale):
  they keep their input's scale, as TFLite's kernels do.

Ranges are moving averages of each batch's min and max (:func:`calibrate`).
``rules`` (:mod:`qlitert.rules`) choose int8, int16 (16x8) or float activations
and int8, int4 or float weights per module. ``strict=True`` raises on an op this
module cannot quantize, naming the op and the module path. ``jax.nn.softmax``
(output scale 1/256, zero point -128) and Flax's ``gelu`` become single
``SOFTMAX`` / ``GELU`` kernels; layer norm becomes int8 ``MEAN`` / ``SUB`` /
``MUL`` / ``RSQRT`` ops.

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

import collections
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import qcore.rules
from qlitert import qdq, scopes
from qlitert import rules as _rules
from qlitert.calibration import Calibration, NonFiniteError
from qlitert.export import INTEGER_TYPES
from qlitert.interpreter import Interpreter, Rep

# The tensor types a converted model may use, by quantization type.
# (Beyond INTEGER_TYPES, which every annotated model may use.)
TENSOR_TYPES = {
    "int16": ("INT16",),  # 16x8: int16 activations, int8 weights, int64 biases
    "int4": ("INT4",),
    None: ("FLOAT32",),  # float
}


def _interpret(
    fn: Callable[..., Any],
    inputs: tuple,
    interp: Interpreter,
    *,
    int8_io: bool = False,
    params: Any = None,
) -> Any:
    """Runs ``fn(*inputs)`` (or ``fn(params, *inputs)``) through ``interp``."""
    # int8_io: fn is the float model, traced at float inputs where codes come in.
    specs = [_float_spec(x) if int8_io and _is_codes(x) else x for x in inputs]
    with scopes.module_scopes():
        if params is None:
            closed, shape = jax.make_jaxpr(fn, return_shape=True)(*specs)
            args: list[tuple[Any, Rep]] = []
        else:
            closed, shape = jax.make_jaxpr(fn, return_shape=True)(params, *specs)
            args = [(p, Rep("const")) for p in jax.tree.leaves(params)]  # weights, traced
    for i, x in enumerate(inputs):
        if jnp.issubdtype(jnp.result_type(x), jnp.integer) and not (int8_io and _is_codes(x)):
            args.append((x, Rep("int")))  # indices: not quantized
        elif int8_io:  # codes in: dequantized with the input site's parameters
            key = interp.key(None, f"input{i}")
            if not _is_codes(x):
                # Float values read as codes gave JAX fractional codes while the
                # model's int8 input holds whole ones: export's validation compared
                # the two on different inputs (issue 21, bug 9).
                want = interp.types(None).act or "int8"
                qtype = "" if want == "int8" else f", qtype={want!r}"
                raise TypeError(
                    f"int8_io=True: input {i} has dtype {jnp.result_type(x)}; allowed: "
                    f"{want} codes, quantized with the input's parameters, e.g. "
                    f"qlitert.qdq.quantize(x, *calibration.params({key!r}{qtype}){qtype}) "
                    "(or annotate without int8_io for float inputs)"
                )
            qtype = "int16" if jnp.result_type(x) == jnp.int16 else "int8"
            scale, zp = interp.cal.params(key, qtype)
            args.append((qdq.dequantize(x, scale, zp, qtype=qtype), Rep("q", scale, zp, qtype)))
        else:
            args.append(interp.site(x, None, f"input{i}"))
    outs = interp.run(closed.jaxpr, list(closed.consts), args)
    results = []
    for i, (x, q) in enumerate(outs):
        if q.kind not in ("q", "int") or q.inherit:
            x, q = interp.materialize(x, q, None, f"output{i}")
        if int8_io and q.kind == "q":
            x = qdq.quantize(x, q.scale, q.zero_point, qtype=q.qtype)
        elif int8_io and q.kind == "float":
            raise ValueError(
                f"int8_io=True: output {i} is float under the rules; integer outputs need "
                "a quantized last op (give its module, or the root path '', an act_qtype)"
            )
        results.append(x)
    return jax.tree.unflatten(jax.tree.structure(shape), results)


def _is_codes(x: Any) -> bool:
    return jnp.result_type(x) in (jnp.int8, jnp.int16)


def _float_spec(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32)


def calibrate(
    fn: Callable[..., Any],
    batches: Iterable[Any],
    *,
    rules: Sequence[_rules.Rule] | _rules.Rule | None = None,
    momentum: float = 0.99,
    strict: bool = True,
) -> Calibration:
    """Ranges of every quantization site of ``fn`` over ``batches`` (float model).

    Args:
        fn: The function, parameters closed over.
        batches: Inputs: arrays, or tuples of arrays for several inputs.
        rules: Per-module types, :class:`qlitert.Rule` objects (first match wins,
            :mod:`qlitert.rules`); None quantizes every op to int8. Kept in the
            calibration for :func:`annotate` and :func:`qat`. ``qflax.QuantizationRule``
            objects are converted, with a ``DeprecationWarning``.
        momentum: See :class:`Calibration`.
        strict: Raise on ops that cannot be quantized (else they stay float).

    Raises:
        TypeError: For an array as ``batches`` or non-numeric inputs.
        ValueError: For empty ``batches``, empty inputs, inputs that change rank
            or number between batches, or invalid rules.
        NonFiniteError: (a ValueError) For NaN or inf in a batch or in a site's
            values, naming the batch and the site.
        UnsupportedOpError: In strict mode, naming the op and its module.
    """
    if isinstance(momentum, bool) or not isinstance(momentum, int | float):
        raise TypeError(f"momentum={momentum!r}; allowed: a float in [0, 1)")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum={momentum} is out of range; allowed: 0 <= momentum < 1")
    if isinstance(batches, np.ndarray | jax.Array):
        raise TypeError(
            f"batches is one array of shape {batches.shape}; allowed: an iterable of "
            "batches, e.g. [x] (iterating an array would calibrate on its rows)"
        )
    cal = Calibration(momentum=momentum, rules=_rules._check(rules, stacklevel=3), strict=strict)
    used: set[int] = set()
    first: tuple[np.ndarray, ...] | None = None
    for b, batch in enumerate(batches):
        inputs = _batch(batch, b, first)
        first = first or inputs
        interp = Interpreter(cal, observe=True, strict=strict)
        try:
            _interpret(fn, inputs, interp)
        except NonFiniteError as err:
            raise NonFiniteError(f"batches[{b}]: {err}") from None
        used |= interp.used_rules
        if b == 0:
            cal.module_ops = dict(collections.Counter(interp.op_paths.values()))
    if first is None:
        raise ValueError("batches is empty; allowed: at least one batch")
    qcore.rules.warn_unused(cal.rules, used, _unused_message, stacklevel=2)
    return cal


def _unused_message(index: int, rule: _rules.Rule) -> str:
    return (
        f"rules[{index}] (module_path={rule.module_path!r}) matched no op; module paths "
        "look like 'layers/0/Dense_0' (Linen) or 'layers/0/linear' (NNX)"
    )


def _batch(batch: Any, b: int, first: tuple[np.ndarray, ...] | None) -> tuple[np.ndarray, ...]:
    """Calibration batch ``b`` as arrays, checked against the first batch.

    Raises:
        TypeError: For a non-numeric input.
        ValueError: For an empty input, NaN or inf, or another number of inputs or
            ranks than the first batch.
    """
    inputs = tuple(np.asarray(x) for x in (batch if isinstance(batch, tuple) else (batch,)))
    if first is not None and len(inputs) != len(first):
        raise ValueError(
            f"batches[{b}] has {len(inputs)} inputs, batches[0] {len(first)}; allowed: the "
            "same inputs in every batch (a tuple of arrays for several)"
        )
    for i, x in enumerate(inputs):
        where = f"batches[{b}]" + (f"[{i}]" if len(inputs) > 1 else "")
        if x.dtype.kind not in "biuf":
            raise TypeError(f"{where} has dtype {x.dtype}; allowed: numeric arrays")
        if x.size == 0:
            raise ValueError(f"{where} has shape {x.shape}, no values; allowed: non-empty arrays")
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        if bad:
            raise NonFiniteError(
                f"{where} has {bad} non-finite values (NaN or inf) of {x.size}; "
                "calibrating would hide them: fix or drop the batch"
            )
        if first is not None and x.ndim != first[i].ndim:
            raise ValueError(
                f"{where} has shape {x.shape}, batches[0] {first[i].shape}; allowed: "
                "arrays of the same rank in every batch"
            )
    return inputs


class Annotated:
    """A function with LiteRT quantization annotations (from :func:`annotate`).

    Calling it runs the annotated model. After a call (or an export, which traces
    it), :attr:`compute_types` holds the tensor types its kernels use, and
    :attr:`float_islands` the ops qlitert computes in float on its own (an int16
    LayerNorm's ``rsqrt``), or None if a rule computes some op in float; both are
    what :func:`qlitert.export` validates against.
    """

    def __init__(self, fn: Callable[..., Any], calibration: Calibration, int8_io: bool) -> None:
        self.fn, self.calibration, self.int8_io = fn, calibration, int8_io
        self.compute_types: tuple[str, ...] | None = None
        self.float_islands: tuple[str, ...] | None = None

    def __call__(self, *inputs: Any) -> Any:
        """The annotated model's outputs (JAX's view of the integer model)."""
        interp = Interpreter(self.calibration, observe=False, strict=self.calibration.strict)
        out = _interpret(self.fn, inputs, interp, int8_io=self.int8_io)
        types = {t for kind in interp.seen for t in TENSOR_TYPES.get(kind, ())}
        self.compute_types = tuple(sorted(types | set(INTEGER_TYPES)))
        islands = all(island for _, island in interp.float_ops)
        self.float_islands = tuple(n for n, _ in interp.float_ops) if islands else None
        return out


def annotate(
    fn: Callable[..., Any], calibration: Calibration, *, int8_io: bool = False
) -> Annotated:
    """``fn`` with fake quantization at every TFLite quantization site.

    Args:
        fn: The function, parameters closed over.
        calibration: From :func:`calibrate` on the same function (its rules and
            strictness apply).
        int8_io: The annotated function takes and returns integer codes (int8, or
            int16 under an int16 rule) for its float inputs and outputs, quantized
            with the input and output sites' parameters, so the exported model has
            integer inputs and outputs and no float tensor (no QUANTIZE from float,
            no DEQUANTIZE; int8 requantizations inside, e.g. in a layer norm, stay).
            Integer inputs of other types (e.g. int32 token ids) pass unchanged.

    Raises:
        UnsupportedOpError: In strict mode, for an op that cannot be quantized.
        TypeError: When the annotated function is called (or exported) with float
            inputs under ``int8_io``: it takes codes, e.g.
            ``qdq.quantize(x, *calibration.params("0:input0@"))``.
    """
    return Annotated(fn, calibration, int8_io)


def qat(
    apply_fn: Callable[..., Any], calibration: Calibration, *, track_ranges: bool = False
) -> Callable[..., Any]:
    """A trainable ``apply_fn`` with the LiteRT quantization in its forward pass.

    Weights are fake-quantized per output channel from their current values and
    activations at the calibrated sites, with straight-through gradients, so
    training sees the integer model's rounding.

    Args:
        apply_fn: ``apply_fn(params, *inputs)``, e.g. a Linen ``model.apply``.
        calibration: From :func:`calibrate` on ``lambda *x: apply_fn(params, *x)``.
        track_ranges: False: returns ``f(params, *inputs)`` with the calibrated
            ranges fixed (calibrate again after training, before export). True:
            returns ``f(params, ranges, *inputs) -> (outputs, ranges)``, where
            ``ranges`` starts as ``calibration.state()`` and each call folds the
            batch's min/max into the moving averages (as TFLite's QAT does); export
            with ``annotate(fn, calibration.with_state(ranges))``.
    """

    def fixed(params: Any, *inputs: Any) -> Any:
        interp = Interpreter(calibration, observe=False, strict=calibration.strict, train=True)
        return _interpret(apply_fn, inputs, interp, params=params)

    def tracked(params: Any, ranges: dict[str, Any], *inputs: Any) -> tuple[Any, dict]:
        interp = Interpreter(
            calibration,
            observe=False,
            strict=calibration.strict,
            train=True,
            state=ranges,
            update_ranges=True,
        )
        out = _interpret(apply_fn, inputs, interp, params=params)
        return out, {**ranges, **interp.new_state}

    return tracked if track_ranges else fixed

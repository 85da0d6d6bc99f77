r"""Dynamic-range ``.tflite`` models: int8 weights, float activations, checked op by op.

A dynamic-range model keeps its activations float and stores the weights of its
matmuls and lookup tables as int8. LiteRT runs such a ``FULLY_CONNECTED`` with its
*hybrid* kernels: each row of the input is quantized to int8 when the op runs (its
own range, asymmetric), multiplied by the int8 weight in integers and rescaled to
float. No calibration is needed, and a transformer's LayerNorms, residual stream
and softmax stay float, so its accuracy stays near the float model's at about a
quarter of its size.

litert-converter 0.5.0 makes no hybrid kernels (its ``qdq_conversion_mode`` gives
``DEQUANTIZE`` + float ``FULLY_CONNECTED`` for weight-only annotations), so
:func:`export_dynamic_range` converts the float function and then rewrites the
flatbuffer (:func:`quantize_weights`):

* the 2-D constant weight of each ``FULLY_CONNECTED`` with at least
  :data:`MIN_ELEMENTS` values becomes int8, symmetric and narrow-range
  (``[-127, 127]``), one scale per output channel; the op quantizes its inputs
  asymmetrically (``asymmetric_quantize_inputs``);
* each constant table of a ``GATHER`` (by rows) / ``GATHER_ND`` with at least
  :data:`MIN_ELEMENTS` values (an embedding) becomes int8 with one scale, and a
  ``DEQUANTIZE`` after the lookup makes its rows float again;
* everything else (biases, convolutions, ``BATCH_MATMUL`` of two activations, the
  float ops) is left as the converter wrote it.

Validation (:func:`check_ops`) runs the model under XNNPACK and under the builtin
kernels, keeping every tensor, and judges each rewritten op on the inputs it had:

* a ``FULLY_CONNECTED``'s output minus the float product of its input with the
  dequantized int8 weight (plus bias and fused activation) is the error of rounding
  the input to int8; its root mean square must be within :data:`ROUNDING_RATIO`
  times the one that rounding predicts (each row's step ``s`` gives each product an
  error variance ``s**2 / 12 * sum(w**2)``); one weight's scales off by 5% fail
  it (``tests/test_dynamic_range.py``);
* a lookup's ``DEQUANTIZE`` output must equal the dequantized rows its indices
  select, to float32 rounding.

The float ops are the converter's and are checked only through the outputs, which
must be within :data:`OUTPUT_TOLERANCE` relative L2 error of the JAX function.

Example:
    >>> import flax.linen as nn, jax, numpy as np
    >>> import qlitert
    >>> model = nn.Sequential([nn.Dense(256), nn.gelu, nn.Dense(64)])
    >>> x = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
    >>> params = model.init(jax.random.key(0), x)
    >>> tflite = qlitert.export_dynamic_range(lambda x: model.apply(params, x), x)
    >>> report = qlitert.inspect(tflite)
    >>> [report.tensors[op.inputs[1]].dtype for op in report.ops if op.name == "FULLY_CONNECTED"]
    ['INT8', 'INT8']
    >>> y = qlitert.LiteRTModel(tflite)(x)
    >>> want = np.asarray(model.apply(params, x))
    >>> bool(np.linalg.norm(y - want) / np.linalg.norm(want) < 0.01)
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from qlitert.annotate import annotate, calibrate
from qlitert.export import ExportError, _spec, export
from qlitert.inspection import ModelReport, from_bytes
from qlitert.rules import Rule
from qlitert.runtime import LiteRTModel
from qlitert.validation import KERNELS

# Weights and tables smaller than this stay float (biases, LayerNorm parameters,
# tiny projections whose int8 copy would save nothing).
MIN_ELEMENTS = 1024
# A FULLY_CONNECTED passes if the RMS of its error is at most this multiple of the
# RMS that rounding its input rows to int8 predicts. The tests' encoder and
# all-MiniLM-L6-v2 pass under both kernel sets; the encoder with one weight's scales
# off by 5% or 25% fails (test_dynamic_range.py).
ROUNDING_RATIO = 2.0
# Relative L2 error allowed between the model's outputs and the float JAX function
# (a gross-error check: the ops are judged one by one above). all-MiniLM-L6-v2 at
# 128 tokens is at 0.049 over benchmarks/litert.py's 512 sentences.
OUTPUT_TOLERANCE = 0.1
_TABLE_OPS = ("GATHER", "GATHER_ND")
_ACTIVATIONS = {0: None, 1: (0.0, np.inf), 2: (-1.0, 1.0), 3: (0.0, 6.0)}  # fused activations


@dataclasses.dataclass(frozen=True)
class Rewritten:
    """One op whose weight or table :func:`quantize_weights` made int8.

    Attributes:
        op: The op's index (in the rewritten model).
        kind: ``"FULLY_CONNECTED"``, or ``"GATHER"`` / ``"GATHER_ND"`` for a table.
        weight: The dequantized int8 weight or table (float32), as the model holds it.
        check_op: The op whose output is checked: the op itself, or the
            ``DEQUANTIZE`` after a lookup.
    """

    op: int
    kind: str
    weight: np.ndarray
    check_op: int


def _schema() -> Any:
    from ai_edge_litert import schema_py_generated as schema  # noqa: PLC0415 - heavy import

    return schema


def _buffer_array(model: Any, tensor: Any, dtype: Any) -> np.ndarray | None:
    data = model.buffers[tensor.buffer].data if tensor.buffer < len(model.buffers) else None
    if data is None or len(data) == 0:
        return None
    return np.frombuffer(np.asarray(data, np.uint8).tobytes(), dtype).reshape(tensor.shape)


def _int8_buffer(model: Any, codes: np.ndarray) -> int:
    buffer = _schema().BufferT()
    buffer.data = np.ascontiguousarray(codes, np.int8).view(np.uint8).ravel()
    model.buffers.append(buffer)
    return len(model.buffers) - 1


def _quantization(scale: np.ndarray, axis: int) -> Any:
    q = _schema().QuantizationParametersT()
    q.scale = [float(s) for s in scale]
    q.zeroPoint = [0] * len(scale)
    q.quantizedDimension = axis
    return q


def _symmetric(w: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes (narrow range) and scales of ``w``: per slice along ``axis``, or one."""
    w64 = w.astype(np.float64)
    if axis is None:
        absmax = np.array([np.max(np.abs(w64))])
        scale = np.maximum(absmax, 1e-12) / 127.0
        codes = np.round(w64 / scale[0])
    else:
        absmax = np.max(np.abs(w64), axis=tuple(d for d in range(w.ndim) if d != axis))
        scale = np.maximum(absmax, 1e-12) / 127.0
        shape = [1] * w.ndim
        shape[axis] = -1
        codes = np.round(w64 / scale.reshape(shape))
    scale32 = scale.astype(np.float32)
    return np.clip(codes, -127, 127).astype(np.int8), scale32


def quantize_weights(
    tflite: bytes, *, min_elements: int = MIN_ELEMENTS
) -> tuple[bytes, list[Rewritten]]:
    """Rewrites a float ``.tflite`` as a dynamic-range one (see the module docstring).

    Args:
        tflite: A float model (every weight FLOAT32), e.g. from
            ``qlitert.export(fn, x, validate=False)``.
        min_elements: Weights and tables with fewer values stay float.

    Returns:
        The rewritten flatbuffer and the ops whose weights it quantized.

    Raises:
        ValueError: If ``min_elements`` is not an int >= 1, the model is not valid,
            or no weight qualifies (there would be nothing to quantize).
    """
    if isinstance(min_elements, bool) or not isinstance(min_elements, int) or min_elements < 1:
        raise ValueError(f"min_elements={min_elements!r}; allowed: an int >= 1")
    import flatbuffers  # noqa: PLC0415 - heavy import, only for converted models

    report = from_bytes(bytes(tflite))  # raises ValueError for a damaged file
    schema = _schema()
    model: Any = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)  # generated, untyped
    graph = model.subgraphs[0]
    readers: dict[int, set[str]] = {}
    for op in report.ops:
        for i in op.inputs:
            readers.setdefault(i, set()).add(op.name)
    buffer_users: dict[int, int] = {}
    for t in graph.tensors:
        buffer_users[t.buffer] = buffer_users.get(t.buffer, 0) + 1
    done: dict[int, np.ndarray] = {}  # tensor -> its dequantized int8 values
    rewritten: list[tuple[int, str, np.ndarray]] = []
    lookups: list[tuple[int, int]] = []  # (op index, table tensor)
    for k, (op, seen) in enumerate(zip(graph.operators, report.ops, strict=True)):
        if seen.name not in ("FULLY_CONNECTED", *_TABLE_OPS):
            continue
        i = int(op.inputs[1] if seen.name == "FULLY_CONNECTED" else op.inputs[0])
        tensor = graph.tensors[i]
        if tensor.type != schema.TensorType.FLOAT32 or readers.get(i) != {seen.name}:
            continue
        options = op.builtinOptions
        if seen.name == "GATHER" and (options.axis != 0 or options.batchDims != 0):
            continue  # a table is looked up by rows
        if i not in done:
            w = _buffer_array(model, tensor, np.float32)
            if w is None or w.size < min_elements or not np.all(np.isfinite(w)):
                continue
            axis = 0 if seen.name == "FULLY_CONNECTED" else None
            codes, scale = _symmetric(w, axis)
            if buffer_users[tensor.buffer] == 1:  # drop the float copy
                model.buffers[tensor.buffer].data = None
            tensor.buffer = _int8_buffer(model, codes)
            tensor.type = schema.TensorType.INT8
            tensor.quantization = _quantization(scale, axis or 0)
            shape = [1] * w.ndim
            if axis is not None:
                shape[axis] = -1
            done[i] = codes.astype(np.float32) * scale.reshape(shape)
        if seen.name == "FULLY_CONNECTED":
            op.builtinOptions.asymmetricQuantizeInputs = True
        else:
            lookups.append((k, i))
        rewritten.append((k, seen.name, done[i]))
    if not rewritten:
        raise ValueError(
            f"tflite has no FULLY_CONNECTED weight nor GATHER / GATHER_ND table of FLOAT32 "
            f"constants with >= {min_elements} values (min_elements); nothing to quantize"
        )
    # A DEQUANTIZE after each lookup: its output takes the float tensor's place.
    code_index = _opcode(model, schema.BuiltinOperator.DEQUANTIZE)
    inserted: list[int] = []  # original op indices after which a DEQUANTIZE goes
    new_ops = []
    lookup_ops = dict(lookups)
    for k, op in enumerate(graph.operators):
        new_ops.append(op)
        if k not in lookup_ops:
            continue
        table = graph.tensors[lookup_ops[k]]
        out = graph.tensors[op.outputs[0]]
        codes = schema.TensorT()
        codes.name = (out.name or b"") + b"/int8"
        codes.shape = list(out.shape)
        codes.shapeSignature = out.shapeSignature
        codes.type = schema.TensorType.INT8
        codes.quantization = _quantization(np.asarray(table.quantization.scale), 0)
        codes.buffer = 0  # the empty buffer: an activation
        graph.tensors.append(codes)
        dq = schema.OperatorT()
        dq.opcodeIndex = code_index
        dq.inputs = [len(graph.tensors) - 1]
        dq.outputs = [op.outputs[0]]
        op.outputs = [len(graph.tensors) - 1]
        new_ops.append(dq)
        inserted.append(k)
    graph.operators = new_ops
    builder = flatbuffers.Builder(len(tflite) // 3 + 4096)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    out = [
        Rewritten(
            op=k + sum(j < k for j in inserted),
            kind=kind,
            weight=w,
            check_op=k + sum(j < k for j in inserted) + (kind != "FULLY_CONNECTED"),
        )
        for k, kind, w in rewritten
    ]
    return bytes(builder.Output()), out


def _opcode(model: Any, builtin: int) -> int:
    """The index of ``builtin``'s operator code, added if the model has none."""
    for i, code in enumerate(model.operatorCodes):
        if max(code.builtinCode, code.deprecatedBuiltinCode) == builtin:
            return i
    code = _schema().OperatorCodeT()
    code.builtinCode = builtin
    code.deprecatedBuiltinCode = min(builtin, 127)
    code.version = 1
    model.operatorCodes.append(code)
    return len(model.operatorCodes) - 1


def _fully_connected_ratio(
    report: ModelReport, values: dict[int, np.ndarray], r: Rewritten, activation: int
) -> float:
    """Observed / predicted RMS error of a hybrid FULLY_CONNECTED (see the module doc)."""
    op = report.ops[r.op]
    w = r.weight.astype(np.float64)
    x = values[op.inputs[0]].astype(np.float64).reshape(-1, w.shape[1])
    y = values[op.outputs[0]].astype(np.float64).reshape(x.shape[0], -1)
    want = x @ w.T
    if len(op.inputs) > 2 and op.inputs[2] >= 0:
        want = want + values[op.inputs[2]].astype(np.float64)
    bounds = _ACTIVATIONS.get(activation)
    if bounds is not None:
        want = np.clip(want, *bounds)
    step = (np.maximum(x.max(1), 0.0) - np.minimum(x.min(1), 0.0)) / 255.0
    predicted = np.mean(step**2 / 12.0) * np.mean(np.sum(w**2, axis=1))
    observed = float(np.mean((y - want) ** 2))
    if predicted == 0.0:
        return 0.0 if observed == 0.0 else np.inf
    return float(np.sqrt(observed / predicted))


def _lookup_error(report: ModelReport, values: dict[int, np.ndarray], r: Rewritten) -> float:
    """Largest difference between a lookup's float rows and the dequantized table's."""
    op = report.ops[r.op]
    indices = values[op.inputs[1]].astype(np.int64)
    if r.kind == "GATHER_ND":
        depth = indices.shape[-1]
        flat = indices.reshape(-1, depth)
        want = r.weight[tuple(flat.T)].reshape(*indices.shape[:-1], *r.weight.shape[depth:])
    else:
        want = np.take(r.weight, indices, axis=0)
    got = values[report.ops[r.check_op].outputs[0]]
    return float(np.max(np.abs(got.reshape(want.shape) - want), initial=0.0))


def check_ops(
    tflite: bytes,
    rewritten: Sequence[Rewritten],
    inputs: Sequence[Any],
    *,
    kernels: str = "xnnpack",
) -> list[str]:
    """Problems of the op-by-op check of a dynamic-range model under ``kernels``.

    Args:
        tflite: The model from :func:`quantize_weights`.
        rewritten: Its rewritten ops (:func:`quantize_weights`' second result).
        inputs: Model inputs to run it on.
        kernels: ``"xnnpack"`` or ``"builtin"``.

    Returns:
        One line per op that fails (empty: all pass).
    """
    model = LiteRTModel(tflite, kernels=kernels, preserve_all_tensors=True)
    model(*inputs)
    values = model.tensors()
    report = from_bytes(bytes(tflite))
    graph = _schema().ModelT.InitFromPackedBuf(bytearray(tflite), 0).subgraphs[0]
    problems = []
    for r in rewritten:
        if r.kind == "FULLY_CONNECTED":
            activation = graph.operators[r.op].builtinOptions.fusedActivationFunction
            ratio = _fully_connected_ratio(report, values, r, activation)
            if not ratio <= ROUNDING_RATIO:
                problems.append(
                    f"op {r.op} FULLY_CONNECTED: its error is {ratio:.1f}x the RMS that "
                    f"rounding its input to int8 explains (allowed: {ROUNDING_RATIO}x)"
                )
        else:
            err = _lookup_error(report, values, r)
            if not err <= 1e-6 * max(float(np.max(np.abs(r.weight))), 1e-30):
                problems.append(
                    f"op {r.check_op} DEQUANTIZE after {r.kind} (op {r.op}): rows differ from "
                    f"the int8 table's by up to {err:.3g}"
                )
    return problems


def export_dynamic_range(
    fn: Callable[..., Any],
    *example_inputs: Any,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    min_elements: int = MIN_ELEMENTS,
    validate: bool = True,
) -> bytes:
    """Exports a float JAX function as a dynamic-range ``.tflite`` (int8 weights).

    Args:
        fn: The float function, parameters closed over (no quantization annotations).
        *example_inputs: Arrays fixing the static shapes, and the validation inputs.
        input_names: Signature input names (default ``x0, x1, ...``).
        output_names: Signature output names (default ``y0, y1, ...``).
        min_elements: Weights and tables with fewer values stay float.
        validate: Check each rewritten op under both kernel sets and the outputs
            against ``fn`` (see the module docstring).

    Returns:
        The ``.tflite`` flatbuffer.

    Raises:
        TypeError: If ``fn`` is not callable or an example input not numeric.
        qlitert.ExportError: For what :func:`qlitert.export` refuses, a model with
            nothing to quantize, or a failed validation (the report names the ops).
    """
    if not callable(fn):
        raise TypeError(f"fn is a {type(fn).__name__}; allowed: a callable")
    for i, x in enumerate(example_inputs):  # named as export names them, before calibrating
        _spec(x, i, validate)
    # Every op float, through qlitert's interpreter: it writes the composites LiteRT
    # has kernels for (GELU, softmax...) where the converter would expand them.
    floats = calibrate(
        fn, [example_inputs], rules=[Rule(act_qtype=None, weight_qtype=None)], strict=False
    )
    float_model = export(
        annotate(fn, floats),
        *example_inputs,
        input_names=input_names,
        output_names=output_names,
        validate=False,
    )
    try:
        tflite, rewritten = quantize_weights(float_model, min_elements=min_elements)
    except ValueError as err:
        raise ExportError(str(err)) from None
    if validate:
        problems = _validate(tflite, rewritten, fn, example_inputs)
        if problems:
            raise ExportError("the dynamic-range model failed validation:\n" + "\n".join(problems))
    return tflite


def _validate(
    tflite: bytes, rewritten: list[Rewritten], fn: Callable[..., Any], inputs: Sequence[Any]
) -> list[str]:
    """Both kernel sets: the op-by-op check and the outputs against ``fn``."""
    want = fn(*inputs)
    want = [np.asarray(w, np.float64) for w in (want if isinstance(want, tuple | list) else [want])]
    problems = []
    for kernels in KERNELS:
        problems += [
            f"with the {kernels} kernels: {p}"
            for p in check_ops(tflite, rewritten, inputs, kernels=kernels)
        ]
        got = LiteRTModel(tflite, kernels=kernels)(*inputs)
        got = got if isinstance(got, tuple) else (got,)
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            error = np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30)
            if not error <= OUTPUT_TOLERANCE:
                problems.append(
                    f"with the {kernels} kernels: output {k} is {error:.3g} relative L2 error "
                    f"from the JAX function (allowed: {OUTPUT_TOLERANCE})"
                )
    return problems

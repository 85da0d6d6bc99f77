"""StableHLO → TFLite flatbuffer, through litert-converter's (private) Python API.

litert-converter exposes no public Python entry point for StableHLO; its
``converter_api_ext`` module does the conversion used here: deserialize the
portable artifact that ``jax.export`` produces, run the StableHLO→TFL passes with
*strict QDQ mode* (each ``quant.fake_quant`` composite becomes a quantized tensor
and the ops between them integer kernels), set the signature, and write the
flatbuffer. Everything private lives in this module, behind a version check.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Sequence
from typing import Any

SUPPORTED = ("0.5.",)


class ConverterError(RuntimeError):
    """The converter is missing, has an unsupported version, or failed."""


def version() -> str:
    """The installed litert-converter version.

    Raises:
        ConverterError: If it is not installed.
    """
    try:
        return importlib.metadata.version("litert-converter")
    except importlib.metadata.PackageNotFoundError:
        raise ConverterError(
            "litert-converter is not installed: pip install 'litert-converter>=0.5,<0.6'"
        ) from None


def check_version() -> str:
    """Returns the version, or raises if qlitert was not verified against it.

    Raises:
        ConverterError: Naming the installed and the supported versions.
    """
    v = version()
    if not v.startswith(SUPPORTED):
        raise ConverterError(
            f"litert-converter {v} is installed; qlitert drives its private API and was "
            f"verified with versions {', '.join(s + 'x' for s in SUPPORTED)} only"
        )
    return v


def stablehlo_to_tflite(
    artifact: bytes,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    signature: str = "serving_default",
) -> bytes:
    """Converts a serialized StableHLO module (``Exported.mlir_module_serialized``).

    Args:
        artifact: The portable StableHLO artifact.
        input_names: Names of the signature's inputs, in order.
        output_names: Names of its outputs, in order.
        signature: The signature key.

    Returns:
        The ``.tflite`` flatbuffer.

    Raises:
        ConverterError: On an unsupported converter version or a failed conversion.
    """
    check_version()
    # Compiled, private modules (no type information): imported by name.
    stablehlo: Any = importlib.import_module("litert_converter._stablehlo")
    api: Any = importlib.import_module("litert_converter.converter_api_ext")
    ir: Any = importlib.import_module("litert_converter.mlir.ir")
    passmanager: Any = importlib.import_module("litert_converter.mlir.passmanager")

    try:
        with ir.Context() as ctx:
            api.prepare_mlir_context(ctx)
            module = stablehlo.deserialize_portable_artifact(ctx, artifact)
            config = api.ConvertToTFLConfig()
            config.strict_qdq_mode = True
            api.run_convert_to_tfl_passes(module, passmanager.PassManager(), config)
            api.set_signature(module.operation, signature, list(input_names), list(output_names))
            tflite = bytes(api.export_flatbuffer_to_bytes(module.operation))
    except Exception as err:  # the converter raises plain RuntimeErrors with MLIR diagnostics
        raise ConverterError(f"litert-converter failed: {err}") from err
    tflite = integer_broadcasts(fuse_requantizations(tflite))
    return widen_int16_biases(general_int16_adds(tflite))


# Ops whose inputs are (activation, weight, bias) and whose 16x8 kernels read int64
# biases (checked with LiteRT 2.3.0).
_INT16_BIAS_OPS = ("CONV_2D", "DEPTHWISE_CONV_2D")


def _rewrite(tflite: bytes, edit: Callable[[Any, Any, Callable[[Any], str]], int]) -> bytes:
    """``tflite`` after ``edit(model, schema, op_name)``, or unchanged if it changed nothing.

    ``edit`` changes the unpacked model (``schema.ModelT``) in place and returns how
    many things it changed; ``op_name(op)`` is an operator's builtin name.
    """
    import flatbuffers  # noqa: PLC0415 - heavy imports, only for converted models
    from ai_edge_litert import schema_py_generated as schema  # noqa: PLC0415

    model: Any = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)  # generated, untyped
    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}

    def op_name(op: Any) -> str:
        code = model.operatorCodes[op.opcodeIndex]
        return names.get(max(code.builtinCode, code.deprecatedBuiltinCode), "")

    if not edit(model, schema, op_name):
        return tflite
    builder = flatbuffers.Builder(len(tflite) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def widen_int16_biases(tflite: bytes) -> bytes:
    """Stores the int32 biases of 16x8 convolutions as int64, as LiteRT's kernels read them.

    litert-converter 0.5.0 writes int32 biases for convolutions with int16
    inputs; LiteRT 2.3.0's ``CONV_2D`` then reads them as int64 without a check
    (wrong outputs) and ``DEPTHWISE_CONV_2D`` refuses them. ``FULLY_CONNECTED``
    takes int32 and is left alone. Models without such ops come back unchanged.
    A widened bias gets a buffer of its own: the converter shares equal constants
    (e.g. zero biases) between tensors, and a shared buffer widened in place would
    be widened once per user (and break an int32 bias sharing it).
    """
    import numpy as np  # noqa: PLC0415

    def edit(model: Any, schema: Any, op_name: Callable[[Any], str]) -> int:
        int16, int32 = schema.TensorType.INT16, schema.TensorType.INT32
        changed = 0
        widened: dict[int, int] = {}  # buffer -> its int64 copy (the converter shares buffers)
        for graph in model.subgraphs:
            for op in graph.operators:
                inputs = list(op.inputs)
                if op_name(op) not in _INT16_BIAS_OPS or len(inputs) < 3 or inputs[2] < 0:
                    continue
                bias = graph.tensors[inputs[2]]
                if graph.tensors[inputs[0]].type != int16 or bias.type != int32:
                    continue
                if bias.buffer not in widened:
                    # A new buffer: others (e.g. a fully connected int32 bias) may share it.
                    data = np.asarray(model.buffers[bias.buffer].data, np.uint8).tobytes()
                    buffer: Any = schema.BufferT()  # generated: data typed as a list
                    buffer.data = np.frombuffer(data, np.int32).astype(np.int64).view(np.uint8)
                    model.buffers.append(buffer)
                    widened[bias.buffer] = len(model.buffers) - 1
                bias.buffer = widened[bias.buffer]
                bias.type = schema.TensorType.INT64
                changed += 1
        return changed

    return _rewrite(tflite, edit)


def general_int16_adds(tflite: bytes) -> bytes:
    """Makes every int16 ``ADD`` / ``SUB`` use LiteRT's kernel for any scales.

    Their options default to ``pot_scale_int16``, and litert-converter 0.5.0 keeps
    the default: LiteRT 2.3.0 then takes its power-of-two kernel whenever the three
    scales are within 0.07 % of powers of two (tanh's fixed 2^-15 output plus a
    constant 1 at 1/32767, as in the tanh GELU), and refuses the model unless one
    input has the output's scale. Models without such ops come back unchanged.
    """

    def edit(model: Any, schema: Any, op_name: Callable[[Any], str]) -> int:
        changed = 0
        for graph in model.subgraphs:
            for op in graph.operators:
                if op_name(op) not in ("ADD", "SUB"):
                    continue
                if graph.tensors[op.outputs[0]].type != schema.TensorType.INT16:
                    continue
                if op.builtinOptions is not None and op.builtinOptions.potScaleInt16:
                    op.builtinOptions.potScaleInt16 = False
                    changed += 1
        return changed

    return _rewrite(tflite, edit)


def fuse_requantizations(tflite: bytes) -> bytes:
    """Makes each DEQUANTIZE -> QUANTIZE pair between integer tensors one QUANTIZE.

    qlitert annotates a change of integer type (int8 -> int16 and back, between
    modules with different rules) as two quantizations with an optimization barrier
    between them; litert-converter 0.5.0 then writes a DEQUANTIZE to float and a
    QUANTIZE from it. LiteRT's QUANTIZE requantizes between integer types itself,
    so the pair becomes that one op when the float tensor between them has no
    other reader and is no graph output. Models without such pairs come back
    unchanged.
    """

    def edit(model: Any, schema: Any, op_name: Callable[[Any], str]) -> int:
        integer = (schema.TensorType.INT8, schema.TensorType.INT16)
        changed = 0
        for graph in model.subgraphs:
            ops = list(graph.operators or [])
            readers: dict[int, int] = {}
            for op in ops:
                for i in op.inputs:
                    readers[int(i)] = readers.get(int(i), 0) + 1
            producer = {int(o): op for op in ops for o in op.outputs}
            outputs = {int(o) for o in graph.outputs}
            fused: set[int] = set()  # ids of the DEQUANTIZE ops folded away
            for op in ops:
                if op_name(op) != "QUANTIZE" or not op.inputs:
                    continue
                source = int(op.inputs[0])
                dq = producer.get(source)
                if dq is None or op_name(dq) != "DEQUANTIZE":
                    continue
                if readers.get(source) != 1 or source in outputs:
                    continue
                if graph.tensors[dq.inputs[0]].type not in integer:
                    continue
                if graph.tensors[op.outputs[0]].type not in integer:
                    continue
                op.inputs = [int(dq.inputs[0])]
                fused.add(id(dq))
                changed += 1
            graph.operators = [op for op in ops if id(op) not in fused]
        return changed

    return _rewrite(tflite, edit)


def integer_broadcasts(tflite: bytes) -> bytes:
    """Makes DEQUANTIZE -> float BROADCAST_TO -> QUANTIZE (same parameters) one integer op.

    qlitert broadcasts an int16 ``ADD``'s activation operand behind an optimization
    barrier (the kernel takes operands of one shape, and litert-converter 0.5.0
    folds a plain broadcast back into the ``ADD``); the converter then leaves the
    ``BROADCAST_TO`` float between a DEQUANTIZE and a QUANTIZE with the parameters
    the DEQUANTIZE read. ``BROADCAST_TO`` copies values of any type, so it takes
    the integer tensor and writes the QUANTIZE's output itself. Models without
    such a chain come back unchanged.
    """

    def same_quantization(a: Any, b: Any) -> bool:
        qa, qb = a.quantization, b.quantization
        return (
            a.type == b.type
            and qa is not None
            and qb is not None
            and list(qa.scale) == list(qb.scale)
            and list(qa.zeroPoint) == list(qb.zeroPoint)
        )

    def edit(model: Any, schema: Any, op_name: Callable[[Any], str]) -> int:
        changed = 0
        for graph in model.subgraphs:
            ops = list(graph.operators or [])
            readers: dict[int, list[Any]] = {}
            for op in ops:
                for i in op.inputs:
                    readers.setdefault(int(i), []).append(op)
            producer = {int(o): op for op in ops for o in op.outputs}
            outputs = {int(o) for o in graph.outputs}
            dropped: set[int] = set()
            for op in ops:
                if op_name(op) != "BROADCAST_TO":
                    continue
                source, result = int(op.inputs[0]), int(op.outputs[0])
                dq, users = producer.get(source), readers.get(result, [])
                if dq is None or op_name(dq) != "DEQUANTIZE" or len(users) != 1:
                    continue
                (q,) = users
                if op_name(q) != "QUANTIZE" or {source, result} & outputs:
                    continue
                if len(readers.get(source, [])) != 1:
                    continue
                codes, out = int(dq.inputs[0]), int(q.outputs[0])
                if not same_quantization(graph.tensors[codes], graph.tensors[out]):
                    continue
                op.inputs = [codes, *list(op.inputs)[1:]]
                op.outputs = [out]
                dropped |= {id(dq), id(q)}
                changed += 1
            graph.operators = [op for op in ops if id(op) not in dropped]
        return changed

    return _rewrite(tflite, edit)

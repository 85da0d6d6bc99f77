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
from collections.abc import Sequence
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
    return widen_int16_biases(tflite)


# Ops whose inputs are (activation, weight, bias) and whose 16x8 kernels read int64
# biases (checked with LiteRT 2.3.0).
_INT16_BIAS_OPS = ("CONV_2D", "DEPTHWISE_CONV_2D")


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
    import flatbuffers  # noqa: PLC0415 - heavy imports, only for converted models
    import numpy as np  # noqa: PLC0415
    from ai_edge_litert import schema_py_generated as schema  # noqa: PLC0415

    model: Any = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)  # generated, untyped
    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    int16, int32 = schema.TensorType.INT16, schema.TensorType.INT32
    changed = 0
    widened: dict[int, int] = {}  # buffer -> its int64 copy (the converter shares buffers)
    for graph in model.subgraphs:
        for op in graph.operators:
            code = model.operatorCodes[op.opcodeIndex]
            name = names.get(max(code.builtinCode, code.deprecatedBuiltinCode))
            inputs = list(op.inputs)
            if name not in _INT16_BIAS_OPS or len(inputs) < 3 or inputs[2] < 0:
                continue
            bias = graph.tensors[inputs[2]]
            if graph.tensors[inputs[0]].type != int16 or bias.type != int32:
                continue
            if bias.buffer not in widened:
                # A new buffer: others (e.g. a fully connected int32 bias) may share this one.
                data = np.asarray(model.buffers[bias.buffer].data, np.uint8).tobytes()
                buffer: Any = schema.BufferT()  # generated: data typed as a list
                buffer.data = np.frombuffer(data, np.int32).astype(np.int64).view(np.uint8)
                model.buffers.append(buffer)
                widened[bias.buffer] = len(model.buffers) - 1
            bias.buffer = widened[bias.buffer]
            bias.type = schema.TensorType.INT64
            changed += 1
    if not changed:
        return tflite
    builder = flatbuffers.Builder(len(tflite) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())

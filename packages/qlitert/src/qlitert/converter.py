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
            return bytes(api.export_flatbuffer_to_bytes(module.operation))
    except Exception as err:  # the converter raises plain RuntimeErrors with MLIR diagnostics
        raise ConverterError(f"litert-converter failed: {err}") from err

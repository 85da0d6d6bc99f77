"""qlitert: full-integer LiteRT (``.tflite``) export of quantized JAX models.

Calibrate a function (:func:`calibrate`, optionally with per-module :class:`Rule`
objects, see :mod:`~qlitert.rules`), fine-tune it with the LiteRT rounding
(:func:`qat`) and annotate it (:func:`annotate`) — or annotate its quantization by hand with
:mod:`qlitert.qdq` (``quant.fake_quant`` composites with static scales) — then
:func:`export` converts it with litert-converter and validates the result
(integer kernels only, every op within one step of JAX);
:func:`export_dynamic_range` exports a float function with int8 weights and float
activations (LiteRT's hybrid kernels, no calibration); :func:`inspect` lists a
model's ops and tensors; :class:`LiteRTModel` runs it with the LiteRT
interpreter; :func:`compare_layers` compares every quantized tensor of a model
with JAX, layer by layer (how :func:`export` validates); :func:`save` writes it
atomically. :class:`SiteKey` names the
quantization sites of a :class:`Calibration`.
"""

from qlitert import converter, dynamic_range, qdq, rules, sensitivity
from qlitert.annotate import Annotated, annotate, calibrate, qat
from qlitert.calibration import Calibration
from qlitert.dynamic_range import export_dynamic_range
from qlitert.export import (
    ExportError,
    check_agreement,
    check_kernels,
    check_path,
    export,
    save,
)
from qlitert.inspection import ModelReport, inspect
from qlitert.interpreter import UnsupportedOpError
from qlitert.rules import Rule
from qlitert.runtime import LiteRTModel
from qlitert.scopes import SiteKey
from qlitert.sensitivity import Int16Choice, ModuleSensitivity, choose_int16
from qlitert.validation import Layer, LayerReport, compare_layers

__version__ = "0.1.0"

__all__ = [
    "Annotated",
    "Calibration",
    "ExportError",
    "Int16Choice",
    "Layer",
    "LayerReport",
    "LiteRTModel",
    "ModelReport",
    "ModuleSensitivity",
    "Rule",
    "SiteKey",
    "UnsupportedOpError",
    "__version__",
    "annotate",
    "calibrate",
    "check_agreement",
    "check_kernels",
    "check_path",
    "choose_int16",
    "compare_layers",
    "converter",
    "dynamic_range",
    "export",
    "export_dynamic_range",
    "inspect",
    "qat",
    "qdq",
    "rules",
    "save",
    "sensitivity",
]

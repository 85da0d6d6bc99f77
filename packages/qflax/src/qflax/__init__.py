"""qflax: quantize Flax Linen and NNX models with one call, on qcore's numerics.

Rules (:class:`QuantizationRule`) select ops by module path; a provider
(:class:`PtqProvider`, :class:`QtProvider`) says what happens to them;
:func:`quantize_model` applies it to a Linen or NNX model and
:func:`quantize_params` quantizes float checkpoints without running the model.
:mod:`qflax.checkpoint` saves and loads quantized params (orbax, safetensors).
:class:`LoraProvider` adds LoRA adapters (QLoRA on a quantized base);
:mod:`qflax.gptq`, :mod:`qflax.awq` and :mod:`qflax.smoothquant` turn calibration
data (a :class:`CalibrationData`) into better PTQ params
(``QuantizationRule(rotation="hadamard")`` rotates an op's contraction axis
first); :mod:`qflax.report` and :mod:`qflax.mixed_precision` measure each op's
error and pick a format per op under a size budget; :mod:`qflax.presets` holds
ready-made plans (4 bits).
See the docs page "Quantize a Flax model".
"""

from qflax import (
    awq,
    calibration,
    checkpoint,
    gptq,
    layer_stats,
    lora,
    mixed_precision,
    presets,
    recipe,
    report,
    rotation,
    smoothquant,
    stats,
)
from qflax._calibration_data import CalibrationData
from qflax._engine.context import CallContext
from qflax._engine.dispatch import LookupSite, OpSite
from qflax._engine.opcall import OpCall, TakeCall
from qflax._engine.registry import BUILTIN_NAMES as OP_NAMES
from qflax._engine.registry import OpDef
from qflax._engine.registry import names as op_names
from qflax._engine.registry import register as register_op
from qflax._engine.registry import unregister as unregister_op
from qflax._model import QuantizedLinen, quantize_model
from qflax._params import quantize_params
from qflax.providers import LoraParam, LoraProvider, LoraRule, Provider, PtqProvider, QtProvider
from qflax.qparam import ActScale, QuantizedParam
from qflax.rule import QuantizationRule, RuleMatcher
from qflax.stats import QuantStat

__version__ = "0.1.0"

__all__ = [
    "OP_NAMES",
    "ActScale",
    "CalibrationData",
    "CallContext",
    "LoraParam",
    "LoraProvider",
    "LookupSite",
    "LoraRule",
    "OpCall",
    "OpDef",
    "OpSite",
    "Provider",
    "PtqProvider",
    "QtProvider",
    "QuantStat",
    "QuantizationRule",
    "QuantizedLinen",
    "QuantizedParam",
    "RuleMatcher",
    "TakeCall",
    "__version__",
    "awq",
    "calibration",
    "checkpoint",
    "gptq",
    "layer_stats",
    "lora",
    "mixed_precision",
    "op_names",
    "presets",
    "quantize_model",
    "quantize_params",
    "recipe",
    "register_op",
    "report",
    "rotation",
    "smoothquant",
    "stats",
    "unregister_op",
]

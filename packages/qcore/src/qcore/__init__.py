"""qcore: pure-function JAX quantization numerics.

Quantization types (:mod:`qcore.qtypes`), calibration
(:mod:`qcore.calibration`), the :class:`QArray` pytree with quantize /
dequantize (:mod:`qcore.qarray`), rounding and scale arithmetic
(:mod:`qcore.numerics`), fake quantization with straight-through gradients
(:mod:`qcore.fakequant`), sub-byte packing (:mod:`qcore.packing`), error
metrics (:mod:`qcore.metrics`) and ops that take QArrays (:mod:`qcore.ops`:
``dot_general``, ``einsum``, ``dot``, ``matmul``, ``conv_general_dilated``,
``ragged_dot``, ``take``), and rules selected by module path (:mod:`qcore.rules`,
shared by qflax and qlitert). Depends on jax, numpy and ml_dtypes only.

Example:
    >>> import jax.numpy as jnp
    >>> import qcore
    >>> q = qcore.quantize(jnp.array([0.5, -1.0, 2.0]), qcore.HowToQuantize(qtype="int8"))
    >>> q.qvalue
    Array([  32,  -64,  127], dtype=int8)
    >>> qcore.dequantize(q).tolist()  # doctest: +NUMBER
    [0.502, -1.004, 1.992]
"""

from qcore import calibration, fakequant, metrics, numerics, ops, packing, qarray, qtypes
from qcore.calibration import Calibrator
from qcore.fakequant import fake_quant, fake_quant_with_scale
from qcore.metrics import mean_relative_error, sqnr_db
from qcore.ops import (
    BackwardQuant,
    TrainingQuant,
    conv_general_dilated,
    dot,
    dot_general,
    einsum,
    matmul,
    ragged_dot,
    take,
    train_conv_general_dilated,
    train_dot_general,
    train_einsum,
    train_ragged_dot,
)
from qcore.qarray import (
    HowToQuantize,
    Packing,
    QArray,
    calibrate,
    dequantize,
    pack,
    quantize,
    quantize_with_scale_zero_point,
    requantize,
    unpack,
)
from qcore.qtypes import QType

__version__ = "0.1.0"

__all__ = [
    "BackwardQuant",
    "Calibrator",
    "HowToQuantize",
    "Packing",
    "QArray",
    "QType",
    "TrainingQuant",
    "__version__",
    "calibrate",
    "calibration",
    "conv_general_dilated",
    "dequantize",
    "dot",
    "dot_general",
    "einsum",
    "fake_quant",
    "fake_quant_with_scale",
    "fakequant",
    "matmul",
    "mean_relative_error",
    "metrics",
    "numerics",
    "ops",
    "pack",
    "packing",
    "qarray",
    "qtypes",
    "quantize",
    "quantize_with_scale_zero_point",
    "ragged_dot",
    "requantize",
    "sqnr_db",
    "take",
    "train_conv_general_dilated",
    "train_dot_general",
    "train_einsum",
    "train_ragged_dot",
    "unpack",
]

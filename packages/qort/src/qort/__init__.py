"""qort: quantized JAX and Flax models on ONNX Runtime.

:func:`export` turns a model quantized with :func:`qflax.quantize_model` (or a float
one) into an ONNX graph whose quantized products are integer ONNX ops, checks it
with ``onnx.checker`` and validates it op by op against JAX under ONNX Runtime's
CPU provider (:mod:`qort.validation`); :func:`export_function` does the same for a
plain JAX function. :class:`Session` runs the result on NumPy or JAX arrays.
See the docs page "Deploy to ONNX Runtime".
"""

from qort import qdq, validation
from qort._errors import ExportError, ExportWarning, ValidationError
from qort.exported import Exported, export, export_function
from qort.session import Session
from qort.validation import UnitResult, ValidationReport

__version__ = "0.1.0"

__all__ = [
    "ExportError",
    "ExportWarning",
    "Exported",
    "Session",
    "UnitResult",
    "ValidationError",
    "ValidationReport",
    "__version__",
    "export",
    "export_function",
    "qdq",
    "validation",
]

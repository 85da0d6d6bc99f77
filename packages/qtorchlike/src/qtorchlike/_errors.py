"""Errors that are also the exception classes Brevitas raises in the same situation.

Code written for Brevitas that catches Brevitas' class keeps working, and code that
catches qtorchlike's documented class does too.
"""

from __future__ import annotations

from qtorchlike.inject import DependencyError


class MissingInputScaleError(ValueError, RuntimeError):
    """A bias quantizer needs the input's scale and the input is not quantized.

    A ValueError here; Brevitas raises RuntimeError.
    """


class NoQuantTensorError(RuntimeError, AssertionError):
    """``return_quant_tensor=True`` on a layer that produced a float output.

    A RuntimeError here; Brevitas fails an assertion.
    """


class MissingBoundsError(TypeError, DependencyError):
    """A quantized clamp (``QuantHardTanh``) built without ``min_val``/``max_val``.

    A TypeError here; Brevitas' injector raises DependencyError.
    """

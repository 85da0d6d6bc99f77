"""qflax: quantize Flax Linen and NNX models with one call, on qcore's numerics.

Work in progress: this version provides quantization rules and their matching
(:mod:`qflax.rule`); op interception, providers (PTQ, QAT), ``quantize_model``
and ``quantize_params`` follow.
"""

from qflax.rule import OP_NAMES, QuantizationRule, RuleMatcher

__version__ = "0.1.0"

__all__ = ["OP_NAMES", "QuantizationRule", "RuleMatcher", "__version__"]

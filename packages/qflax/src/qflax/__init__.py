"""qflax: quantize Flax Linen and NNX models with one call, on qcore's numerics.

Work in progress: this version provides quantization rules and their matching
(:mod:`qflax.rule`), the interception of the JAX ops a model calls
(:mod:`qflax.interception`) and the calling module's path (:mod:`qflax.module_path`);
providers (PTQ, QAT), ``quantize_model`` and
``quantize_params`` follow.
"""

from qflax import interception, module_path
from qflax.rule import OP_NAMES, QuantizationRule, RuleMatcher

__version__ = "0.1.0"

__all__ = [
    "OP_NAMES",
    "QuantizationRule",
    "RuleMatcher",
    "__version__",
    "interception",
    "module_path",
]

"""The base of quantized layers with a weight (``brevitas.nn.quant_layer``).

:class:`QuantWBIOL` (Brevitas' ``QuantWeightBiasInputOutputLayer``) is the base
of :class:`~qtorchlike.nn.QuantLinear`, the convolutions and their transposes:
a weight, a bias and input/output quantizers.

Example:
    >>> import qtorchlike.nn as qnn
    >>> from qtorchlike.nn.quant_layer import QuantWBIOL
    >>> isinstance(qnn.QuantConv2d(1, 2, 3), QuantWBIOL)
    True
"""

from qtorchlike.nn._quant_layer import QuantWBIOL

__all__ = ["QuantWBIOL"]

"""Quantizer proxies: the modules a layer makes of its quantizers (``brevitas.proxy``).

A layer turns each quantizer class it is given into a proxy: a
:class:`WeightQuantProxy`, :class:`ActQuantProxy` or :class:`BiasQuantProxy`.
The proxy owns the learned scale (a parameter named ``value``) and the running
statistics (buffers), and its forward pass returns a
:class:`~qtorchlike.QuantTensor`; :func:`scale_threshold` reads a learned weight
scale back as a threshold.

Example:
    >>> import qtorchlike.nn as qnn
    >>> from qtorchlike.proxy import WeightQuantProxy, scale_threshold
    >>> layer = qnn.QuantLinear(3, 2)
    >>> isinstance(layer.weight_quant, WeightQuantProxy)
    True
"""

from qtorchlike._proxy import ActQuantProxy, BiasQuantProxy, WeightQuantProxy, scale_threshold

__all__ = ["ActQuantProxy", "BiasQuantProxy", "WeightQuantProxy", "scale_threshold"]

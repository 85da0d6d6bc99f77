"""Quantizer proxies: the modules a layer makes of its quantizers (``brevitas.proxy``).

A layer turns each quantizer class it is given into a proxy: a
:class:`WeightQuantProxy`, :class:`ActQuantProxy` or :class:`BiasQuantProxy`
(also under Brevitas' names, ``WeightQuantProxyFromInjector``...; a quantizer's
``proxy_class`` may name one of them or a subclass). A layer given no quantizer
holds a disabled proxy (``is_quant_enabled`` False). Proxies have Brevitas'
``scale()``, ``zero_point()`` and ``bit_width()``.
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

from qtorchlike._proxy import (
    ActQuantProxy,
    ActQuantProxyFromInjector,
    BiasQuantProxy,
    BiasQuantProxyFromInjector,
    WeightQuantProxy,
    WeightQuantProxyFromInjector,
    scale_threshold,
)

__all__ = [
    "ActQuantProxy",
    "ActQuantProxyFromInjector",
    "BiasQuantProxy",
    "BiasQuantProxyFromInjector",
    "WeightQuantProxy",
    "WeightQuantProxyFromInjector",
    "scale_threshold",
]

"""Layers and the module system: ``import qtorchlike.nn as qnn``, as with ``brevitas.nn``.

Quantized layers (``QuantLinear``, ``QuantConv2d``, ``QuantReLU``, ...) take
quantizer classes and prefixed overrides; plain blocks (``Sequential``,
``Flatten``, ``MaxPool2d``, ``Dropout``) mix in freely.
"""

from qtorchlike.nn.activation import (
    QuantHardTanh,
    QuantIdentity,
    QuantReLU,
    QuantSigmoid,
    QuantTanh,
)
from qtorchlike.nn.containers import (
    AvgPool2d,
    Dropout,
    Flatten,
    Identity,
    MaxPool2d,
    ModuleList,
    ReLU,
    Sequential,
)
from qtorchlike.nn.conv import QuantConv1d, QuantConv2d
from qtorchlike.nn.linear import QuantLinear
from qtorchlike.nn.module import IncompatibleKeys, Module, Parameter, RemovableHandle

__all__ = [
    "AvgPool2d",
    "Dropout",
    "Flatten",
    "Identity",
    "IncompatibleKeys",
    "MaxPool2d",
    "Module",
    "ModuleList",
    "Parameter",
    "QuantConv1d",
    "QuantConv2d",
    "QuantHardTanh",
    "QuantIdentity",
    "QuantLinear",
    "QuantReLU",
    "QuantSigmoid",
    "QuantTanh",
    "ReLU",
    "RemovableHandle",
    "Sequential",
]

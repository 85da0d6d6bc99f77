"""Layers and the module system: ``import qtorchlike.nn as qnn``, as with ``brevitas.nn``.

Quantized layers (``QuantLinear``, ``QuantConv2d``, ``QuantReLU``, ...) take
quantizer classes and prefixed overrides; plain blocks (``Sequential``,
``Flatten``, ``MaxPool2d``, ``Dropout``) mix in freely.
"""

from qtorchlike.nn._activation import (
    QuantHardTanh,
    QuantIdentity,
    QuantReLU,
    QuantSigmoid,
    QuantTanh,
)
from qtorchlike.nn._containers import (
    AvgPool2d,
    Dropout,
    Flatten,
    Identity,
    MaxPool2d,
    ModuleList,
    ReLU,
    Sequential,
)
from qtorchlike.nn._conv import QuantConv1d, QuantConv2d
from qtorchlike.nn._conv_transpose import QuantConvTranspose2d
from qtorchlike.nn._embedding import QuantEmbedding
from qtorchlike.nn._linear import QuantLinear
from qtorchlike.nn._merge import QuantCat, QuantEltwiseAdd
from qtorchlike.nn._pool import TruncAvgPool2d
from qtorchlike.nn._upsample import QuantUpsample, QuantUpsamplingNearest2d
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
    "QuantCat",
    "QuantConv1d",
    "QuantConv2d",
    "QuantConvTranspose2d",
    "QuantEltwiseAdd",
    "QuantEmbedding",
    "QuantHardTanh",
    "QuantIdentity",
    "QuantLinear",
    "QuantReLU",
    "QuantSigmoid",
    "QuantTanh",
    "QuantUpsample",
    "QuantUpsamplingNearest2d",
    "ReLU",
    "RemovableHandle",
    "Sequential",
    "TruncAvgPool2d",
]

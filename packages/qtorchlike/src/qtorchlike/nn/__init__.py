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
from qtorchlike.nn.conv_transpose import QuantConvTranspose2d
from qtorchlike.nn.embedding import QuantEmbedding
from qtorchlike.nn.linear import QuantLinear
from qtorchlike.nn.merge import QuantCat, QuantEltwiseAdd
from qtorchlike.nn.module import IncompatibleKeys, Module, Parameter, RemovableHandle
from qtorchlike.nn.pool import TruncAvgPool2d
from qtorchlike.nn.upsample import QuantUpsample, QuantUpsamplingNearest2d

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

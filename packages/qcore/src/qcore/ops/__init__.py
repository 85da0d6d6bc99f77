"""Quantized ops: JAX contractions, convolutions and table lookups that accept QArrays."""

from qcore.ops.conv import conv_general_dilated
from qcore.ops.dot import dot, matmul
from qcore.ops.dot_general import dot_general
from qcore.ops.einsum import einsum
from qcore.ops.ragged_dot import ragged_dot
from qcore.ops.take import take
from qcore.ops.training import (
    BackwardQuant,
    TrainingQuant,
    train_conv_general_dilated,
    train_dot_general,
    train_einsum,
    train_ragged_dot,
)

__all__ = [
    "BackwardQuant",
    "TrainingQuant",
    "conv_general_dilated",
    "dot",
    "dot_general",
    "einsum",
    "matmul",
    "ragged_dot",
    "take",
    "train_conv_general_dilated",
    "train_dot_general",
    "train_einsum",
    "train_ragged_dot",
]

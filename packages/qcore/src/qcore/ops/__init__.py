"""Quantized ops: JAX contractions and convolutions that accept QArrays."""

from qcore.ops.conv import conv_general_dilated
from qcore.ops.dot import dot, matmul
from qcore.ops.dot_general import dot_general
from qcore.ops.einsum import einsum
from qcore.ops.ragged_dot import ragged_dot

__all__ = ["conv_general_dilated", "dot", "dot_general", "einsum", "matmul", "ragged_dot"]

"""qtorchlike: a Brevitas-style eager, stateful quantization API on JAX, on qcore's numerics.

``import qtorchlike.nn as qnn`` gives quantized layers with PyTorch's
constructor signatures and layouts; :mod:`qtorchlike.quant` the quantizer
catalogue (classes that compose by inheritance, see :mod:`qtorchlike.inject`);
:class:`QuantTensor` the quantized values layers pass on;
:func:`qtorchlike.func.functional_call` and :func:`qtorchlike.func.train_step`
the bridge to ``jax.jit`` and ``jax.grad``; :mod:`qtorchlike.optim` SGD and Adam.
Depends on qcore (and jax, numpy) only.

Example:
    >>> import jax.numpy as jnp
    >>> import qtorchlike.nn as qnn
    >>> from qtorchlike.quant import Int8ActPerTensorFloat, Int8WeightPerChannelFloat
    >>> conv = qnn.QuantConv2d(
    ...     1,
    ...     4,
    ...     3,
    ...     weight_quant=Int8WeightPerChannelFloat,
    ...     input_quant=Int8ActPerTensorFloat,
    ...     return_quant_tensor=True,
    ... )
    >>> y = conv(jnp.ones((2, 1, 6, 6)))
    >>> y.value.shape, y.scale.shape
    ((2, 4, 4, 4), (1, 4, 1, 1))
"""

from qtorchlike import config, core, func, functional, inject, nn, optim, quant, random, solver
from qtorchlike.quant_tensor import QuantTensor
from qtorchlike.random import manual_seed

__version__ = "0.1.0"

__all__ = [
    "QuantTensor",
    "__version__",
    "config",
    "core",
    "func",
    "functional",
    "inject",
    "manual_seed",
    "nn",
    "optim",
    "quant",
    "random",
    "solver",
]

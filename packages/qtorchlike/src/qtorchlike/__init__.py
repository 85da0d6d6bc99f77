"""qtorchlike: a Brevitas-style eager, stateful quantization API on JAX, on qcore's numerics.

``import qtorchlike.nn as qnn`` gives quantized layers with PyTorch's
constructor signatures and layouts; :mod:`qtorchlike.quant` the quantizer
catalogue (classes that compose by inheritance, see :mod:`qtorchlike.inject`);
:class:`QuantTensor` the quantized values layers pass on;
:func:`qtorchlike.func.functional_call` and :func:`qtorchlike.func.train_step`
the bridge to ``jax.jit`` and ``jax.grad``; :mod:`qtorchlike.optim` SGD and Adam;
:func:`calibration_mode`, :func:`bias_correction_mode` and :func:`disable_quant`
post-training quantization (:mod:`qtorchlike.modes`); :func:`integer_state_dict`
and :func:`export_tflite` export (:mod:`qtorchlike.export`; LiteRT through the
optional qlitert, ``pip install "jaxquant-qtorchlike[litert]"``). Depends on qcore
(and jax, numpy) only.

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

# isort: off
# nn first: its layers import the proxies, which import nn.module.
from qtorchlike import nn

# isort: on
from qtorchlike import (
    config,
    core,
    export,
    func,
    functional,
    inject,
    modes,
    optim,
    quant,
    random,
    solver,
)
from qtorchlike.export import export_onnx, export_tflite, integer_state_dict
from qtorchlike.modes import bias_correction_mode, calibration_mode, disable_quant
from qtorchlike.quant_tensor import QuantTensor
from qtorchlike.random import manual_seed

__version__ = "0.1.0"

__all__ = [
    "QuantTensor",
    "__version__",
    "bias_correction_mode",
    "calibration_mode",
    "config",
    "core",
    "disable_quant",
    "export",
    "export_onnx",
    "export_tflite",
    "func",
    "functional",
    "inject",
    "integer_state_dict",
    "manual_seed",
    "modes",
    "nn",
    "optim",
    "quant",
    "random",
    "solver",
]

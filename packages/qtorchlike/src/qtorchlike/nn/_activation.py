"""Quantized activations: the function runs, then its ``act_quant`` quantizes the result.

Unprefixed keyword arguments override ``act_quant`` (``QuantReLU(bit_width=4)``),
``input_``-prefixed ones ``input_quant``, as in Brevitas. Defaults follow
Brevitas: unsigned uint8 after ReLU and sigmoid, signed int8 otherwise.

Example:
    >>> import jax.numpy as jnp
    >>> import qtorchlike.nn as qnn
    >>> relu = qnn.QuantReLU(bit_width=4, return_quant_tensor=True)
    >>> y = relu(jnp.linspace(-1.0, 1.0, 8))
    >>> y.signed, float(y.bit_width), bool((y.value >= 0).all())
    (False, 4.0, True)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qtorchlike._errors import MissingBoundsError, NoQuantTensorError
from qtorchlike._proxy import has_quant
from qtorchlike.nn._quant_layer import act_proxy, check_bool, check_input, split_kwargs
from qtorchlike.nn.module import Module
from qtorchlike.quant import (
    Int8ActPerTensorFloat,
    Int8ActPerTensorFloatMinMaxInit,
    Uint8ActPerTensorFloat,
)
from qtorchlike.quant_tensor import QuantTensor


class _QuantAct(Module):
    """Input quantizer (optional), activation function, activation quantizer."""

    default_act_quant: Any = None

    def __init__(
        self,
        act_quant: Any = "default",
        input_quant: Any = None,
        return_quant_tensor: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        groups = split_kwargs(name, kwargs, ("input_", ""))
        act_quant = self.default_act_quant if act_quant == "default" else act_quant
        self.input_quant = act_proxy(input_quant, groups["input_"], "input_quant", name)
        self.act_quant = act_proxy(act_quant, groups[""], "act_quant", name)
        self.return_quant_tensor = check_bool("return_quant_tensor", return_quant_tensor)

    def activation(self, x: jax.Array) -> jax.Array:
        """The float function (identity here)."""
        return x

    def forward(self, x: Any) -> Any:
        """Input quantizer, function, act quantizer; a QuantTensor or array as configured.

        Raises:
            TypeError: If ``x`` is neither a floating-point array nor a QuantTensor.
            ValueError: If a quantizer collecting statistics gets NaN or ±inf (see
                :meth:`qtorchlike._proxy.ActQuantProxy.forward`).
        """
        x = check_input(self, x)
        if has_quant(self.input_quant):
            x = self.input_quant(x)
        xv = x.value if isinstance(x, QuantTensor) else jnp.asarray(x)
        quantizing = self.act_quant.is_quant_enabled
        if not quantizing and self._passthrough and isinstance(x, QuantTensor):
            y: Any = x._like(self.activation(xv))  # keeps the input's grid (relu, identity)
        else:
            y = self.activation(xv)
            if has_quant(self.act_quant):
                y = self.act_quant(y)
        if self.return_quant_tensor:
            if not isinstance(y, QuantTensor):
                raise NoQuantTensorError(
                    f"{type(self).__name__}(return_quant_tensor=True) has no enabled act_quant "
                    "to produce a QuantTensor"
                )
            return y
        return y.value if isinstance(y, QuantTensor) else y

    _passthrough = True


class QuantIdentity(_QuantAct):
    """Quantizes its input (default ``Int8ActPerTensorFloat``)."""

    default_act_quant = Int8ActPerTensorFloat


class QuantReLU(_QuantAct):
    """ReLU, then ``Uint8ActPerTensorFloat`` by default."""

    default_act_quant = Uint8ActPerTensorFloat

    def activation(self, x: jax.Array) -> jax.Array:  # noqa: D102
        return jax.nn.relu(x)


class QuantSigmoid(_QuantAct):
    """Sigmoid, then ``Uint8ActPerTensorFloat`` by default."""

    default_act_quant = Uint8ActPerTensorFloat
    _passthrough = False

    def activation(self, x: jax.Array) -> jax.Array:  # noqa: D102
        return jax.nn.sigmoid(x)


class QuantTanh(_QuantAct):
    """Tanh, then ``Int8ActPerTensorFloat`` by default."""

    default_act_quant = Int8ActPerTensorFloat
    _passthrough = False

    def activation(self, x: jax.Array) -> jax.Array:  # noqa: D102
        return jnp.tanh(x)


class QuantHardTanh(_QuantAct):
    """Clamp to ``[min_val, max_val]``, quantized with a learned scale starting at ``max|bound|``.

    ``min_val`` and ``max_val`` are required (they initialise the default
    ``Int8ActPerTensorFloatMinMaxInit``). While the quantizer is enabled its own
    clamp does the clipping, so the learned scale can move the range (Brevitas'
    behaviour); disabled, the layer is a plain hardtanh.
    """

    default_act_quant = Int8ActPerTensorFloatMinMaxInit

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "min_val" not in kwargs or "max_val" not in kwargs:
            raise MissingBoundsError("QuantHardTanh needs min_val= and max_val= (the clamp bounds)")
        try:
            bounds = (float(kwargs["min_val"]), float(kwargs["max_val"]))
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"QuantHardTanh(min_val={kwargs['min_val']!r}, max_val={kwargs['max_val']!r}): "
                "the bounds must be numbers"
            ) from e
        if not bounds[0] < bounds[1]:
            raise ValueError(f"min_val={bounds[0]} must be < max_val={bounds[1]}")
        super().__init__(*args, **kwargs)
        self._bounds = bounds

    def activation(self, x: jax.Array) -> jax.Array:  # noqa: D102
        if self.act_quant.is_quant_enabled:
            return x
        return jnp.clip(x, *self._bounds)

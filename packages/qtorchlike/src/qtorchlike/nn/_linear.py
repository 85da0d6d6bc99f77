"""``QuantLinear``: ``y = x @ W.T + b`` with quantized input, weight, bias and output."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import qcore
from qtorchlike.nn._quant_layer import QuantWBIOL, check_positive_ints, spec_of
from qtorchlike.quant import Int8WeightPerTensorFloat
from qtorchlike.quant_tensor import QuantTensor


def qarray_of(q: QuantTensor, qtype: str, ndim: int) -> qcore.QArray:
    """The QArray holding ``q``'s codes (re-encoded exactly: values lie on the grid)."""
    scale = q.scale.reshape((1,) * (ndim - q.scale.ndim) + q.scale.shape)
    return qcore.quantize_with_scale_zero_point(q.value, qtype, scale)


class QuantLinear(QuantWBIOL):
    """A fully connected layer with PyTorch's layout: weight ``(out_features, in_features)``.

    Args:
        in_features: Input size.
        out_features: Output size.
        bias: Add a learned bias.
        weight_quant: Weight quantizer (default ``Int8WeightPerTensorFloat``).
        bias_quant: Bias quantizer (default None: float bias).
        input_quant: Input quantizer (default None).
        output_quant: Output quantizer (default None).
        return_quant_tensor: Return a QuantTensor instead of its value.
        key: PRNG key for the initial weights (default: the global seed).
        **kwargs: Prefixed quantizer overrides (``weight_bit_width=4``, ...).

    Example:
        >>> import jax.numpy as jnp
        >>> import qtorchlike.nn as qnn
        >>> from qtorchlike.quant import Int8ActPerTensorFloat, Int8WeightPerChannelFloat
        >>> layer = qnn.QuantLinear(
        ...     4,
        ...     3,
        ...     weight_quant=Int8WeightPerChannelFloat,
        ...     weight_bit_width=4,
        ...     input_quant=Int8ActPerTensorFloat,
        ...     return_quant_tensor=True,
        ... )
        >>> y = layer(jnp.ones((2, 4)))
        >>> y.scale.shape, int(layer.quant_weight().int().max()) <= 7
        ((1, 3), True)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        weight_quant: Any = Int8WeightPerTensorFloat,
        bias_quant: Any = None,
        input_quant: Any = None,
        output_quant: Any = None,
        return_quant_tensor: bool = False,
        *,
        key: jax.Array | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        check_positive_ints(in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self._init_params((out_features, in_features), in_features, out_features, bias, key)
        self._init_quant(
            weight_quant, bias_quant, input_quant, output_quant, return_quant_tensor, kwargs
        )

    _out_channel_dim = -1

    def _check_shape(self, x: Any) -> None:
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"QuantLinear expects input of shape (..., {self.in_features}) "
                f"(in_features={self.in_features}), got {tuple(x.shape)}"
            )

    def _float_op(self, x: Any, w: Any) -> Any:
        return jnp.matmul(x, w.T)

    def _int_op(self, x: QuantTensor, w: QuantTensor) -> Any:
        xa = qarray_of(x, spec_of(self.input_quant).qtype, x.ndim)
        wa = qarray_of(w, spec_of(self.weight_quant).qtype, 2)
        dims = (((x.ndim - 1,), (1,)), ((), ()))
        return qcore.dot_general(xa, wa, dims)

    def extra_repr(self) -> str:  # noqa: D102
        return f"in_features={self.in_features}, out_features={self.out_features}"

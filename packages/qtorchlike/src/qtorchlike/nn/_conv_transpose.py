"""``QuantConvTranspose2d``: PyTorch's transposed convolution, weight ``(in, out/groups, kH, kW)``.

The output size per spatial axis is PyTorch's
``(H - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1``.
The computation is a direct convolution of the stride-dilated input with the
spatially flipped kernel (``lax.conv_general_dilated`` with ``lhs_dilation``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qtorchlike.nn._conv import check_channels, ints
from qtorchlike.nn._quant_layer import QuantWBIOL, acc_bit_width
from qtorchlike.quant import Int8WeightPerTensorFloat
from qtorchlike.quant_tensor import QuantTensor


class QuantConvTranspose2d(QuantWBIOL):
    """A 2-D transposed convolution on NCHW inputs, with quantized weight, bias, input, output.

    Arguments and weight layout ``(in_channels, out_channels // groups, kH, kW)``
    are PyTorch's ``ConvTranspose2d``; the quantizer arguments are those of
    :class:`~qtorchlike.nn.QuantLinear`. The weight's output-channel axis is 1,
    so per-channel weight scales have shape ``(1, out_channels // groups, 1, 1)``
    (with ``groups > 1`` one scale serves the same position in every group, and
    the output is then a plain array rather than a per-channel QuantTensor).

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        kernel_size: Kernel size (int or pair).
        stride: Stride of the transposed convolution (the input's dilation).
        padding: Zero padding removed from both sides of the output (``dilation * (k - 1) -
            padding`` is added around the dilated input).
        output_padding: Extra size added to one side of the output; each entry must be
            smaller than the stride or the dilation.
        groups: Blocked connections from input to output channels; divides both counts.
        bias: Add a learned bias.
        dilation: Spacing between kernel elements.
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
        >>> up = qnn.QuantConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1)
        >>> up(jnp.ones((1, 4, 5, 5))).shape
        (1, 2, 10, 10)
        >>> up.weight.shape
        (4, 2, 3, 3)
    """

    _channel_axis = 1
    _input_axis = 0
    _dims = 2

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        output_padding: int | Sequence[int] = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: int | Sequence[int] = 1,
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
        n = self._dims
        check_channels(in_channels, out_channels, groups)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = ints(kernel_size, n, "kernel_size", 1)
        self.stride = ints(stride, n, "stride", 1)
        self.padding = ints(padding, n, "padding", 0)
        self.output_padding = ints(output_padding, n, "output_padding", 0)
        self.dilation = ints(dilation, n, "dilation", 1)
        for op, s, d in zip(self.output_padding, self.stride, self.dilation, strict=True):
            if op >= s and op >= d:
                raise ValueError(
                    f"output_padding={output_padding!r} must be smaller than the stride "
                    f"({stride!r}) or the dilation ({dilation!r}) in each dimension"
                )
        shape = (in_channels, out_channels // groups, *self.kernel_size)
        fan = shape[1] * math.prod(self.kernel_size)  # PyTorch's fan-in for this layout
        self._init_params(shape, fan, out_channels, bias, key)
        self._init_quant(
            weight_quant, bias_quant, input_quant, output_quant, return_quant_tensor, kwargs
        )

    def output_size(self, input_size: Sequence[int]) -> tuple[int, ...]:
        """The spatial output size for a spatial input size (PyTorch's formula).

        Args:
            input_size: The input's spatial size ``(H, W)``.

        Returns:
            ``(H_out, W_out)``.
        """
        return tuple(
            (i - 1) * s - 2 * p + d * (k - 1) + op + 1
            for i, s, p, d, k, op in zip(
                input_size,
                self.stride,
                self.padding,
                self.dilation,
                self.kernel_size,
                self.output_padding,
                strict=True,
            )
        )

    def _check_shape(self, x: Any) -> None:
        if x.ndim != self._dims + 2 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__} expects input of shape (N, {self.in_channels}, H, W) "
                f"(channels first), got {tuple(x.shape)}"
            )
        out = self.output_size(x.shape[2:])
        if any(o < 1 for o in out):
            raise ValueError(
                f"{type(self).__name__}: input of spatial size {tuple(x.shape[2:])} gives an "
                f"empty output {out} with padding={self.padding}; use less padding"
            )

    def _float_op(self, x: Any, w: Any) -> Any:
        g = self.groups
        cin, cout_g, *ks = w.shape
        # (in, out/g, k...) -> (g, in/g, out/g, k...) -> (out, in/g, k...), flipped in space.
        w = w.reshape(g, cin // g, cout_g, *ks)
        w = jnp.swapaxes(w, 1, 2).reshape(g * cout_g, cin // g, *ks)
        w = jnp.flip(w, axis=tuple(range(2, 2 + self._dims)))
        pads = [
            (d * (k - 1) - p, d * (k - 1) - p + op)
            for k, p, d, op in zip(
                self.kernel_size, self.padding, self.dilation, self.output_padding, strict=True
            )
        ]
        return lax.conv_general_dilated(
            x,
            w.astype(x.dtype),
            window_strides=(1,) * self._dims,
            padding=pads,
            lhs_dilation=self.stride,
            rhs_dilation=self.dilation,
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
            feature_group_count=g,
        )

    def acc_fan_in(self) -> int:
        """Most products summed into one output: ``in/groups`` times the overlapping taps.

        Along each axis, the kernel taps that reach one output position are those
        ``j`` with ``j * dilation`` in one residue class modulo ``stride``: at most
        ``ceil(k / (stride / gcd(stride, dilation)))`` of them.
        """
        taps = math.prod(
            -(-k // (s // math.gcd(s, d)))
            for k, s, d in zip(self.kernel_size, self.stride, self.dilation, strict=True)
        )
        return (self.in_channels // self.groups) * taps

    def forward(self, x: Any) -> Any:
        """Quantizes input and weight, convolves, adds the bias, quantizes the output.

        Args:
            x: NCHW input (array or QuantTensor).

        Returns:
            A QuantTensor or an array, as :class:`~qtorchlike.nn.QuantLinear` does.
        """
        y = super().forward(x)
        if isinstance(y, QuantTensor) and (not self.output_quant.is_quant_enabled):
            # The accumulator grid came from QuantWBIOL, whose bit width assumes a direct
            # convolution's fan-in (weight axis 1 times the kernel); recompute it for the
            # transposed layout.
            y = y._like(y.value, bit_width=self._acc_bits(x, y.bit_width))
        return y

    def _acc_bits(self, x: Any, fallback: Any) -> Any:
        iq, wq, bq = self.input_quant, self.weight_quant, self.bias_quant
        if iq is not None and iq.enabled:
            in_bits: Any = float(iq.spec.bit_width)
        elif isinstance(x, QuantTensor):
            in_bits = x.bit_width
        else:
            return fallback
        if wq is None or not wq.enabled:
            return fallback
        bits = acc_bit_width(in_bits, float(wq.spec.bit_width), self.acc_fan_in())
        if self.bias is not None and bq is not None and bq.enabled and bq.spec.requires_input_scale:
            bits = jnp.maximum(bits, float(bq.spec.bit_width)) + 1
        return bits

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, "
            f"output_padding={self.output_padding}, groups={self.groups}"
        )

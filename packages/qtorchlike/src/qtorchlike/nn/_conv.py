"""``QuantConv1d``, ``QuantConv2d``: PyTorch's layouts, NC[H]W and weight (out, in/groups, k...)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax import lax

import qcore
from qtorchlike.nn._linear import qarray_of
from qtorchlike.nn._quant_layer import QuantWBIOL, check_positive_ints, spec_of
from qtorchlike.quant import Int8WeightPerTensorFloat
from qtorchlike.quant_tensor import QuantTensor


def ints(v: Any, n: int, name: str, minimum: int) -> tuple[int, ...]:
    """A PyTorch size argument (an int or ``n`` ints, each ``>= minimum``) as a tuple."""
    out: tuple = ()
    if isinstance(v, int) and not isinstance(v, bool):
        out = (v,) * n
    elif isinstance(v, Sequence) and not isinstance(v, str):
        out = tuple(v)
    if len(out) != n or any(isinstance(i, bool) or not isinstance(i, int) for i in out):
        raise ValueError(f"{name}={v!r} must be an int or a tuple of {n} ints")
    if any(i < minimum for i in out):
        raise ValueError(f"{name}={v!r}: every entry must be >= {minimum}")
    return out


def check_channels(in_channels: Any, out_channels: Any, groups: Any) -> None:
    """Channel counts and groups are positive ints, and groups divides both counts."""
    check_positive_ints(in_channels=in_channels, out_channels=out_channels, groups=groups)
    if in_channels % groups or out_channels % groups:
        raise ValueError(
            f"groups={groups} must divide in_channels={in_channels} and out_channels={out_channels}"
        )


def check_nc(layer: Any, x: Any, channels: int) -> None:
    """Raises ValueError unless ``x`` is ``(N, channels, *spatial)`` for ``layer``'s rank."""
    dims = layer._dims
    if x.ndim != dims + 2 or x.shape[1] != channels:
        raise ValueError(
            f"{type(layer).__name__} expects input of shape (N, {channels}, "
            f"{', '.join('L' * dims)}) (channels first), got {tuple(x.shape)}"
        )


def conv_padding(padding: Any, n: int) -> str | list[tuple[int, int]]:
    """PyTorch padding (int, tuple, 'same', 'valid') as lax padding."""
    if isinstance(padding, str):
        if padding.lower() not in ("same", "valid"):
            raise ValueError(f"padding={padding!r}; allowed: an int, a tuple, 'same', 'valid'")
        return padding.upper()
    return [(p, p) for p in ints(padding, n, "padding", 0)]


class _QuantConvNd(QuantWBIOL):
    _dims: int = 2
    _layout: tuple[str, str, str] = ("NCHW", "OIHW", "NCHW")

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: Any = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
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
        n = self._dims
        check_channels(in_channels, out_channels, groups)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = ints(kernel_size, n, "kernel_size", 1)
        self.stride = ints(stride, n, "stride", 1)
        self.dilation = ints(dilation, n, "dilation", 1)
        self.padding = padding
        self._padding = conv_padding(padding, n)
        shape = (out_channels, in_channels // groups, *self.kernel_size)
        fan = shape[1] * math.prod(self.kernel_size)
        self._init_params(shape, fan, out_channels, bias, key)
        self._init_quant(
            weight_quant, bias_quant, input_quant, output_quant, return_quant_tensor, kwargs
        )

    def _check_shape(self, x: Any) -> None:
        check_nc(self, x, self.in_channels)
        if isinstance(self._padding, str):
            return
        spatial = x.shape[2:]
        pads = [lo + hi for lo, hi in self._padding]
        reach = [d * (k - 1) + 1 for d, k in zip(self.dilation, self.kernel_size, strict=True)]
        if any(n + p < r for n, p, r in zip(spatial, pads, reach, strict=True)):
            raise ValueError(
                f"{type(self).__name__}: input of shape {tuple(x.shape)} is smaller than "
                f"kernel_size={self.kernel_size} (dilation={self.dilation}, padding="
                f"{self.padding!r}); allowed: spatial sizes + padding >= {tuple(reach)}"
            )

    def _conv(self, conv: Any, x: Any, w: Any) -> Any:
        return conv(
            x,
            w,
            self.stride,
            self._padding,
            rhs_dilation=self.dilation,
            dimension_numbers=self._layout,
            feature_group_count=self.groups,
        )

    def _float_op(self, x: Any, w: Any) -> Any:
        return self._conv(lax.conv_general_dilated, x, w)

    def _int_op(self, x: QuantTensor, w: QuantTensor) -> Any:
        xa = qarray_of(x, spec_of(self.input_quant).qtype, x.ndim)
        wa = qarray_of(w, spec_of(self.weight_quant).qtype, w.ndim)
        return self._conv(qcore.conv_general_dilated, xa, wa)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}"
        )


class QuantConv2d(_QuantConvNd):
    """A 2-D convolution on NCHW inputs with weight ``(out, in/groups, kH, kW)``.

    Arguments are PyTorch's (``in_channels, out_channels, kernel_size, stride,
    padding, dilation, groups, bias``) plus the quantizers of
    :class:`~qtorchlike.nn.QuantLinear`.

    Example:
        >>> import jax.numpy as jnp
        >>> import qtorchlike.nn as qnn
        >>> conv = qnn.QuantConv2d(3, 8, 3, padding=1, weight_bit_width=4)
        >>> conv(jnp.ones((1, 3, 8, 8))).shape
        (1, 8, 8, 8)
    """


class QuantConv1d(_QuantConvNd):
    """A 1-D convolution on NCL inputs with weight ``(out, in/groups, k)``."""

    _dims = 1
    _layout = ("NCH", "OIH", "NCH")

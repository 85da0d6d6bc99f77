"""Nearest-neighbour upsampling that keeps a QuantTensor on its grid.

Nearest upsampling copies values, so a QuantTensor stays a valid QuantTensor
with the same scale, zero point and bit width. Other modes (bilinear, ...)
create values between the codes and are not provided.
"""

from __future__ import annotations

from typing import Any

from qtorchlike import functional as F
from qtorchlike.nn.module import Module
from qtorchlike.quant_tensor import QuantTensor

_MODES = ("nearest",)


def _size_arg(v: Any, name: str) -> int | tuple[int, ...] | None:
    if v is None:
        return None
    seq = isinstance(v, tuple | list)
    raw = list(v) if seq else [v]
    ok = not seq or len(raw) == 2
    items: list[int] = []
    for i in raw:
        if isinstance(i, float) and i.is_integer():
            i = int(i)
        if isinstance(i, bool) or not isinstance(i, int) or i < 1:
            ok = False
            break
        items.append(i)
    if not ok:
        raise ValueError(
            f"{name}={v!r} must be a positive int or a pair of them (nearest upsampling by "
            "integer factors, or to a size)"
        )
    return tuple(items) if seq else items[0]


class QuantUpsample(Module):
    """Upsamples NCHW input by nearest neighbour; a QuantTensor input stays a QuantTensor.

    Give exactly one of ``size`` and ``scale_factor``. A plain array input gives
    a plain array.

    Args:
        size: Output spatial size ``(H, W)`` (int or pair).
        scale_factor: Integer upsampling factor (int or pair).
        mode: Only ``"nearest"``.
        return_quant_tensor: Return a QuantTensor for QuantTensor input (else its value).

    Example:
        >>> import jax.numpy as jnp
        >>> import qtorchlike.nn as qnn
        >>> from qtorchlike import QuantTensor
        >>> x = QuantTensor(
        ...     jnp.ones((1, 1, 2, 2)), jnp.array(0.5), jnp.array(0.0), 8.0, True, False
        ... )
        >>> y = qnn.QuantUpsample(scale_factor=2)(x)
        >>> y.shape, y.is_valid, float(y.scale)
        ((1, 1, 4, 4), True, 0.5)
    """

    def __init__(
        self,
        size: Any = None,
        scale_factor: Any = None,
        mode: str = "nearest",
        return_quant_tensor: bool = True,
    ) -> None:
        super().__init__()
        if mode not in _MODES:
            raise ValueError(
                f"mode={mode!r} is not supported; allowed: {_MODES} (only nearest upsampling "
                "keeps values on the quantization grid)"
            )
        if (size is None) == (scale_factor is None):
            raise ValueError(
                f"give exactly one of size= and scale_factor= (got size={size!r}, "
                f"scale_factor={scale_factor!r})"
            )
        self.size = _size_arg(size, "size")
        self.scale_factor = _size_arg(scale_factor, "scale_factor")
        self.mode = mode
        self.return_quant_tensor = bool(return_quant_tensor)

    def forward(self, x: Any) -> Any:
        """Upsamples ``x`` (NCHW array or QuantTensor).

        Args:
            x: The input.

        Returns:
            A QuantTensor for a per-tensor QuantTensor input with
            ``return_quant_tensor``, else an array.
        """
        y = F.interpolate(x, scale_factor=self.scale_factor, size=self.size)
        if isinstance(y, QuantTensor) and not self.return_quant_tensor:
            return y.value
        return y

    def extra_repr(self) -> str:  # noqa: D102
        what = f"size={self.size}" if self.size is not None else f"scale_factor={self.scale_factor}"
        return f"{what}, mode={self.mode!r}"


class QuantUpsamplingNearest2d(QuantUpsample):
    """:class:`QuantUpsample` with ``mode="nearest"`` (PyTorch's ``UpsamplingNearest2d``).

    Args:
        size: Output spatial size ``(H, W)`` (int or pair).
        scale_factor: Integer upsampling factor (int or pair).
        return_quant_tensor: Return a QuantTensor for QuantTensor input (else its value).

    Example:
        >>> import jax.numpy as jnp
        >>> import qtorchlike.nn as qnn
        >>> qnn.QuantUpsamplingNearest2d(size=(4, 6))(jnp.ones((1, 3, 2, 3))).shape
        (1, 3, 4, 6)
    """

    def __init__(
        self, size: Any = None, scale_factor: Any = None, return_quant_tensor: bool = True
    ) -> None:
        super().__init__(size, scale_factor, "nearest", return_quant_tensor)

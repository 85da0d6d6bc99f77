"""``TruncAvgPool2d``: integer average pooling, the window sum truncated to a bit width.

On a QuantTensor with codes ``q`` (scale ``s``, ``b`` bits) a ``k1 x k2``
window (``n = k1 k2`` elements) sums to codes with scale ``s / n`` and
``b_acc = ceil(log2((2^b - 1) n))`` bits (:func:`qtorchlike.functional.avg_pool2d`).
Keeping the ``bit_width`` most significant bits divides the codes by
``2^(b_acc - bit_width)``, rounds and clamps: the output scale is
``s / n * 2^(b_acc - bit_width)``. Only power-of-two windows keep the input scale
(2x2 over 8 bits: ``b_acc = 10``, shift 4, scale ``s``; 3x3: shift 16, scale ``16 s / 9``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qcore import numerics
from qtorchlike import functional as F
from qtorchlike.nn.module import Module
from qtorchlike.quant_tensor import QuantTensor

_ROUNDING = ("round", "floor")


def _pair(v: Any, name: str) -> tuple[int, int]:
    out = (v, v) if isinstance(v, int) else tuple(v) if isinstance(v, tuple | list) else ()
    if len(out) != 2 or any(isinstance(i, bool) or not isinstance(i, int) or i < 1 for i in out):
        raise ValueError(f"{name}={v!r} must be a positive int or a pair of them")
    return out  # type: ignore[return-value]


def _ste(fn: Any, x: jax.Array) -> jax.Array:
    """``fn(x)`` forward, identity gradient."""
    return x + jax.lax.stop_gradient(fn(x) - x)


class TruncAvgPool2d(Module):
    """Average pooling over NCHW input that keeps integer codes of ``bit_width`` bits.

    A per-tensor QuantTensor input gives a QuantTensor with ``bit_width`` bits
    (sign as the input's); a plain array (or a QuantTensor with per-channel
    scales) gives plain average pooling. Rounding has a straight-through gradient.

    Args:
        kernel_size: Window size (int or pair).
        stride: Window step (default: the kernel size).
        bit_width: Bits of the output codes.
        float_to_int_impl_type: ``"round"`` (half to even) or ``"floor"`` for the
            truncated bits (Brevitas' ``RoundTo8bit`` and ``TruncTo8bit``).
        return_quant_tensor: Return a QuantTensor instead of its value.

    Example:
        >>> import jax.numpy as jnp
        >>> import qtorchlike.nn as qnn
        >>> from qtorchlike import QuantTensor
        >>> s = jnp.array(0.1)
        >>> codes = jnp.arange(9.0).reshape(1, 1, 3, 3)
        >>> x = QuantTensor(codes * s, s, jnp.array(0.0), 8.0, False, False)
        >>> y = qnn.TruncAvgPool2d(3)(x)
        >>> y.int().ravel().tolist()  # window sum 36, 12 bits; 36 / 2^(12 - 8) = 2.25
        [2]
        >>> round(float(y.scale / s), 4)  # 16 / 9
        1.7778
    """

    def __init__(
        self,
        kernel_size: Any,
        stride: Any = None,
        bit_width: int = 8,
        float_to_int_impl_type: str = "round",
        return_quant_tensor: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(bit_width, bool) or not isinstance(bit_width, int) or bit_width < 1:
            raise ValueError(f"bit_width={bit_width!r} must be a positive int (e.g. 8)")
        rounding = str(getattr(float_to_int_impl_type, "value", float_to_int_impl_type)).lower()
        if rounding not in _ROUNDING:
            raise ValueError(
                f"float_to_int_impl_type={float_to_int_impl_type!r} is not supported; "
                f"allowed: {_ROUNDING}"
            )
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else _pair(stride, "stride")
        self.bit_width = bit_width
        self.float_to_int_impl_type = rounding
        self.return_quant_tensor = bool(return_quant_tensor)

    def _to_int(self, x: jax.Array) -> jax.Array:
        if self.float_to_int_impl_type == "floor":
            return _ste(jnp.floor, x)
        return _ste(numerics.round_values, x)

    def forward(self, x: Any) -> Any:
        """Pools; a per-tensor QuantTensor input is truncated to ``bit_width`` bits.

        Args:
            x: NCHW input (array or QuantTensor).

        Returns:
            A QuantTensor (when the input is a per-tensor QuantTensor and
            ``return_quant_tensor``) or an array.

        Raises:
            ValueError: If the input QuantTensor's sign is unknown (``signed=None``).
        """
        acc = F.avg_pool2d(x, self.kernel_size, self.stride)
        if not isinstance(acc, QuantTensor):
            return acc
        if acc.signed is None:
            raise ValueError(
                "TruncAvgPool2d: the input QuantTensor has signed=None, so the output range "
                "is unknown; give its quantizer signed=True or signed=False"
            )
        b = self.bit_width
        trunc = jnp.exp2(jnp.maximum(acc.bit_width - b, 0.0))
        codes = _ste(jnp.round, acc.value / acc.scale + acc.zero_point)
        lo, hi = (-(2.0 ** (b - 1)), 2.0 ** (b - 1) - 1) if acc.signed else (0.0, 2.0**b - 1)
        out_codes = jnp.clip(self._to_int(codes / trunc), lo, hi)
        scale, zero_point = acc.scale * trunc, acc.zero_point / trunc
        y = QuantTensor(
            (out_codes - zero_point) * scale, scale, zero_point, float(b), acc.signed, acc.training
        )
        return y if self.return_quant_tensor else y.value

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"kernel_size={self.kernel_size}, stride={self.stride}, bit_width={self.bit_width}, "
            f"float_to_int_impl_type={self.float_to_int_impl_type!r}"
        )

"""``QuantTensor``: a dequantized value that carries its scale, zero point and bit width.

A QuantTensor is a JAX pytree, so it passes through ``jax.jit`` and
``jax.grad``. ``value`` holds the dequantized numbers (what float code
computes with); ``int()`` recovers the integer codes
``round(value / scale + zero_point)``.

Arithmetic follows Brevitas' rules:

* ``a + b`` of two QuantTensors needs equal scales and zero points in eval mode
  (integer hardware adds codes on one grid); the result has
  ``max(bit_width) + 1`` bits. In training mode different scales are allowed and
  the result takes their mean, since the value itself stays exact.
* ``a * b`` of two QuantTensors with zero zero-points multiplies scales and adds
  bit widths.
* Anything else (adding a plain array, dividing...) gives a plain array.

Example:
    >>> import jax.numpy as jnp
    >>> from qtorchlike import QuantTensor
    >>> s = jnp.array(0.5)
    >>> a = QuantTensor(jnp.array([1.0, -0.5]), s, jnp.array(0.0), jnp.array(8.0), True, False)
    >>> a.int()
    Array([ 2, -1], dtype=int8)
    >>> (a + a).bit_width
    Array(9., dtype=float32)
    >>> a + QuantTensor(
    ...     jnp.array([1.0]), jnp.array(0.25), jnp.array(0.0), jnp.array(8.0), True, False
    ... )
    Traceback (most recent call last):
    ...
    ValueError: cannot add QuantTensors with different scales (0.5 and 0.25) in eval mode: ...
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer


def _concrete(*xs: Any) -> bool:
    return not any(isinstance(x, Tracer) for x in xs)


@jax.tree_util.register_pytree_node_class
class QuantTensor:
    """A quantized tensor in dequantized form.

    Args:
        value: Dequantized values ``(codes - zero_point) * scale``.
        scale: Scale, broadcastable against ``value``.
        zero_point: Zero point, broadcastable against ``value``.
        bit_width: Bits per code (a scalar array; sums grow it).
        signed: Whether the codes are signed (None: unknown, which makes the
            tensor invalid, as Brevitas treats a binary quantizer without ``signed``).
        training: Whether it was produced in training mode.

    Raises:
        TypeError: A value, scale or zero point that is not an array of numbers, a
            bit width that is not a number, ``signed`` not a bool or None,
            ``training`` not a bool.
        ValueError: A scale or zero point that does not broadcast to the value's
            shape, a bit width that is not a scalar integer >= 1, or (when concrete)
            a scale that is <= 0 or infinite. A NaN scale is allowed: it marks a
            block that held a non-finite value (see "NaN and inf" in the docs).
    """

    __slots__ = ("value", "scale", "zero_point", "bit_width", "signed", "training")

    def __init__(
        self,
        value: Any,
        scale: Any,
        zero_point: Any,
        bit_width: Any,
        signed: bool | None,
        training: bool,
    ) -> None:
        self.value = _array("value", value)
        self.scale = _array("scale", scale)
        self.zero_point = _array("zero_point", zero_point)
        for name, a in (("scale", self.scale), ("zero_point", self.zero_point)):
            if a.size != 1 and not _broadcasts(a.shape, self.value.shape):
                raise ValueError(
                    f"QuantTensor: {name} of shape {a.shape} does not broadcast to the value's "
                    f"shape {self.value.shape}; allowed: a single value, or a shape of at most "
                    "the value's rank whose dims divide the value's (one per block)"
                )
        if not _is_number(bit_width):
            raise TypeError(f"QuantTensor(bit_width={bit_width!r}): bit_width must be a number")
        self.bit_width = jnp.asarray(bit_width, jnp.float32)
        if self.bit_width.shape != ():
            raise ValueError(
                f"QuantTensor: bit_width of shape {self.bit_width.shape} must be a scalar"
            )
        if _concrete(self.bit_width):
            bits = float(self.bit_width)
            if not (bits >= 1 and bits == int(bits)):
                raise ValueError(f"QuantTensor(bit_width={bits:g}): must be an integer >= 1")
        s = np.asarray(self.scale, np.float64) if _concrete(self.scale) else np.ones(())
        if np.any((s <= 0) | np.isinf(s)):  # NaN passes: a poisoned block
            raise ValueError(
                f"QuantTensor: scale {_show(self.scale)} is not allowed; allowed: scales > 0 "
                "and finite (NaN marks a block that held NaN or inf)"
            )
        if signed is not None and not isinstance(signed, bool | np.bool_):
            raise TypeError(f"QuantTensor(signed={signed!r}): must be True, False or None")
        if not isinstance(training, bool | np.bool_):
            raise TypeError(f"QuantTensor(training={training!r}): must be True or False")
        self.signed = None if signed is None else bool(signed)
        self.training = bool(training)

    # -- pytree ------------------------------------------------------------------------

    def tree_flatten(self):  # noqa: D102 - pytree protocol
        return (self.value, self.scale, self.zero_point, self.bit_width), (
            self.signed,
            self.training,
        )

    @classmethod
    def tree_unflatten(cls, aux, children):  # noqa: D102 - pytree protocol
        obj = object.__new__(cls)
        obj.value, obj.scale, obj.zero_point, obj.bit_width = children
        obj.signed, obj.training = aux
        return obj

    def _like(self, value: Any, **kw: Any) -> QuantTensor:
        fields = {
            "scale": self.scale,
            "zero_point": self.zero_point,
            "bit_width": self.bit_width,
            "signed": self.signed,
            "training": self.training,
        }
        fields.update(kw)
        return type(self)(value, **fields)  # a subclass (ShiftedQuantTensor) keeps its type

    # -- array-like --------------------------------------------------------------------

    def __jax_array__(self) -> jax.Array:
        """The value, so ``jnp`` functions take a QuantTensor (``jnp.tanh(qt)``), as torch's do."""
        return self.value

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the value."""
        return tuple(self.value.shape)

    @property
    def ndim(self) -> int:
        """Rank of the value."""
        return self.value.ndim

    @property
    def dtype(self) -> Any:
        """Dtype of the value."""
        return self.value.dtype

    @property
    def is_per_tensor(self) -> bool:
        """Whether one scale and zero point cover the whole tensor."""
        return self.scale.size == 1 and self.zero_point.size == 1

    def __repr__(self) -> str:
        return (
            f"QuantTensor(value={self.value!r}, scale={self.scale!r}, "
            f"zero_point={self.zero_point!r}, bit_width={self.bit_width!r}, "
            f"signed={self.signed}, training={self.training})"
        )

    # -- integer view ------------------------------------------------------------------

    def _codes(self) -> jax.Array:
        n = self.value.ndim
        return self.value / _lift(self.scale, n) + _lift(self.zero_point, n)

    def _bounds(self) -> tuple[float, float]:
        bits = float(self.bit_width)
        if self.signed:
            return -(2.0 ** (bits - 1)), 2.0 ** (bits - 1) - 1
        return 0.0, 2.0**bits - 1

    @property
    def is_valid(self) -> bool:
        """Whether ``value / scale + zero_point`` are integers within the bit width's range.

        Raises:
            TypeError: Under tracing (``jax.jit``), where values are not known.
        """
        if not _concrete(self.value, self.scale, self.zero_point, self.bit_width):
            raise TypeError("QuantTensor.is_valid needs concrete values; call it outside jax.jit")
        codes = np.asarray(self._codes(), np.float64)
        rounded = np.round(codes)
        # Brevitas' tolerance for float32 values (0.1 for float64).
        on_grid = np.all(np.abs(codes - rounded) <= 0.2)
        if float(self.bit_width) == 1 and self.signed:  # binary: codes are exactly ±1
            in_range = np.all(np.abs(rounded) == 1)
        else:
            lo, hi = self._bounds()
            in_range = np.all((rounded >= lo) & (rounded <= hi))
        known = self.signed is not None
        return bool(known and on_grid and in_range and np.all(np.asarray(self.scale) > 0))

    def int(self, float_datatype: bool = False) -> jax.Array:
        """The integer codes ``round(value / scale + zero_point)``.

        Args:
            float_datatype: Return them as float32 instead of an integer dtype.

        Returns:
            int8 codes (uint8 when unsigned) up to 8 bits, int32 beyond, or
            float32 codes.

        Raises:
            ValueError: If the tensor is not valid (values off the integer grid or
                out of range): e.g. a float value wrapped by hand.
        """
        if _concrete(self.value, self.scale, self.zero_point, self.bit_width) and not self.is_valid:
            if self.signed is None:
                raise ValueError(
                    "QuantTensor.int(): the tensor's signedness is unknown (signed=None), so "
                    "it is not valid; give its quantizer signed=True (e.g. weight_signed=True)"
                )
            raise ValueError(
                "QuantTensor.int(): value / scale + zero_point is not an integer grid within "
                f"{self.bit_width} {'signed' if self.signed else 'unsigned'} bits (scale "
                f"{np.asarray(self.scale).ravel()[:4]}...); the tensor is not validly quantized"
            )
        codes = jnp.round(self._codes())
        if float_datatype:
            return codes.astype(jnp.float32)
        bits = int(self.bit_width) if _concrete(self.bit_width) else 32
        if bits <= 8:
            return codes.astype(jnp.int8 if self.signed else jnp.uint8)
        return codes.astype(jnp.int32)

    # -- arithmetic ----------------------------------------------------------------------

    def __add__(self, other: Any) -> Any:
        if not isinstance(other, QuantTensor):
            return self.value + _value(other)
        training = self.training or other.training
        if not training and _concrete(self.scale, other.scale):
            same_scale = np.allclose(np.asarray(self.scale), np.asarray(other.scale))
            if not same_scale:
                raise ValueError(
                    f"cannot add QuantTensors with different scales "
                    f"({_show(self.scale)} and {_show(other.scale)}) in eval mode: integer "
                    "addition needs one grid. Quantize both inputs with one shared quantizer "
                    "(e.g. QuantEltwiseAdd's input_quant, or pass the same act_quant proxy to "
                    "both producing layers), or add the .value arrays as floats"
                )
        n = max(self.scale.ndim, other.scale.ndim, self.zero_point.ndim, other.zero_point.ndim)
        scale = self.scale if not training else (_lift(self.scale, n) + _lift(other.scale, n)) / 2
        return QuantTensor(
            self.value + other.value,
            scale,
            _lift(self.zero_point, n) + _lift(other.zero_point, n),
            jnp.maximum(self.bit_width, other.bit_width) + 1,
            bool(self.signed or other.signed),
            training,
        )

    def __radd__(self, other: Any) -> Any:
        return _value(other) + self.value

    def __sub__(self, other: Any) -> Any:
        return self.value - _value(other)

    def __rsub__(self, other: Any) -> Any:
        return _value(other) - self.value

    def __neg__(self) -> Any:
        if self.signed:
            return self._like(-self.value, zero_point=-self.zero_point)
        return -self.value

    def __mul__(self, other: Any) -> Any:
        if isinstance(other, QuantTensor) and _zero(self) and _zero(other):
            return QuantTensor(
                self.value * other.value,
                _lift(self.scale, other.scale.ndim) * _lift(other.scale, self.scale.ndim),
                self.zero_point,
                self.bit_width + other.bit_width,
                bool(self.signed or other.signed),
                self.training or other.training,
            )
        return self.value * _value(other)

    def __rmul__(self, other: Any) -> Any:
        return _value(other) * self.value

    def __truediv__(self, other: Any) -> Any:
        return self.value / _value(other)

    def __rtruediv__(self, other: Any) -> Any:
        return _value(other) / self.value

    def __matmul__(self, other: Any) -> Any:
        return self.value @ _value(other)

    def __rmatmul__(self, other: Any) -> Any:
        return _value(other) @ self.value

    # -- shape ops that keep a per-tensor scale ------------------------------------------

    def reshape(self, *shape: Any) -> Any:
        """Reshapes; stays a QuantTensor when the scale is per tensor."""
        value = self.value.reshape(*shape)
        return self._like(value) if self.is_per_tensor else value

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Any:
        """Flattens dims ``start_dim..end_dim`` (PyTorch's signature)."""
        shape = self.shape
        end = end_dim % len(shape)
        new = (*shape[:start_dim], int(np.prod(shape[start_dim : end + 1])), *shape[end + 1 :])
        return self.reshape(new)

    def transpose(self, dim0: int, dim1: int) -> Any:
        """Swaps two axes, as ``torch.Tensor.transpose``; stays a QuantTensor per tensor."""
        value = jnp.swapaxes(self.value, dim0, dim1)
        return self._like(value) if self.is_per_tensor else value

    def permute(self, *dims: Any) -> Any:
        """Reorders the axes, as ``torch.Tensor.permute``; stays a QuantTensor per tensor."""
        one = len(dims) == 1 and isinstance(dims[0], tuple | list)
        order: tuple[int, ...] = tuple(dims[0]) if one else tuple(dims)
        value = jnp.transpose(self.value, order)
        return self._like(value) if self.is_per_tensor else value

    def __getitem__(self, index: Any) -> Any:
        value = self.value[index]
        return self._like(value) if self.is_per_tensor else value


def _array(name: str, v: Any) -> jax.Array:
    try:
        return jnp.asarray(v)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"QuantTensor({name}={type(v).__name__}): {name} must be an array of numbers"
        ) from e


def _broadcasts(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    """Whether one value per block of ``shape`` covers ``to`` (qcore's rule: dims divide)."""
    if len(shape) > len(to):
        return False
    return all(
        a == b or (a > 0 and b % a == 0) for a, b in zip(shape[::-1], to[::-1], strict=False)
    )


def _is_number(v: Any) -> bool:
    dtype = getattr(v, "dtype", None)
    if dtype is not None:
        return np.issubdtype(dtype, np.number)
    return isinstance(v, int | float | np.number) and not isinstance(v, bool)


def _value(x: Any) -> Any:
    return x.value if isinstance(x, QuantTensor) else x


def _lift(a: jax.Array, ndim: int) -> jax.Array:
    """``a`` with leading 1-dims up to rank ``ndim`` (NumPy broadcasting, made explicit).

    Scales and zero points keep Brevitas' shapes (0-d per tensor, ``(1,)`` for a
    constant scale or a layer's zero point); arithmetic with them lifts them first.
    """
    return a.reshape((1,) * (ndim - a.ndim) + a.shape) if a.ndim < ndim else a


def _zero(x: QuantTensor) -> bool:
    return _concrete(x.zero_point) and not np.any(np.asarray(x.zero_point))


def _show(a: jax.Array) -> str:
    flat = np.asarray(a).ravel()
    return f"{flat[0]:g}" if flat.size == 1 else f"{flat[:3]}..."


def value_of(x: Any) -> Any:
    """``x.value`` for a QuantTensor, ``x`` otherwise."""
    return _value(x)

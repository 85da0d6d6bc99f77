"""Operands of quantized ops: a plain array or a QArray, as codes + scale + zero point.

Every op in :mod:`qcore.ops` first turns each operand into an :class:`Operand`:
the values it contracts (integer codes for integer QArrays, float values
otherwise), a float32 scale following the generic broadcast rule (or None) and
an int32 / float32 zero point shaped like the scale (or None). The value of the
operand is always ``(values - zero_point) * scale``.

Unsigned 8-bit codes are re-centred to int8 (``q - 128``, with the 128 folded into
the zero point; narrower unsigned codes fit int8 as they are) so the integer path
always contracts int8 × int8 → int32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qcore import numerics
from qcore.qarray import _FULL_PRECISION_SCALES, QArray, _float_dtype, unpack

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Operand:
    """An op operand seen as ``(values - zero_point) * scale``.

    Attributes:
        values: int8 codes (``integer``) or float values.
        scale: float32 scale with the values' rank, or None (a plain array).
        zero_point: Zero point shaped like ``scale`` (int32 when ``integer``,
            float32 otherwise), or None.
        integer: Whether ``values`` are int8 codes usable by the integer path.
        dtype: The dtype this operand asks the result to have (a plain array's
            dtype; a QArray's scale dtype, or its dequantized dtype when the
            scale is a low-precision block scale).
    """

    values: Array
    scale: Array | None
    zero_point: Array | None
    integer: bool
    dtype: np.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the values."""
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        """Rank of the values."""
        return self.values.ndim

    def as_float(self) -> Operand:
        """The same operand with float32 values (for the float path)."""
        zp = None if self.zero_point is None else self.zero_point.astype(jnp.float32)
        return dataclasses.replace(
            self, values=self.values.astype(jnp.float32), zero_point=zp, integer=False
        )

    def dequantized(self) -> Array:
        """``(values - zero_point) * scale`` in float32, materialised."""
        v = self.values.astype(jnp.float32)
        if self.scale is None:
            return v
        z = None if self.zero_point is None else expand(self.zero_point, v.shape)
        s = expand(self.scale, v.shape)
        return (v if z is None else v - z.astype(jnp.float32)) * s


def result_dtype(q: QArray) -> np.dtype:
    """The dtype a QArray operand asks for: its scale's, unless that is a block scale."""
    return q.scale.dtype if q.scale.dtype in _FULL_PRECISION_SCALES else q.dtype


def promote(*dtypes: Any) -> np.dtype:
    """The result dtype of an op: standard JAX promotion of the operands' dtypes.

    Evaluated under standard promotion on purpose: the dtype rule of our ops must
    not depend on the caller's ``jax_numpy_dtype_promotion`` setting (in strict
    mode f32 × bf16 has no implicit promotion; our ops give f32).
    """
    with jax.numpy_dtype_promotion("standard"):
        return jnp.dtype(jnp.result_type(*dtypes))


def operand(x: Array | QArray) -> Operand:
    """Normalises an op argument (see the module docstring)."""
    if not isinstance(x, QArray):
        x = jnp.asarray(x)
        return Operand(x, None, None, False, x.dtype)
    q = unpack(x)
    qt = q.qtype
    scale = q.scale.astype(jnp.float32)
    if q.tensor_scale is not None:
        scale = scale * q.tensor_scale.astype(jnp.float32)
    zp = q.zero_point
    if qt.kind in ("int", "binary") and qt.bits <= 8:
        codes = q.qvalue
        zp = None if zp is None else zp.astype(jnp.int32)
        if not qt.signed and qt.bits == 8:
            # uint8 codes 0..255 -> int8 -128..127; the shift moves into the zero point.
            codes = (codes.astype(jnp.int16) - 128).astype(jnp.int8)
            zp = jnp.full(scale.shape, -128, jnp.int32) if zp is None else zp - 128
        return Operand(codes.astype(jnp.int8), scale, zp, True, result_dtype(x))
    values = numerics.decode(q.qvalue, qt)
    zp = None if zp is None else zp.astype(jnp.float32)
    return Operand(values, scale, zp, False, result_dtype(x))


def expand(a: Array, shape: tuple[int, ...]) -> Array:
    """Repeats a generic-broadcast array (scale, zero point) up to ``shape``.

    Dims equal to 1 stay 1 (they broadcast); tiled dims are repeated.
    """
    for axis, (s, d) in enumerate(zip(a.shape, shape, strict=True)):
        if s not in (1, d):
            a = numerics.repeat(a, d // s, axis)
    return a


def preferred_dtype(preferred_element_type: Any) -> np.dtype | None:
    """An op's ``preferred_element_type`` with a QArray operand: None or a float dtype."""
    if preferred_element_type is None:
        return None
    return _float_dtype("preferred_element_type", preferred_element_type)


def as_input(x: object, name: str) -> Array | QArray:
    """An op argument as a QArray or a JAX array; raises a clear error otherwise.

    Float, integer and bool arrays are accepted; a bool or integer array times a
    QArray gives the QArray's dtype (standard JAX promotion, as for plain arrays).
    """
    if isinstance(x, QArray):
        return x
    try:
        arr = jnp.asarray(x)
    except TypeError:
        raise ValueError(
            f"{name} must be an array or a QArray, got {type(x).__name__} {x!r:.80}"
        ) from None
    if not any(jnp.issubdtype(arr.dtype, kind) for kind in (jnp.floating, jnp.integer, jnp.bool_)):
        raise ValueError(
            f"{name} must be an array or a QArray, got dtype {arr.dtype}; allowed: float, "
            "integer or bool arrays"
        )
    return arr

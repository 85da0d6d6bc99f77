"""Dense packing of sub-byte integer codes (1..8 bits) into ``uint8``.

Layout: along the packed axis, the codes form one little-endian bitstream. Code ``i`` occupies
stream bits ``[i * bits, (i + 1) * bits)`` (its least significant bit first) and stream bit ``s``
is bit ``s % 8`` of byte ``s // 8``. For ``bits`` in {1, 2, 4, 8} this simply means code ``i``
of a byte sits in bits ``[i * bits, (i + 1) * bits)`` of that byte (e.g. int4: the first code is
the low nibble). Little-endian was chosen because it makes that layout the same for every width
(the fast and the generic paths produce identical streams), it matches
``numpy.packbits(..., bitorder="little")`` and the "low nibble first" int4 convention, and code
``i`` of a group always starts at the statically known bit offset ``i * bits``.

The stream is cut into groups of ``lcm(bits, 8) // bits`` codes, which fill exactly
``lcm(bits, 8) // 8`` bytes (8 codes -> 3 bytes for 3-bit, 4 codes -> 3 bytes for 6-bit, 2 codes
-> 1 byte for 4-bit). Working group-wise is what keeps everything vectorised: every group has the
same static pattern of shifts, so packing is a reshape to ``(..., groups, codes_per_group)``
followed by a handful of whole-array shifts/ors, with no per-element bit indexing. It also means
every group starts on a byte boundary, so a packed array can be sliced or sharded by groups.

All functions are pure ``jax.numpy`` code with static Python-int configuration (``bits``,
``axis``, ``length``, ``signed``, ``dtype``), so they work under ``jax.jit`` (mark those
arguments static) and ``jax.vmap``. Every operation uses explicit dtypes and ranks, so they also
run under ``jax_numpy_dtype_promotion="strict"`` and ``jax_numpy_rank_promotion="raise"``.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

__all__ = ["pack", "packed_length", "unpack"]

# Widths whose codes never straddle a byte boundary: one byte holds exactly 8 // bits codes.
_FAST_BITS = frozenset({1, 2, 4, 8})

# Unsigned integer dtype of each itemsize, used to reinterpret signed codes as two's complement.
_UNSIGNED_BY_ITEMSIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _is_int(value: object) -> bool:
    """Whether `value` is a static (non-bool) Python or NumPy integer."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _check_bits(bits: int) -> int:
    if not _is_int(bits):
        raise ValueError(f"bits={bits!r} ({type(bits).__name__}); allowed: a static int in 1..8")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits={bits}; allowed: 1..8")
    return int(bits)


def _check_axis(axis: int, ndim: int, array_name: str) -> int:
    """Returns `axis` normalised to ``0..ndim-1``."""
    if not _is_int(axis):
        raise ValueError(f"axis={axis!r} ({type(axis).__name__}); allowed: a static int")
    if ndim == 0:
        raise ValueError(f"axis={axis}; allowed: none, {array_name} is 0-d (needs ndim >= 1)")
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"axis={axis}; allowed: {-ndim}..{ndim - 1} for {array_name} with ndim={ndim}"
        )
    return int(axis) % ndim


def _group_shape(bits: int) -> tuple[int, int]:
    """Returns ``(codes_per_group, bytes_per_group)``: the smallest whole-byte run of codes."""
    group_bits = math.lcm(bits, 8)
    return group_bits // bits, group_bits // 8


def _shift(x: jax.Array, offset: int) -> jax.Array:
    """Shifts uint8 `x` left by `offset` bits, or right by ``-offset`` bits if it is negative.

    Callers only use ``|offset| < 8``; bits shifted past either end are meant to be dropped
    (they belong to a neighbouring byte or code).
    """
    if offset >= 0:
        return jnp.left_shift(x, jnp.uint8(offset))
    return jnp.right_shift(x, jnp.uint8(-offset))


def _low_bits_as_uint8(codes: jax.Array, bits: int) -> jax.Array:
    """Keeps the low `bits` bits of each integer code (two's complement), as uint8."""
    if jnp.iinfo(codes.dtype).bits < 8:
        # Sub-byte dtypes (int4, uint2, ...) cannot be bitcast to a uint8; widening first
        # preserves their values, and hence their two's complement low bits.
        signed = jnp.issubdtype(codes.dtype, jnp.signedinteger)
        codes = codes.astype(jnp.int8 if signed else jnp.uint8)
    # Reinterpreting as the same-width unsigned type exposes the two's complement bit pattern,
    # so masking keeps exactly the low bits also for negative codes (-1 -> 0b1...1).
    unsigned_dtype = _UNSIGNED_BY_ITEMSIZE[codes.dtype.itemsize]
    unsigned = jax.lax.bitcast_convert_type(codes, unsigned_dtype)
    low = jnp.bitwise_and(unsigned, jnp.asarray((1 << bits) - 1, dtype=unsigned_dtype))
    return low.astype(jnp.uint8)


def _fast_shifts(bits: int, ndim: int) -> jax.Array:
    """Bit offsets ``i * bits`` of the codes within a byte, shaped to broadcast over the last axis.

    The shape is spelled out as (1, ..., 1, 8 // bits) rather than relying on implicit rank
    promotion, so the code also runs with ``jax_numpy_rank_promotion="raise"``.
    """
    shifts = np.arange(8 // bits) * bits
    return jnp.asarray(shifts.reshape((1,) * (ndim - 1) + shifts.shape), dtype=jnp.uint8)


def _pack_groups(groups: jax.Array, bits: int) -> jax.Array:
    """Packs uint8 codes of shape (..., G, codes_per_group) into (..., G, bytes_per_group)."""
    codes_per_group, bytes_per_group = _group_shape(bits)
    if bits in _FAST_BITS:
        # One byte per group: code i goes to bits [i*bits, (i+1)*bits). The shifted codes have
        # disjoint bits, so their sum equals their bitwise or and never exceeds 255.
        shifts = _fast_shifts(bits, groups.ndim)
        return jnp.sum(jnp.left_shift(groups, shifts), axis=-1, dtype=jnp.uint8, keepdims=True)
    # Generic path: byte j of a group covers stream bits [8j, 8j+8) and code i covers
    # [i*bits, (i+1)*bits). Each byte is the or of the codes overlapping it, each shifted by its
    # static offset; uint8 shifts drop exactly the bits that belong to the neighbouring byte.
    # The loops run over the static group layout (at most 8 x 7), never over array elements.
    out = []
    for j in range(bytes_per_group):
        byte = None
        for i in range(codes_per_group):
            offset = i * bits - 8 * j
            if -bits < offset < 8:
                part = _shift(groups[..., i], offset)
                byte = part if byte is None else jnp.bitwise_or(byte, part)
        out.append(byte)
    return jnp.stack(out, axis=-1)


def _unpack_groups(groups: jax.Array, bits: int) -> jax.Array:
    """Inverse of `_pack_groups`: (..., G, bytes_per_group) -> (..., G, codes_per_group)."""
    codes_per_group, bytes_per_group = _group_shape(bits)
    mask = jnp.uint8((1 << bits) - 1)
    if bits in _FAST_BITS:
        shifts = _fast_shifts(bits, groups.ndim)
        return jnp.bitwise_and(jnp.right_shift(groups, shifts), mask)
    # Code i collects the overlapping bytes j, shifted from stream offset 8j to i*bits; bits
    # shifted out (or left above `bits`) belong to other codes and are cut off by the mask.
    out = []
    for i in range(codes_per_group):
        code = None
        for j in range(bytes_per_group):
            offset = 8 * j - i * bits
            if -8 < offset < bits:
                part = _shift(groups[..., j], offset)
                code = part if code is None else jnp.bitwise_or(code, part)
        assert code is not None  # every code overlaps at least one byte
        out.append(jnp.bitwise_and(code, mask))
    return jnp.stack(out, axis=-1)


def _check_out_dtype(dtype: DTypeLike | None, bits: int, signed: bool) -> jnp.dtype:
    """Resolves `unpack`'s output dtype and checks that it can represent every code."""
    if dtype is None:
        return jnp.dtype(jnp.int8 if signed else jnp.uint8)
    try:
        out_dtype = jnp.dtype(dtype)
    except TypeError as err:
        raise ValueError(f"dtype={dtype!r}; allowed: an integer dtype") from err
    if not jnp.issubdtype(out_dtype, jnp.integer):
        raise ValueError(f"dtype={out_dtype}; allowed: an integer dtype")
    if signed:
        low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    else:
        low, high = 0, (1 << bits) - 1
    info = jnp.iinfo(out_dtype)
    if low < info.min or high > info.max:
        kind = "signed" if signed else "unsigned"
        raise ValueError(
            f"dtype={out_dtype}; allowed: an integer dtype holding {kind} {bits}-bit codes "
            f"({low}..{high})"
        )
    return out_dtype


def packed_length(length: int, bits: int) -> int:
    """Number of bytes that `length` codes of `bits` bits occupy along the packed axis.

    This is ``ceil(length * bits / 8)`` rounded up to whole groups, where a group is
    ``lcm(bits, 8) // bits`` codes stored in ``lcm(bits, 8) // 8`` bytes.

    Args:
        length: Number of codes along the packed axis (>= 0).
        bits: Bits per code, 1..8.

    Returns:
        The packed axis length in bytes.

    Raises:
        ValueError: If `bits` is not in 1..8 or `length` is negative.

    Example:
        >>> packed_length(128, 4)
        64
        >>> packed_length(8, 3), packed_length(9, 3)
        (3, 6)
    """
    bits = _check_bits(bits)
    if not _is_int(length) or length < 0:
        raise ValueError(f"length={length!r}; allowed: a static int >= 0")
    codes_per_group, bytes_per_group = _group_shape(bits)
    return -(-int(length) // codes_per_group) * bytes_per_group


def pack(codes: jax.Array, bits: int, *, axis: int = -1) -> jax.Array:
    """Packs integer codes densely into uint8 along `axis`.

    Only the low `bits` bits of each code are kept (two's complement for negative codes, so a
    signed int4 code -1 is stored as 0b1111). The axis is zero-padded to a whole number of
    groups (see `packed_length`). Codes are laid out as a little-endian bitstream: code ``i``
    occupies stream bits ``[i * bits, (i + 1) * bits)``; e.g. for 4 bits the first code of each
    byte is its low nibble.

    Args:
        codes: Integer array of any integer dtype (signed or unsigned) and rank >= 1.
        bits: Bits per code, 1..8 (static).
        axis: Axis to pack along (static; negative values count from the end).

    Returns:
        uint8 array shaped like `codes` except that `axis` has length
        ``packed_length(codes.shape[axis], bits)``.

    Raises:
        ValueError: If `bits` is not in 1..8, `codes` does not have an integer dtype, or `axis`
            is out of range.

    Example:
        >>> import jax.numpy as jnp
        >>> [hex(b) for b in pack(jnp.array([1, 2, 3, 15]), bits=4).tolist()]
        ['0x21', '0xf3']
        >>> pack(jnp.arange(8), bits=3).shape
        (3,)
    """
    bits = _check_bits(bits)
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"codes dtype={codes.dtype}; allowed: integer dtypes (signed/unsigned)")
    axis = _check_axis(axis, codes.ndim, "codes")
    return _pack_jit(codes, bits, axis)


# The validated cores are jitted so that eager calls run as one compiled computation (instead of
# dispatching every small shift op separately); inside an outer jit or vmap they are inlined.
@functools.partial(jax.jit, static_argnames=("bits", "axis"))
def _pack_jit(codes: jax.Array, bits: int, axis: int) -> jax.Array:
    low = _low_bits_as_uint8(codes, bits)
    if bits == 8:
        return low  # 8-bit codes already are bytes.
    x = jnp.moveaxis(low, axis, -1)
    lead, length = x.shape[:-1], x.shape[-1]
    codes_per_group, bytes_per_group = _group_shape(bits)
    num_groups = -(-length // codes_per_group)
    # Zero padding to whole groups keeps the shift pattern identical for every group.
    pad = [(0, 0)] * len(lead) + [(0, num_groups * codes_per_group - length)]
    # Explicit shapes (not -1) so that arrays with zero-size dimensions reshape too.
    groups = jnp.pad(x, pad).reshape(*lead, num_groups, codes_per_group)
    packed = _pack_groups(groups, bits).reshape(*lead, num_groups * bytes_per_group)
    return jnp.moveaxis(packed, -1, axis)


def unpack(
    packed: jax.Array,
    bits: int,
    length: int,
    *,
    axis: int = -1,
    signed: bool = False,
    dtype: DTypeLike | None = None,
) -> jax.Array:
    """Unpacks `length` codes of `bits` bits along `axis`; the inverse of `pack`.

    Args:
        packed: uint8 array produced by `pack` (static shape; bytes beyond the groups needed for
            `length` codes are ignored).
        bits: Bits per code, 1..8 (static).
        length: Number of codes to return along `axis` (static), at most the number of codes the
            whole groups in ``packed.shape[axis]`` hold.
        axis: Packed axis (static; negative values count from the end).
        signed: If True, codes are sign-extended from `bits` bits (int4 0b1111 -> -1),
            otherwise they are read as unsigned values in ``0..2**bits - 1``.
        dtype: Integer output dtype; defaults to int8 if `signed` else uint8. It must be able to
            hold every `bits`-bit code of the requested signedness.

    Returns:
        Integer array shaped like `packed` except that `axis` has length `length`.

    Raises:
        ValueError: If `bits` is not in 1..8, `packed` is not uint8, `axis` is out of range,
            `length` is negative or exceeds what `packed` holds, or `dtype` is not an integer
            dtype wide enough for the codes.

    Example:
        >>> import jax.numpy as jnp
        >>> packed = pack(jnp.array([-1, 2, -8]), bits=4)
        >>> unpack(packed, bits=4, length=3, signed=True).tolist()
        [-1, 2, -8]
        >>> unpack(packed, bits=4, length=3).tolist()
        [15, 2, 8]
    """
    bits = _check_bits(bits)
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed dtype={packed.dtype}; allowed: uint8")
    axis = _check_axis(axis, packed.ndim, "packed")
    out_dtype = _check_out_dtype(dtype, bits, signed)
    codes_per_group, bytes_per_group = _group_shape(bits)
    num_bytes = packed.shape[axis]
    capacity = num_bytes // bytes_per_group * codes_per_group
    if not _is_int(length) or not 0 <= length <= capacity:
        raise ValueError(
            f"length={length!r}; allowed: 0..{capacity} (packed.shape[{axis}]={num_bytes} bytes "
            f"hold at most {capacity} codes of bits={bits})"
        )
    return _unpack_jit(packed, bits, int(length), axis, bool(signed), out_dtype)


@functools.partial(jax.jit, static_argnames=("bits", "length", "axis", "signed", "out_dtype"))
def _unpack_jit(
    packed: jax.Array, bits: int, length: int, axis: int, signed: bool, out_dtype: jnp.dtype
) -> jax.Array:
    codes_per_group, bytes_per_group = _group_shape(bits)
    x = jnp.moveaxis(packed, axis, -1)
    lead = x.shape[:-1]
    num_groups = packed_length(length, bits) // bytes_per_group
    x = x[..., : num_groups * bytes_per_group]
    if bits == 8:
        codes = x
    else:
        groups = x.reshape(*lead, num_groups, bytes_per_group)
        codes = _unpack_groups(groups, bits).reshape(*lead, num_groups * codes_per_group)
        codes = codes[..., :length]  # Drop the zero padding of the last group.
    if signed:
        # Move the code's sign bit to bit 7, reinterpret as int8 and shift back arithmetically,
        # which replicates the sign bit into the high bits (two's complement sign extension).
        # (jnp.right_shift is arithmetic for signed dtypes.)
        spare = 8 - bits
        top_aligned = jnp.left_shift(codes, jnp.uint8(spare))
        as_int8 = jax.lax.bitcast_convert_type(top_aligned, jnp.int8)
        codes = jnp.right_shift(as_int8, jnp.int8(spare))
    return jnp.moveaxis(codes.astype(out_dtype), -1, axis)

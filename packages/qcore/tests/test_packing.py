"""Tests for qcore.packing: round trips, exact byte layout, jit/vmap and input validation."""

import doctest
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from qcore import packing
from qcore.packing import pack, packed_length, unpack

ALL_BITS = list(range(1, 9))
SIGNED_DTYPES = [jnp.int8, jnp.int16, jnp.int32]
UNSIGNED_DTYPES = [jnp.uint8, jnp.uint16, jnp.uint32, jnp.int32]


def _random_codes(rng: np.random.Generator, shape, bits: int, signed: bool) -> np.ndarray:
    """Random codes covering the whole `bits`-bit range of the given signedness."""
    if signed:
        return rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), size=shape)
    return rng.integers(0, 1 << bits, size=shape)


def _reference_pack_1d(codes: np.ndarray, bits: int) -> np.ndarray:
    """NumPy reference: the codes' low bits as a little-endian bitstream, via np.packbits."""
    low = codes.astype(np.int64) & ((1 << bits) - 1)
    stream = ((low[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    stream = np.pad(stream, (0, packed_length(len(codes), bits) * 8 - stream.size))
    return np.packbits(stream, bitorder="little")


@pytest.fixture
def strict_promotion():
    previous = jax.config.jax_numpy_dtype_promotion
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    yield
    jax.config.update("jax_numpy_dtype_promotion", previous)


def test_doctests():
    results = doctest.testmod(packing)
    assert results.attempted > 0
    assert results.failed == 0


@st.composite
def _round_trip_cases(draw):
    bits = draw(st.integers(1, 8))
    signed = draw(st.booleans())
    shape = tuple(draw(st.lists(st.integers(0, 11), min_size=1, max_size=3)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    dtype = draw(st.sampled_from(SIGNED_DTYPES if signed else UNSIGNED_DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    return bits, signed, shape, axis, dtype, seed


@settings(max_examples=40, deadline=None)
@given(_round_trip_cases())
def test_round_trip_random(case):
    bits, signed, shape, axis, dtype, seed = case
    codes = jnp.asarray(_random_codes(np.random.default_rng(seed), shape, bits, signed), dtype)
    packed = pack(codes, bits, axis=axis)
    expected_shape = list(shape)
    expected_shape[axis] = packed_length(shape[axis], bits)
    assert packed.dtype == jnp.uint8
    assert packed.shape == tuple(expected_shape)

    restored = unpack(packed, bits, shape[axis], axis=axis, signed=signed, dtype=dtype)
    assert restored.dtype == dtype
    np.testing.assert_array_equal(restored, codes)


def test_default_unpack_dtype():
    packed = pack(jnp.array([-1, 3, 5], jnp.int32), 3)
    signed = unpack(packed, 3, 3, signed=True)
    unsigned = unpack(packed, 3, 3)
    assert signed.dtype == jnp.int8
    assert unsigned.dtype == jnp.uint8
    np.testing.assert_array_equal(signed, np.array([-1, 3, -3], np.int8))
    np.testing.assert_array_equal(unsigned, np.array([7, 3, 5], np.uint8))


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.uint4, jnp.int2])
def test_sub_byte_input_dtypes(dtype):
    bits = jnp.iinfo(dtype).bits
    signed = jnp.issubdtype(dtype, jnp.signedinteger)
    info = jnp.iinfo(dtype)
    codes = jnp.arange(int(info.min), int(info.max) + 1, dtype=jnp.int32).astype(dtype)
    restored = unpack(pack(codes, bits), bits, codes.shape[0], signed=signed, dtype=dtype)
    np.testing.assert_array_equal(restored, codes)


def test_empty_arrays():
    for bits in ALL_BITS:
        packed = pack(jnp.zeros((0, 5), jnp.int8), bits, axis=1)
        assert packed.shape == (0, packed_length(5, bits))
        assert unpack(packed, bits, 5, axis=1).shape == (0, 5)
        packed = pack(jnp.zeros((4, 0), jnp.int8), bits)
        assert packed.shape == (4, 0)
        assert unpack(packed, bits, 0).shape == (4, 0)


@pytest.mark.parametrize(
    ("bits", "length", "expected_nbytes"),
    [(4, 128, 64), (3, 8, 3), (2, 128, 32), (1, 128, 16), (8, 128, 128), (6, 4, 3), (5, 8, 5)],
)
def test_byte_counts(bits, length, expected_nbytes):
    assert packed_length(length, bits) == expected_nbytes
    packed = pack(jnp.ones((64, length), jnp.int8), bits)
    assert packed.nbytes == 64 * expected_nbytes


def test_int4_nbytes_is_half_a_byte_per_code():
    packed = pack(jnp.ones((64, 128), jnp.int8), 4)
    assert packed.nbytes == 64 * 128 // 2


def test_packed_length_rounds_up_to_whole_groups():
    assert [packed_length(n, 3) for n in range(10)] == [0, 3, 3, 3, 3, 3, 3, 3, 3, 6]
    assert [packed_length(n, 4) for n in range(5)] == [0, 1, 1, 2, 2]
    assert [packed_length(n, 6) for n in range(6)] == [0, 3, 3, 3, 3, 6]


def test_closed_form_int4_nibble_order():
    # Code 0 is the low nibble, code 1 the high nibble: [1, 2] -> 0x21, [3, 15] -> 0xF3.
    packed = pack(jnp.array([1, 2, 3, 15]), 4)
    np.testing.assert_array_equal(packed, np.array([0x21, 0xF3], np.uint8))
    # Negative codes keep their two's complement low nibble: -1 -> 0xF, -8 -> 0x8.
    packed = pack(jnp.array([-1, -8], jnp.int8), 4)
    np.testing.assert_array_equal(packed, np.array([0x8F], np.uint8))


def test_closed_form_2bit_and_1bit():
    # 2-bit codes [1, 2, 3, 0] sit at bits 0-1, 2-3, 4-5, 6-7: 0b00_11_10_01 = 0x39.
    np.testing.assert_array_equal(pack(jnp.array([1, 2, 3, 0]), 2), np.array([0x39], np.uint8))
    # 1-bit code i is bit i: [1, 0, 0, 0, 0, 0, 0, 1, 1] -> 0x81, 0x01.
    bits = jnp.array([1, 0, 0, 0, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(pack(bits, 1), np.array([0x81, 0x01], np.uint8))


def test_closed_form_3bit():
    # Codes 0..7, code i at stream bits [3i, 3i+3), LSB first; stream bit s is bit s%8 of byte s//8.
    # Stream bits 0..23 (code: bits, LSB first):
    #   0: 000  1: 100  2: 010  3: 110  4: 001  5: 101  6: 011  7: 111
    # byte 0 = stream bits 0-7   = 000 100 01            -> bits 3 and 7 set         = 0x88
    # byte 1 = stream bits 8-15  = 0 110 001 1           -> bits 1, 2, 6 and 7 set   = 0xC6
    # byte 2 = stream bits 16-23 = 01 011 111            -> bits 1, 3, 4, 5, 6, 7 set = 0xFA
    packed = pack(jnp.arange(8, dtype=jnp.int32), 3)
    np.testing.assert_array_equal(packed, np.array([0x88, 0xC6, 0xFA], np.uint8))
    np.testing.assert_array_equal(unpack(packed, 3, 8), np.arange(8))


@pytest.mark.parametrize("bits", ALL_BITS)
def test_matches_numpy_packbits_and_round_trips_every_partial_group(bits):
    # Lengths 1..group+1 end the last group at every possible position (and cover a full group
    # plus one; length 0 is in test_empty_arrays). Signedness alternates, as sign extension does
    # not depend on the length.
    codes_per_group = math.lcm(bits, 8) // bits
    rng = np.random.default_rng(bits)
    for length in range(1, codes_per_group + 2):
        signed = length % 2 == 1
        codes = _random_codes(rng, (length,), bits, signed)
        packed = pack(jnp.asarray(codes, jnp.int32), bits)
        np.testing.assert_array_equal(packed, _reference_pack_1d(codes, bits))
        restored = unpack(packed, bits, length, signed=signed, dtype=jnp.int32)
        np.testing.assert_array_equal(restored, codes)
    # Packing along axis 0 of a 2-D array packs every column like its own 1-D vector.
    columns = _random_codes(rng, (13, 2), bits, signed=True)
    expected = np.stack([_reference_pack_1d(column, bits) for column in columns.T], axis=1)
    np.testing.assert_array_equal(pack(jnp.asarray(columns, jnp.int32), bits, axis=0), expected)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_jit_matches_eager(bits):
    codes = jnp.asarray(_random_codes(np.random.default_rng(0), (3, 10, 5), bits, True), jnp.int8)
    jit_pack = jax.jit(pack, static_argnames=("bits", "axis"))
    jit_unpack = jax.jit(unpack, static_argnames=("bits", "length", "axis", "signed", "dtype"))
    packed = pack(codes, bits, axis=1)
    np.testing.assert_array_equal(jit_pack(codes, bits=bits, axis=1), packed)
    np.testing.assert_array_equal(
        jit_unpack(packed, bits=bits, length=10, axis=1, signed=True),
        unpack(packed, bits, 10, axis=1, signed=True),
    )
    np.testing.assert_array_equal(
        jit_unpack(packed, bits=bits, length=10, axis=1, signed=True), codes
    )


@pytest.mark.parametrize("bits", [3, 4, 6])
def test_vmap(bits):
    codes = jnp.asarray(_random_codes(np.random.default_rng(1), (4, 11, 6), bits, False), jnp.uint8)
    # Batch over axis 0, pack along the per-example axis 0 (= axis 1 of the batch).
    packed = jax.vmap(lambda c: pack(c, bits, axis=0))(codes)
    np.testing.assert_array_equal(packed, pack(codes, bits, axis=1))
    restored = jax.vmap(lambda p: unpack(p, bits, 11, axis=0))(packed)
    np.testing.assert_array_equal(restored, codes)
    # Batch over the last axis with a negative packing axis.
    packed_t = jax.vmap(lambda c: pack(c, bits, axis=-1), in_axes=2, out_axes=2)(codes)
    np.testing.assert_array_equal(packed_t, packed)


def test_strict_dtype_promotion(strict_promotion):
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    rng = np.random.default_rng(2)
    for bits in ALL_BITS:
        signed, dtype = (True, jnp.int32) if bits % 2 else (False, jnp.uint16)
        codes = jnp.asarray(_random_codes(rng, (3, 9), bits, signed), dtype)
        packed = pack(codes, bits, axis=0)
        restored = unpack(packed, bits, 3, axis=0, signed=signed, dtype=dtype)
        np.testing.assert_array_equal(restored, codes)


_CODES = jnp.arange(6, dtype=jnp.int32)
_PACKED = pack(_CODES, 4)  # 3 bytes along axis 0.


@pytest.mark.parametrize(
    ("call", "name", "value"),
    [
        (lambda: pack(_CODES, 9), "bits", "9"),
        (lambda: pack(_CODES, 0), "bits", "0"),
        (lambda: pack(_CODES, 4.0), "bits", "4.0"),
        (lambda: unpack(_PACKED, 9, 2), "bits", "9"),
        (lambda: packed_length(4, 9), "bits", "9"),
        (lambda: pack(_CODES.astype(jnp.float32), 4), "codes", "float32"),
        (lambda: pack(_CODES > 2, 4), "codes", "bool"),
        (lambda: pack(_CODES, 4, axis=1), "axis", "1"),
        (lambda: pack(_CODES, 4, axis=-2), "axis", "-2"),
        (lambda: pack(jnp.int32(3), 4), "axis", "-1"),
        (lambda: unpack(_PACKED, 4, 6, axis=-3), "axis", "-3"),
        (lambda: unpack(_PACKED, 4, 7), "length", "7"),
        (lambda: unpack(_PACKED, 4, -1), "length", "-1"),
        (lambda: unpack(_PACKED, 3, 9), "length", "9"),  # 3 bytes = 1 group of 8 3-bit codes.
        (lambda: unpack(pack(_CODES, 3)[:2], 3, 1), "length", "1"),  # No whole 3-byte group.
        (lambda: packed_length(-1, 4), "length", "-1"),
        (lambda: unpack(_PACKED.astype(jnp.int8), 4, 6), "packed", "int8"),
        (lambda: unpack(_PACKED, 4, 6, dtype=jnp.float32), "dtype", "float32"),
        (lambda: unpack(_PACKED, 4, 6, signed=True, dtype=jnp.uint8), "dtype", "uint8"),
        (lambda: unpack(_PACKED, 4, 6, dtype=jnp.int4), "dtype", "int4"),
    ],
)
def test_bad_inputs_raise_value_error(call, name, value):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert name in message
    assert value in message
    assert "allowed" in message

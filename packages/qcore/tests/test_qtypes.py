"""Quantization types: built-ins, lookup, and the NF4 levels from first principles."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import norm

from qcore import qtypes


def test_every_builtin_is_frozen_hashable_and_consistent():
    for name, qt in qtypes.BUILTINS.items():
        assert qt.name == name
        assert hash(qt) == hash(qtypes.get(name))
        with pytest.raises(AttributeError):
            qt.bits = 3  # type: ignore[misc]
        assert qt.qmin < qt.qmax
        assert jnp.dtype(qt.storage) == qt.storage_dtype


@pytest.mark.parametrize("bits", range(2, 9))
def test_signed_int_ranges(bits):
    qt = qtypes.get(f"int{bits}")
    assert (qt.qmin, qt.qmax) == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    assert qt.is_uniform and qt.supports_asymmetric and qt.signed


@pytest.mark.parametrize("bits", range(1, 9))
def test_unsigned_int_ranges(bits):
    qt = qtypes.get(f"uint{bits}")
    assert (qt.qmin, qt.qmax) == (0, 2**bits - 1)
    assert not qt.signed


def test_int16_and_float_maxima():
    assert qtypes.get("int16").storage == "int16"
    assert qtypes.get("float8_e4m3fn").qmax == 448.0
    assert qtypes.get("float8_e5m2").qmax == 57344.0
    assert qtypes.get("float4_e2m1fn").qmax == 6.0


def test_int1_is_binary_not_a_rounding_int():
    qt = qtypes.get("int1")
    assert qt.kind == "binary"
    assert (qt.qmin, qt.qmax) == (-1.0, 1.0)
    assert qtypes.get("binary") is qt


def test_block_scaled_types():
    mxfp8, mxfp4, nvfp4 = (qtypes.get(n) for n in ("mxfp8", "mxfp4", "nvfp4"))
    assert (mxfp8.block_size, mxfp8.storage, mxfp8.scale_dtype) == (
        32,
        "float8_e4m3fn",
        "float8_e8m0fnu",
    )
    assert (mxfp4.block_size, mxfp4.storage, mxfp4.scale_dtype) == (
        32,
        "float4_e2m1fn",
        "float8_e8m0fnu",
    )
    assert (nvfp4.block_size, nvfp4.scale_dtype, nvfp4.tensor_scale) == (
        16,
        "float8_e4m3fn",
        True,
    )


def test_nf4_levels_match_the_normal_quantile_construction():
    # QLoRA's construction: 8 positive and 7 negative quantiles of N(0, 1) at
    # offset 0.9677083, normalised by the largest, plus an exact zero.
    offset = 0.9677083
    pos = norm.ppf(np.linspace(offset, 0.5, 9)[:-1])
    neg = -norm.ppf(np.linspace(offset, 0.5, 8)[:-1])
    levels = np.sort(np.concatenate([pos, [0.0], neg]))
    levels = levels / np.max(np.abs(levels))
    np.testing.assert_allclose(qtypes.get("nf4").codebook, levels, atol=2e-7)


def test_names_and_aliases():
    assert qtypes.get("FP8").name == "float8_e4m3fn"
    assert qtypes.get(" int4 ").name == "int4"
    assert "nf4" in qtypes.names() and "fp4" in qtypes.names()


@pytest.mark.parametrize("bad", ["int9", "float16", "", 4, None])
def test_unknown_name_lists_valid_names(bad):
    with pytest.raises(ValueError, match=r"qtype=.*valid names: .*int4.*nf4"):
        qtypes.get(bad)

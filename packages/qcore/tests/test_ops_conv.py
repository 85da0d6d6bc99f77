"""qcore.conv_general_dilated and qcore.ragged_dot: parity with lax on dequantized operands.

References are ``lax.conv_general_dilated`` / ``lax.ragged_dot`` at HIGHEST precision
on ``dequantize``-d operands (and a float64 numpy loop for ragged_dot). Each case
quantizes, runs every operand combination and its reference inside one
``jax.jit``, so it compiles once. Dtypes, jit/eager and bad-input tests of these
ops are in ``test_ops.py`` with those of the other ops.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qcore
from qcore import HowToQuantize, dequantize, quantize, testing

HIGHEST = lax.Precision.HIGHEST
INT8_INTO_INT32 = ((jnp.dtype(jnp.int8), jnp.dtype(jnp.int8)), jnp.dtype(jnp.int32))


def normal(shape, seed=0, shift=0.0):
    """N(shift, 1) float32 data from numpy (no compilation)."""
    return (np.random.default_rng(seed).standard_normal(shape) + shift).astype(np.float32)


def spec(qtype, channels=(), tiles=None, *, asym=False, **kwargs):
    """A HowToQuantize; asymmetric specs calibrate min/max so the zero point matters."""
    return HowToQuantize(
        qtype=qtype,
        channelwise_axes=channels,
        tiled_axes=tiles or {},
        symmetric=not asym,
        calibration="minmax" if asym else "absmax",
        **kwargs,
    )


def _sides(hx):
    """Which operands to quantize: the weight; also the activation and both if it has a spec."""
    return ["w"] if hx is None else ["w", "x", "xw"]


# -- 5. conv_general_dilated ----------------------------------------------------------------

NHWC = ("NHWC", "HWIO", "NHWC")
NCHW = ("NCHW", "OIHW", "NCHW")
ACT = spec("uint8", asym=True)  # per-tensor with a zero point
ACT_PER_EXAMPLE = spec("uint8", (0,), asym=True)  # batch axis is 0 in NHWC, NCHW, NWC, NCH


def kernel(axis, tiles=None, *, asym=False):
    """Per-output-channel int8 kernel spec (``axis`` is O in the kernel layout)."""
    return spec("int8", (axis,), tiles, asym=asym)


# id -> (x shape, kernel shape, conv kwargs, activation spec, kernel spec, scaled path?)
CONV_CASES = {
    "2-D NHWC/HWIO SAME": (
        (2, 7, 7, 4),
        (3, 3, 4, 6),
        dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC),
        ACT,
        kernel(3),
        True,
    ),
    "2-D NCHW/OIHW VALID stride 2": (
        (2, 4, 9, 8),
        (6, 4, 3, 3),
        dict(window_strides=(2, 2), padding="VALID", dimension_numbers=NCHW),
        ACT_PER_EXAMPLE,
        kernel(0, asym=True),
        True,
    ),
    "NCHW SAME zero points": (
        (2, 4, 9, 8),
        (6, 4, 3, 3),
        dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NCHW),
        ACT,
        kernel(0, asym=True),
        True,
    ),
    "feature groups 2": (
        (2, 7, 7, 4),
        (3, 3, 2, 6),
        dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC, feature_group_count=2),
        ACT_PER_EXAMPLE,
        kernel(3, asym=True),
        True,
    ),
    "depthwise": (
        (2, 7, 7, 4),
        (3, 3, 1, 8),
        dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC, feature_group_count=4),
        ACT,
        kernel(3, asym=True),
        True,
    ),
    "lhs dilation, explicit padding": (
        (1, 5, 5, 3),
        (3, 3, 3, 4),
        dict(
            window_strides=(1, 1),
            padding=((2, 2), (1, 2)),
            lhs_dilation=(2, 2),
            dimension_numbers=NHWC,
        ),
        ACT,
        kernel(3, asym=True),
        True,
    ),
    "rhs dilation, strides (2, 1), SAME": (
        (1, 9, 9, 3),
        (3, 3, 3, 4),
        dict(window_strides=(2, 1), padding="SAME", rhs_dilation=(2, 2), dimension_numbers=NHWC),
        ACT,
        kernel(3, asym=True),
        True,
    ),
    "1-D NCH/OIH explicit padding": (
        (2, 3, 16),
        (4, 3, 5),
        dict(window_strides=(1,), padding=((2, 1),), dimension_numbers=("NCH", "OIH", "NCH")),
        ACT,
        kernel(0, asym=True),
        True,
    ),
    "1-D NWC/WIO SAME stride 2, packed int4 kernel": (
        (2, 16, 3),
        (5, 3, 4),
        dict(window_strides=(2,), padding="SAME", dimension_numbers=("NWC", "WIO", "NWC")),
        ACT_PER_EXAMPLE,
        spec("int4", (2,), pack=True),
        True,
    ),
    # Scales varying along the input features cannot be applied to the output:
    # the op dequantizes first.
    "sub-channel kernel (tiles along I)": (
        (2, 7, 7, 8),
        (3, 3, 8, 6),
        dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC),
        ACT,
        kernel(3, {2: 4}),
        False,
    ),
    "batch_group_count 2": (
        (4, 7, 7, 4),
        (3, 3, 4, 6),
        dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC, batch_group_count=2),
        ACT,
        kernel(3, asym=True),
        False,
    ),
}


# Relative to max |ref| the scaled path (codes convolved, zero points corrected
# with window sums, scales applied to the output) is observed within 4e-7 of the
# float32 HIGHEST reference; 1e-5 leaves margin and catches any padding or
# zero-point mistake (those are >= 1e-2).
@pytest.mark.parametrize("name", CONV_CASES)
def test_conv_matches_lax_on_dequantized_operands(name):
    xshape, kshape, kw, hx, hk, scaled = CONV_CASES[name]
    sides = _sides(hx)

    def run(x, k):
        out = {}
        for side in sides:
            qx = quantize(x, hx) if "x" in side else x
            qk = quantize(k, hk) if "w" in side else k
            dx = dequantize(qx) if "x" in side else x
            dk = dequantize(qk) if "w" in side else k
            y = qcore.conv_general_dilated(qx, qk, **kw)
            out[side] = (y, lax.conv_general_dilated(dx, dk, precision=HIGHEST, **kw), qx, qk)
        return out

    results = jax.jit(run)(normal(xshape, 1, shift=0.5), normal(kshape, 2))
    for side, (y, ref, qx, qk) in results.items():
        assert y.dtype == jnp.float32, side
        assert testing.max_rel_error(y, ref) <= 1e-5, side
        if side == "xw":
            # Two integer operands convolve int8 codes into int32 on the scaled path only.
            convs = testing.primitive_dtypes(
                lambda a, b: qcore.conv_general_dilated(a, b, **kw),
                qx,
                qk,
                name="conv_general_dilated",
            )
            assert (INT8_INTO_INT32 in convs) == scaled, convs


# Argument forms lax.conv_general_dilated accepts besides tuples of Python ints, as
# flax's ConvTranspose and NumPy-computed shapes produce them. id -> (given, canonical)
I64 = np.int64
CONV_FORMS = {
    "NumPy-integer padding pairs and lhs_dilation (ConvTranspose)": (
        dict(padding=((I64(2), I64(1)), (I64(1), I64(2))), lhs_dilation=(I64(2), I64(2))),
        dict(padding=((2, 1), (1, 2)), lhs_dilation=(2, 2)),
    ),
    "padding as a NumPy array": (
        dict(padding=np.array([[1, 0], [2, 1]], np.int32)),
        dict(padding=((1, 0), (2, 1))),
    ),
    "padding as lists, negative": (
        dict(padding=[[0, -1], [1, 1]]),
        dict(padding=((0, -1), (1, 1))),
    ),
    "lower-case padding name": (dict(padding="same_lower"), dict(padding="SAME_LOWER")),
    "strides as a NumPy array": (
        dict(window_strides=np.array([2, 1])),
        dict(window_strides=(2, 1)),
    ),
    "NumPy-integer strides, list rhs_dilation": (
        dict(window_strides=(I64(1), np.int32(2)), rhs_dilation=[2, 1]),
        dict(window_strides=(1, 2), rhs_dilation=(2, 1)),
    ),
    "NumPy-integer feature_group_count": (
        dict(feature_group_count=I64(2), batch_group_count=np.int32(1)),
        dict(feature_group_count=2, batch_group_count=1),
    ),
}


@pytest.mark.parametrize("name", list(CONV_FORMS))
def test_conv_accepts_every_argument_form_lax_accepts(name):
    given, canonical = CONV_FORMS[name]
    groups = canonical.get("feature_group_count", 1)
    x, k = normal((2, 7, 7, 4), 3, shift=0.5), normal((3, 3, 4 // groups, 6), 4)
    base = dict(window_strides=(1, 1), padding="VALID", dimension_numbers=NHWC)
    kq = quantize(k, kernel(3))
    y = qcore.conv_general_dilated(x, kq, **{**base, **given})
    ref = lax.conv_general_dilated(x, dequantize(kq), precision=HIGHEST, **{**base, **canonical})
    assert y.shape == ref.shape
    assert testing.max_rel_error(y, ref) <= 1e-5
    # Plain float operands go straight to lax, with the same forms.
    y = qcore.conv_general_dilated(x, k, precision=HIGHEST, **{**base, **given})
    ref = lax.conv_general_dilated(x, k, precision=HIGHEST, **{**base, **canonical})
    np.testing.assert_array_equal(y, ref)


# -- 6. ragged_dot ------------------------------------------------------------------------------

M, K, G, N = 10, 32, 3, 8

# id -> (activation spec or None, weight spec, group sizes)
RAGGED_CASES = {
    "per-group per-channel weight, empty middle group": (
        None,
        spec("int8", (0, 2)),
        [3, 0, 7],
    ),
    "tiles along k on both sides, empty first and last groups": (
        spec("int8", (0,), {1: 8}),
        spec("int4", (0, 2), {1: 16}),
        [0, 10, 0],
    ),
    "asymmetric activation": (spec("uint8", (0,), asym=True), spec("int8", (0, 2)), [5, 5, 0]),
    "asymmetric weight": (spec("int8", (0,)), spec("int8", (0, 2), asym=True), [2, 3, 5]),
    "asymmetric both, tiled": (
        spec("uint8", (), {1: 16}, asym=True),
        spec("uint8", (0, 2), {1: 8}, asym=True),
        [4, 0, 6],
    ),
    "per-tensor both": (spec("int8"), spec("int8"), [10, 0, 0]),
}


def _np_ragged(x, w, group_sizes):
    """float64 reference: rows of group g times w[g]; rows past the groups are 0."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for g, size in enumerate(group_sizes):
        out[start : start + size] = x[start : start + size] @ w[g]
        start += size
    return out


# Per k-tile int32 or float32 contractions, scaled and summed: observed within
# 2e-7 of both references; 1e-5 catches a scale gathered for the wrong group.
@pytest.mark.parametrize("name", RAGGED_CASES)
def test_ragged_dot_matches_lax_on_dequantized_operands(name):
    hx, hw, sizes = RAGGED_CASES[name]
    group_sizes = jnp.array(sizes, jnp.int32)
    sides = _sides(hx)

    def run(x, w, gs):
        out = {}
        for side in sides:
            qx = quantize(x, hx) if "x" in side else x
            qw = quantize(w, hw) if "w" in side else w
            dx = dequantize(qx) if "x" in side else x
            dw = dequantize(qw) if "w" in side else w
            y = qcore.ragged_dot(qx, qw, gs)
            out[side] = (y, lax.ragged_dot(dx, dw, gs, precision=HIGHEST), dx, dw, qx, qw)
        return out

    results = jax.jit(run)(normal((M, K), 3, shift=0.3), normal((G, K, N), 4), group_sizes)
    for side, (y, ref, dx, dw, qx, qw) in results.items():
        assert y.shape == (M, N) and y.dtype == jnp.float32, side
        assert testing.max_rel_error(y, ref) <= 1e-5, side
        assert testing.max_rel_error(y, _np_ragged(dx, dw, sizes)) <= 1e-5, side
        if side == "xw":
            dots = testing.primitive_dtypes(
                lambda a, b: qcore.ragged_dot(a, b, group_sizes), qx, qw, name="ragged_dot_general"
            )
            # Operands are (lhs, rhs, group_sizes): int8 codes into int32 on every k tile.
            assert dots and all(d[0][:2] == INT8_INTO_INT32[0] for d in dots), dots
            assert all(d[1] == INT8_INTO_INT32[1] for d in dots), dots


def test_ragged_dot_under_jit_leaves_rows_past_the_groups_zero_like_lax():
    # Traced group sizes cannot be checked against the rows; like lax.ragged_dot,
    # rows after the last group are zero.
    x, w = normal((M, K), 5), normal((G, K, N), 6)
    q = quantize(w, spec("int8", (0, 2), asym=True))
    gs = jnp.array([2, 3, 1], jnp.int32)
    y = jax.jit(qcore.ragged_dot)(x, q, gs)
    ref = lax.ragged_dot(x, dequantize(q), gs, precision=HIGHEST)
    assert not np.any(np.asarray(y)[6:]) and not np.any(np.asarray(ref)[6:])
    assert testing.max_rel_error(y, ref) <= 1e-5


def test_ragged_dot_of_plain_arrays_is_lax_ragged_dot():
    x, w = normal((M, K), 7), normal((G, K, N), 8)
    gs = jnp.array([4, 4, 2], jnp.int32)
    np.testing.assert_array_equal(qcore.ragged_dot(x, w, gs), lax.ragged_dot(x, w, gs))


def test_tile_scales_are_broadcast_not_gathered():
    # A weight with sub-channel tiles has its scales repeated up to the weight's
    # shape. jnp.repeat does it with a scatter, a cumsum and a gather (37 ms per step
    # on a small int4 ResNet against float's 14); a broadcast gives the same values.
    w = jax.random.normal(jax.random.key(0), (3, 3, 256, 64))
    qw = quantize(w, HowToQuantize(qtype="int4", channelwise_axes=(3,), tiled_axes={2: 128}))
    x = jax.random.normal(jax.random.key(1), (1, 8, 8, 256))
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(x, qw):
        return qcore.conv_general_dilated(x, qw, (1, 1), "SAME", dimension_numbers=dn)

    text = str(jax.make_jaxpr(conv)(x, qw))
    assert "gather" not in text and "scatter" not in text
    ref = lax.conv_general_dilated(
        np.asarray(x, np.float64),
        np.asarray(dequantize(qw), np.float64),
        (1, 1),
        "SAME",
        dimension_numbers=dn,
    )
    y = np.asarray(conv(x, qw), np.float64)
    assert float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))) < 1e-5

    k = jax.random.normal(jax.random.key(2), (256, 64))
    qk = quantize(k, HowToQuantize(qtype="int8", channelwise_axes=(1,), tiled_axes={0: 64}))
    xs = jax.random.normal(jax.random.key(3), (4, 256))
    text = str(jax.make_jaxpr(qcore.dot)(xs, qk))
    assert "gather" not in text and "scatter" not in text

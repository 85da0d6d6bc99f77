"""Reliability: bad arguments are rejected clearly, extreme values follow the NaN/Inf policy.

Every rejection names the argument, the bad value and what is allowed, and leaves its
inputs untouched (:func:`qcore.testing.assert_rejects`). Extreme values (NaN, ±inf,
float32 max, subnormals, empty arrays, size-1 blocks) are checked against float64
numpy references or against the policy in ``docs/concepts.md``: a block (values sharing
one scale) holding a non-finite value gets a NaN scale and dequantizes to NaN; other
blocks are unaffected.
"""

import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qcore
from qcore import (
    HowToQuantize,
    QArray,
    calibration,
    dequantize,
    fake_quant,
    fake_quant_with_scale,
    numerics,
    packing,
    qtypes,
    quantize,
    quantize_with_scale_zero_point,
)
from qcore.testing import assert_rejects

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)
ALL_QTYPES = sorted(qtypes.BUILTINS)


def _x(shape=(4, 8), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


X = _x()
Q8 = quantize(jnp.asarray(X), HowToQuantize(qtype="int8", channelwise_axes=(0,)))
Q4 = quantize(jnp.asarray(X), HowToQuantize(qtype="int4"))
Q4T = quantize(jnp.asarray(X), HowToQuantize(qtype="int4", tiled_axes={1: 4}))


def _how(**kw):
    return lambda: HowToQuantize(**{"qtype": "int8", **kw})


def _q(x=X, **kw):
    return lambda: quantize(x, HowToQuantize(**{"qtype": "int8", **kw}))


def _qs(x=X, qtype="int8", scale=(1, 1), **kw):
    scale = np.full(scale, 0.1, np.float32) if isinstance(scale, tuple) else scale
    return lambda: quantize_with_scale_zero_point(x, qtype, scale, **kw)


def _arr(values, dtype):
    return np.asarray(values, dtype)


# (id, call, error type, fragments the message must contain)
REJECTS = [
    # qtypes
    ("qtype-unknown", lambda: qtypes.get("int9"), ValueError, ["qtype='int9'", "int8", "nf4"]),
    ("qtype-int", lambda: qtypes.get(8), ValueError, ["qtype=8", "valid names", "int8"]),
    ("qtype-none", lambda: qtypes.get(None), ValueError, ["qtype=None", "valid names"]),
    ("how-qtype", _how(qtype="banana"), ValueError, ["qtype='banana'", "valid names"]),
    # HowToQuantize: axes and tiles
    ("chan-str", _how(channelwise_axes=("a",)), ValueError, ["channelwise_axes", "'a'", "ints"]),
    ("chan-float", _how(channelwise_axes=1.5), ValueError, ["channelwise_axes=1.5", "ints"]),
    ("chan-dup", _how(channelwise_axes=(0, 0)), ValueError, ["channelwise_axes=(0, 0)", "once"]),
    ("tile-zero", _how(tiled_axes={1: 0}), ValueError, ["tiled_axes", "tile 0", "positive int"]),
    ("tile-neg", _how(tiled_axes={1: -4}), ValueError, ["tiled_axes", "-4", "positive int"]),
    ("tile-frac", _how(tiled_axes={1: 1.5}), ValueError, ["tiled_axes", "1.5", "(0, 1)"]),
    ("tile-bool", _how(tiled_axes={1: True}), ValueError, ["tiled_axes", "True", "positive int"]),
    ("tile-key", _how(tiled_axes={"1": 4}), ValueError, ["tiled_axes", "'1'", "int"]),
    ("tile-dup", _how(tiled_axes=[(1, 4), (1, 2)]), ValueError, ["tiled_axes", "axis 1", "once"]),
    ("tile-type", _how(tiled_axes=5), ValueError, ["tiled_axes=5", "mapping"]),
    (
        "tile-chan",
        _how(channelwise_axes=(1,), tiled_axes={1: 4}),
        ValueError,
        ["channelwise_axes=(1,)", "tiled_axes", "one or the other"],
    ),
    # HowToQuantize: other arguments
    ("cal-name", _how(calibration="banana"), ValueError, ["calibration='banana'", "absmax"]),
    ("cal-pct", _how(calibration="percentile,101"), ValueError, ["percentile,101", "(0, 100]"]),
    ("cal-arg", _how(calibration="absmax,x"), ValueError, ["absmax,x", "numbers"]),
    ("cal-fixed", _how(calibration="fixed,1,-1"), ValueError, ["fixed,1,-1", "lo=1.0", "< hi"]),
    (
        "cal-inf",
        _how(calibration="fixed,-inf,inf"),
        ValueError,
        ["fixed,-inf,inf", "'-inf'", "finite"],
    ),
    ("cal-nan", _how(calibration="absmax,nan"), ValueError, ["absmax,nan", "'nan'", "finite"]),
    ("cal-mse", _how(calibration="mse,1"), ValueError, ["steps=1", ">= 2"]),
    ("cal-rms", _how(calibration="rms,0"), ValueError, ["k=0.0", "> 0"]),
    ("cal-type", _how(calibration=5), ValueError, ["calibration=5", "absmax"]),
    ("rounding", _how(rounding="up"), ValueError, ["rounding='up'", "nearest_even"]),
    (
        "rounding-nf4",
        _how(qtype="nf4", rounding="stochastic"),
        ValueError,
        ["rounding='stochastic'", "nf4", "integer qtypes"],
    ),
    ("asym-nf4", _how(qtype="nf4", symmetric=False), ValueError, ["symmetric=False", "'nf4'"]),
    ("symmetric-str", _how(symmetric="no"), ValueError, ["symmetric='no'", "True or False"]),
    ("narrow-int", _how(narrow_range=2), ValueError, ["narrow_range=2", "True or False"]),
    ("pack-str", _how(qtype="int4", pack="yes"), ValueError, ["pack='yes'", "True or False"]),
    ("pack-int8", _how(pack=True), ValueError, ["pack=True", "'int8'", "sub-byte"]),
    ("pack-axis", _how(qtype="int4", pack_axis="x"), ValueError, ["pack_axis='x'", "int"]),
    ("scale-dtype", _how(scale_dtype="banana"), ValueError, ["scale_dtype='banana'", "bfloat16"]),
    ("scale-dtype-int", _how(scale_dtype="int8"), ValueError, ["scale_dtype='int8'", "float32"]),
    # scale_shape / quantize
    ("axis-range", _q(tiled_axes={5: 4}), ValueError, ["tiled_axes", "axis 5", "-2..1"]),
    ("chan-range", _q(channelwise_axes=(2,)), ValueError, ["channelwise_axes", "2", "-2..1"]),
    (
        "tile-same-axis",
        _q(tiled_axes={1: 4, -1: 2}),
        ValueError,
        ["tiled_axes", "1", "-1", "same axis", "once"],
    ),
    (
        "chan-same-axis",
        _q(channelwise_axes=(0, -2)),
        ValueError,
        ["channelwise_axes", "0", "-2", "same axis"],
    ),
    (
        "chan-tile-norm",
        _q(channelwise_axes=(1,), tiled_axes={-1: 4}),
        ValueError,
        ["channelwise_axes", "tiled_axes", "axis 1"],
    ),
    ("tile-divide", _q(tiled_axes={1: 3}), ValueError, ["tile 3", "axis 1", "divisors of 8"]),
    (
        "mx-tile",
        lambda: quantize(_x((4, 64)), HowToQuantize(qtype="mxfp4", tiled_axes={1: 8})),
        ValueError,
        ["'mxfp4'", "32", "tiled_axes"],
    ),
    (
        "x-int",
        lambda: quantize(X.astype(np.int32), HowToQuantize(qtype="int8")),
        ValueError,
        ["x", "int32", "floating"],
    ),
    ("how-str", lambda: quantize(X, "int8"), TypeError, ["how", "'int8'", "HowToQuantize"]),
    (
        "how-dict",
        lambda: qcore.calibrate(X, {"qtype": "int8"}),
        TypeError,
        ["how", "HowToQuantize"],
    ),
    (
        "no-key",
        _q(rounding="stochastic"),
        ValueError,
        ["rounding='stochastic'", "key"],
    ),
    (
        "pack-axis-range",
        _q(qtype="int4", pack=True, pack_axis=4),
        ValueError,
        ["pack_axis", "4", "-2..1"],
    ),
    (
        "mx-scalar",
        lambda: quantize(np.float32(1), HowToQuantize(qtype="mxfp4")),
        ValueError,
        ["'mxfp4'", "block-scaled", "axis"],
    ),
    # quantize_with_scale_zero_point
    ("scale-zero", _qs(scale=np.zeros((1, 1), np.float32)), ValueError, ["scale", "0.0", "> 0"]),
    (
        "scale-neg",
        _qs(scale=np.full((4, 1), -1.0, np.float32)),
        ValueError,
        ["scale", "-1.0", "> 0"],
    ),
    (
        "scale-nan",
        _qs(scale=np.full((1, 8), np.nan, np.float32)),
        ValueError,
        ["scale", "nan", "finite"],
    ),
    (
        "scale-inf",
        _qs(scale=np.array([[np.inf]], np.float32)),
        ValueError,
        ["scale", "inf", "finite"],
    ),
    ("scale-shape", _qs(scale=(3, 1)), ValueError, ["scale shape (3, 1)", "(4, 8)", "divide"]),
    (
        "scale-intdtype",
        _qs(scale=np.ones((1, 1), np.int32)),
        ValueError,
        ["scale", "int32", "float"],
    ),
    (
        "zp-nf4",
        _qs(qtype="nf4", zero_point=np.zeros((1, 1), np.float32)),
        ValueError,
        ["zero_point", "'nf4'", "uniform integer"],
    ),
    (
        "zp-shape",
        _qs(qtype="uint8", zero_point=np.zeros((2, 2), np.float32)),
        ValueError,
        ["zero_point shape (2, 2)", "scale's shape (1, 1)"],
    ),
    (
        "tensor-scale",
        _qs(qtype="nvfp4", scale=(4, 1), tensor_scale=np.zeros((1, 1), np.float32)),
        ValueError,
        ["tensor_scale", "0.0", "> 0"],
    ),
    ("qs-qtype", _qs(qtype="int42"), ValueError, ["qtype='int42'", "valid names"]),
    (
        "qs-rounding",
        _qs(qtype="fp8", rounding="stochastic"),
        ValueError,
        ["rounding='stochastic'", "float8_e4m3fn"],
    ),
    # fake_quant / fake_quant_with_scale
    (
        "fq-scale",
        lambda: fake_quant_with_scale(X, "int8", np.zeros((1, 1), np.float32)),
        ValueError,
        ["scale", "0.0", "> 0"],
    ),
    (
        "fq-block",
        lambda: fake_quant_with_scale(X, "mxfp4", np.ones((4, 1), np.float32)),
        ValueError,
        ["qtype='mxfp4'", "block-scaled", "int*"],
    ),
    (
        "fq-zp",
        lambda: fake_quant_with_scale(X, "fp8", np.ones(1), np.zeros(1)),
        ValueError,
        ["zero_point", "float8_e4m3fn", "uniform integer"],
    ),
    (
        "fq-int",
        lambda: fake_quant(X.astype(np.int8), HowToQuantize(qtype="int8")),
        ValueError,
        ["x", "int8", "floating"],
    ),
    ("fq-how", lambda: fake_quant(X, "int8"), TypeError, ["how", "'int8'", "HowToQuantize"]),
    # dequantize and friends
    ("deq-array", lambda: dequantize(X), TypeError, ["q", "ndarray", "QArray", "quantize"]),
    ("deq-jit", lambda: jax.jit(dequantize)(X), TypeError, ["q", "QArray"]),
    ("deq-dtype", lambda: dequantize(Q8, "banana"), ValueError, ["dtype='banana'", "float32"]),
    ("deq-int", lambda: dequantize(Q8, jnp.int32), ValueError, ["dtype=", "int32", "float"]),
    ("pack-q8", lambda: qcore.pack(Q8), ValueError, ["qtype='int8'", "sub-byte"]),
    ("pack-array", lambda: qcore.pack(X), TypeError, ["q", "QArray"]),
    ("unpack-array", lambda: qcore.unpack(X), TypeError, ["q", "QArray"]),
    ("pack-axis5", lambda: qcore.pack(Q4, axis=5), ValueError, ["axis", "5", "-2..1"]),
    (
        "requant",
        lambda: qcore.requantize(X, HowToQuantize(qtype="int4")),
        TypeError,
        ["q", "QArray"],
    ),
    # QArray construction
    (
        "code-int4",
        lambda: QArray(_arr([[100, 0]], np.int8), np.ones((1, 1), np.float32), qtype="int4"),
        ValueError,
        ["qvalue", "100", "int4", "-8..7"],
    ),
    (
        "code-uint4",
        lambda: QArray(_arr([16, 0], np.uint8), np.ones(1, np.float32), qtype="uint4"),
        ValueError,
        ["qvalue", "16", "0..15"],
    ),
    (
        "code-int1",
        lambda: QArray(_arr([0, 1], np.int8), np.ones(1, np.float32), qtype="int1"),
        ValueError,
        ["qvalue", "0", "-1 or 1"],
    ),
    (
        "code-nf4",
        lambda: QArray(_arr([16, 3], np.uint8), np.ones(1, np.float32), qtype="nf4"),
        ValueError,
        ["qvalue", "16", "0..15"],
    ),
    (
        "code-dtype",
        lambda: QArray(_arr([1], np.int32), np.ones(1, np.float32), qtype="int8"),
        ValueError,
        ["qvalue", "int32", "int8"],
    ),
    (
        "qa-scale-shape",
        lambda: QArray(_arr([[1, 2]], np.int8), np.ones((2, 1), np.float32), qtype="int8"),
        ValueError,
        ["scale shape (2, 1)", "(1, 2)"],
    ),
    (
        "qa-scale-int",
        lambda: QArray(_arr([1], np.int8), np.ones(1, np.int32), qtype="int8"),
        ValueError,
        ["scale", "int32", "float"],
    ),
    (
        "qa-dtype",
        lambda: QArray(_arr([1], np.int8), np.ones(1, np.float32), qtype="int8", dtype="banana"),
        ValueError,
        ["dtype='banana'", "float32"],
    ),
    (
        "qa-zp-range",
        lambda: QArray(
            _arr([1], np.uint8), np.ones(1, np.float32), _arr([20], np.uint8), qtype="uint4"
        ),
        ValueError,
        ["zero_point", "20", "0..15"],
    ),
    (
        "qa-zp-nf4",
        lambda: QArray(
            _arr([1], np.uint8), np.ones(1, np.float32), _arr([0], np.uint8), qtype="nf4"
        ),
        ValueError,
        ["zero_point", "'nf4'", "uniform integer"],
    ),
    (
        "qa-scale-neg",
        lambda: QArray(_arr([1, 1], np.int8), -np.ones(1, np.float32), qtype="int8"),
        ValueError,
        ["scale", "1 values", "-1", "> 0", "NaN"],
    ),
    (
        "qa-scale-zero",
        lambda: QArray(_arr([1, 1], np.int8), np.zeros(2, np.float32), qtype="int8"),
        ValueError,
        ["scale", "2 values", "0", "> 0"],
    ),
    (
        "qa-scale-inf",
        lambda: QArray(_arr([1, 1], np.int8), _arr([np.inf, 1], np.float32), qtype="int8"),
        ValueError,
        ["scale", "1 values", "inf", "finite"],
    ),
    (
        "zp-range",
        lambda: quantize_with_scale_zero_point(
            jnp.ones(3), "int8", jnp.array([1.0]), jnp.array([500])
        ),
        ValueError,
        ["zero_point", "500", "-128..127"],
    ),
    (
        "zp-narrow",
        lambda: quantize_with_scale_zero_point(
            jnp.ones(3), "int8", jnp.array([1.0]), jnp.array([-128]), narrow_range=True
        ),
        ValueError,
        ["zero_point", "-128", "-127..127"],
    ),
    (
        "zp-fraction",
        lambda: quantize_with_scale_zero_point(
            jnp.ones(3), "uint8", jnp.array([1.0]), jnp.array([0.5])
        ),
        ValueError,
        ["zero_point", "0.5", "integers", "0..255"],
    ),
    (
        "cal-rms-arity",
        lambda: HowToQuantize(qtype="int8", calibration="rms"),
        ValueError,
        ["calibration='rms'", "'rms,<k>'", "'rms,3'", "absmax, minmax"],
    ),
    (
        "cal-absmax-huge",
        lambda: HowToQuantize(qtype="int8", calibration="absmax,1e39"),
        ValueError,
        ["calibration='absmax,1e39'", "1e39", "3.4"],
    ),
    (
        "cal-fixed-huge",
        lambda: HowToQuantize(qtype="int8", calibration="fixed,-1e39,1"),
        ValueError,
        ["'-1e39'", "3.4"],
    ),
    ("qa-reshape", lambda: Q8.reshape(5, 7), ValueError, ["(4, 8)", "(5, 7)"]),
    ("qa-slice", lambda: Q4T[:, 1:3], ValueError, ["slice", "axis 1", "tiles of 4"]),
    ("qa-transpose", lambda: Q8.transpose(0, 0), ValueError, ["axes=(0, 0)", "permutation"]),
    ("qa-index", lambda: Q8[jnp.array([0])], ValueError, ["index", "ints and slices"]),
    # calibrators and numerics
    (
        "calibrate-int",
        lambda: qcore.calibrate(X.astype(np.int16), HowToQuantize(qtype="int8")),
        ValueError,
        ["x", "int16", "floating"],
    ),
    (
        "round-mode",
        lambda: numerics.round_values(jnp.ones(2), "up"),
        ValueError,
        ["rounding='up'", "nearest_even"],
    ),
    (
        "round-key",
        lambda: numerics.round_values(jnp.ones(2), "stochastic"),
        ValueError,
        ["stochastic", "key"],
    ),
    (
        "asym-range",
        lambda: numerics.scale_from_range(
            jnp.zeros(1), jnp.ones(1), qtypes.get("fp8"), symmetric=False
        ),
        ValueError,
        ["symmetric=False", "float8_e4m3fn"],
    ),
    # packing
    ("bits", lambda: packing.pack(_arr([1, 2], np.int8), 9), ValueError, ["bits=9", "1..8"]),
    (
        "bits-type",
        lambda: packing.pack(_arr([1, 2], np.int8), 4.0),
        ValueError,
        ["bits=4.0", "int"],
    ),
    (
        "pack-axis3",
        lambda: packing.pack(_arr([1, 2], np.int8), 4, axis=3),
        ValueError,
        ["axis=3", "-1..0"],
    ),
    (
        "unpack-length",
        lambda: packing.unpack(_arr([1, 2], np.uint8), 4, 100),
        ValueError,
        ["length=100", "0..4"],
    ),
    # ops entry points (argument checks only)
    (
        "take-axis",
        lambda: qcore.take(Q8, jnp.array([0]), axis=5),
        ValueError,
        ["axis", "5", "-2..1"],
    ),
    (
        "take-float",
        lambda: qcore.take(Q8, jnp.array([0.5]), axis=0),
        ValueError,
        ["indices", "float32", "integers"],
    ),
    (
        "take-mode",
        lambda: qcore.take(Q8, jnp.array([0]), axis=0, mode="banana"),
        ValueError,
        ["mode='banana'", "'clip'"],
    ),
    (
        "dot-axis",
        lambda: qcore.dot_general(np.ones((3, 8), np.float32), Q8, (((1,), (5,)), ((), ()))),
        ValueError,
        ["contracting", "axis 5", "rank 2"],
    ),
    (
        "matmul-k",
        lambda: qcore.matmul(np.ones((3, 5), np.float32), Q8),
        ValueError,
        ["contracting", "(3, 5)", "(4, 8)"],
    ),
    (
        "ragged",
        lambda: qcore.ragged_dot(np.ones((4, 8), np.float32), Q8, jnp.array([1, 3])),
        ValueError,
        ["ragged_dot", "(groups, k, n)", "(4, 8)"],
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "fragments"), [r[1:] for r in REJECTS], ids=[r[0] for r in REJECTS]
)
def test_bad_arguments_are_rejected_clearly(call, error, fragments):
    assert_rejects(call, error, *fragments, unchanged=(X, Q8, Q4))


def test_there_are_enough_rejection_cases():
    assert len(REJECTS) >= 55


def test_a_nan_scale_is_a_valid_qarray_scale():
    # A NaN scale marks a block that held a non-finite value (the NaN/Inf policy).
    q = QArray(_arr([[1, 2], [3, 4]], np.int8), _arr([[np.nan], [0.5]], np.float32), qtype="int8")
    np.testing.assert_array_equal(np.asarray(dequantize(q)), [[np.nan, np.nan], [1.5, 2.0]])


def test_qarray_scale_check_is_skipped_under_tracing():
    make = jax.jit(lambda s: QArray(jnp.ones(2, jnp.int8), s, qtype="int8").scale)
    np.testing.assert_array_equal(make(jnp.zeros(1)), 0.0)


def test_given_integral_zero_points_in_range_are_kept():
    x = np.array([0.0, 1.0, 2.0], np.float32)
    q = quantize_with_scale_zero_point(x, "uint8", jnp.array([1.0]), jnp.array([255.0]))
    np.testing.assert_array_equal(np.asarray(q.zero_point), [255])
    np.testing.assert_array_equal(np.asarray(q.qvalue), [255, 255, 255])


def test_scale_check_is_skipped_under_tracing():
    # Under jit no error can be raised: a zero scale gives what the arithmetic gives.
    out = jax.jit(lambda s: quantize_with_scale_zero_point(X, "int8", s).scale)(jnp.zeros((1, 1)))
    np.testing.assert_array_equal(out, 0.0)


# -- accepted spellings -------------------------------------------------------------------------


def test_an_int_channelwise_axis_means_that_one_axis():
    assert HowToQuantize(qtype="int8", channelwise_axes=1) == HowToQuantize(
        qtype="int8", channelwise_axes=(1,)
    )
    assert HowToQuantize(qtype="int8", channelwise_axes=np.int64(1)).channelwise_axes == (1,)


# -- item 4: extreme values computed correctly ----------------------------------------------------


@pytest.mark.parametrize(
    "values", [[-3e38, 0.0, 3e38], [-F32_MAX, 1.0, 0.0], [0.0, 1.0, F32_MAX]], ids=str
)
def test_asymmetric_minmax_does_not_overflow_near_float32_max(values):
    x = np.array(values, np.float32)
    for qtype in ("uint8", "int8", "uint4", "int2"):
        how = HowToQuantize(qtype=qtype, calibration="minmax", symmetric=False)
        q = quantize(x, how)
        s = float(np.asarray(q.scale, np.float64).ravel()[0])
        # float64 reference: the scale covers [-3e38, 3e38] with the code range.
        qt = qtypes.get(qtype)
        width = float(np.max(x)) - float(np.min(x))
        np.testing.assert_allclose(s, width / (qt.qmax - qt.qmin), rtol=1e-6)
        err = np.abs(np.asarray(dequantize(q), np.float64) - x.astype(np.float64))
        assert np.all(err <= s / 2 * (1 + 1e-5)), (qtype, err, s)


def _reference(x64, qt):
    """float64 symmetric absmax quantizer for one block (all qtypes but block-scaled)."""
    bound = np.max(np.abs(x64))
    denom = numerics.symmetric_denominator(qt, False)
    s = bound / denom if bound > 0 else 1.0
    v = x64 / s
    if qt.kind == "int":
        return np.clip(np.round(v), qt.qmin, qt.qmax) * s, s
    if qt.kind == "binary":
        return np.where(v >= 0, 1.0, -1.0) * s, s
    if qt.kind == "codebook":
        levels = np.asarray(qt.codebook)
        return levels[np.argmin(np.abs(v[:, None] - levels[None]), axis=1)] * s, s
    dt = getattr(ml_dtypes, qt.storage)
    return np.clip(v, qt.qmin, qt.qmax).astype(dt).astype(np.float64) * s, s


HUGE = [
    [1e38, -1e38, 5e37, -2.5e37],
    [3e38, -1e38, 1e30, -3e38],
    [F32_MAX, -F32_MAX, 1.0, F32_MAX / 3],
]
PLAIN = [q for q in ALL_QTYPES if qtypes.get(q).block_size is None]


@pytest.mark.parametrize("qtype", PLAIN)
@pytest.mark.parametrize("values", HUGE, ids=["1e38", "3e38", "f32max"])
def test_values_near_float32_max_match_the_float64_reference(qtype, values):
    qt = qtypes.get(qtype)
    x = np.array(values, np.float32)
    if not qt.signed:
        x = np.abs(x)
    ref, s = _reference(x.astype(np.float64), qt)
    got = np.asarray(dequantize(quantize(x, HowToQuantize(qtype=qtype))), np.float64)
    assert np.all(np.isfinite(got))
    if qt.kind == "int":
        # -max|x| maps to a tie (-qmax - 0.5): within half a step, not bit-equal.
        # (The float32 scale's rounding, times codes up to 32767 for int16, adds
        # up to 2**-23 of each value.)
        err = np.abs(got - x.astype(np.float64))
        assert np.all(err <= s / 2 * (1 + 1e-5) + np.abs(x) * 2.0**-23), (err, s)
    else:
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=s * 1e-5)


@pytest.mark.parametrize("qtype", ["mxfp8", "mxfp4", "nvfp4"])
def test_block_scaled_types_near_float32_max(qtype):
    x = np.tile(np.array([3e38, -1e38, 2e38, -F32_MAX], np.float32), 8)[None]
    got = np.asarray(dequantize(quantize(x, HowToQuantize(qtype=qtype))), np.float64)
    assert np.all(np.isfinite(got)) and np.all(np.sign(got) == np.sign(x))
    # Within one element step (fp4: 4 -> 6 is 1/3): a top level whose value would
    # overflow float32 is not used, the next one below is.
    np.testing.assert_allclose(got, x.astype(np.float64), rtol=0.34)


@pytest.mark.parametrize("qtype", PLAIN)
def test_subnormal_inputs_dequantize_within_a_subnormal(qtype):
    qt = qtypes.get(qtype)
    x = np.array([1e-45, -1e-45, 0.0, 3e-45], np.float32)
    x = x if qt.signed else np.abs(x)
    got = np.asarray(dequantize(quantize(x, HowToQuantize(qtype=qtype))), np.float64)
    # XLA:CPU flushes subnormals to zero; the result is zero, or ±1.2e-38 for int1
    # (which has no zero level).
    atol = 2 * F32_TINY if qtype == "int1" else 5e-45
    np.testing.assert_allclose(got, x.astype(np.float64), atol=atol, rtol=0)


@pytest.mark.parametrize("qtype", ["int8", "int4", "uint8", "float8_e4m3fn"])
def test_tiny_normal_inputs_keep_their_magnitude(qtype):
    # max|x| / 127.5 is subnormal: the scale becomes the smallest normal float32
    # (not 1.0, which zeroed the block), so each value is within half of that step.
    qt = qtypes.get(qtype)
    x = np.array([1e-37, 5e-38, -2e-38, 3e-38], np.float32)  # all normal
    x = x if qt.signed else np.abs(x)
    q = quantize(x, HowToQuantize(qtype=qtype))
    s = float(np.asarray(q.scale, np.float64)[0])
    want = max(1e-37 / numerics.symmetric_denominator(qt, False), F32_TINY)
    np.testing.assert_allclose(s, want, rtol=1e-6)
    got = np.asarray(dequantize(q), np.float64)
    # The codes are below 16 here, where every qtype tested has steps <= 1.
    assert np.all(np.abs(got - x.astype(np.float64)) <= s / 2 * (1 + 1e-6))


def test_tiled_axes_naming_one_axis_twice_used_to_drop_a_tile():
    assert_rejects(_q(tiled_axes={1: 4, -1: 2}), ValueError, "tiled_axes", "same axis")


@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0,)])
@pytest.mark.parametrize("qtype", ["int8", "int4", "nf4", "float8_e4m3fn", "int1"])
def test_empty_arrays_round_trip(shape, qtype):
    x = np.zeros(shape, np.float32)
    q = quantize(x, HowToQuantize(qtype=qtype))
    assert dequantize(q).shape == shape
    q = quantize_with_scale_zero_point(x, qtype, np.ones((1,) * len(shape), np.float32))
    assert dequantize(q).shape == shape


def test_size_one_blocks_are_per_element():
    x = _x((3, 5), 2)
    x[1, 2] = np.nan
    q = quantize(x, HowToQuantize(qtype="int8", channelwise_axes=(0, 1)))
    got = np.asarray(dequantize(q), np.float64)
    nan = np.isnan(x)
    assert np.array_equal(np.isnan(got), nan)
    # Each element is its own block: |x| maps to 127.5, within half a step |x| / 255;
    # -|x| gets code -128, exactly half a step away, so float32's rounding of the scale
    # and of the product (2**-24 each, relative to |x|) adds up to 255 * 2**-23.
    err = np.abs(got - x.astype(np.float64))[~nan]
    assert np.all(err <= np.abs(x[~nan]) / 255 * (1 + 255 * 2.0**-23))


def test_all_zero_blocks_keep_scale_one():
    for qtype in PLAIN:
        q = quantize(np.zeros((2, 3), np.float32), HowToQuantize(qtype=qtype))
        want = F32_TINY if qtype == "int1" else 1.0
        np.testing.assert_array_equal(np.asarray(q.scale, np.float32), want)


# -- the NaN/Inf policy ---------------------------------------------------------------------------


def test_nan_in_a_per_tensor_block_makes_the_block_nan():
    q = quantize(jnp.array([np.nan, 1.0, -2.0]), HowToQuantize(qtype="int8"))
    assert np.isnan(np.asarray(q.scale)).all()
    assert np.isnan(np.asarray(dequantize(q))).all()


GRANULARITIES = {
    "tensor": {},
    "rows": {"channelwise_axes": (0,)},
    "tiles": {"channelwise_axes": (0,), "tiled_axes": {1: 32}},
}
BAD = {(0, 3): np.nan, (2, 40): np.inf, (3, 63): -np.inf}


def _with_bad(x):
    x = x.copy()
    for at, v in BAD.items():
        x[at] = v
    return x


def _bad_blocks(x, sshape):
    """float64 numpy: which elements lie in a block holding a non-finite value."""
    tiles = [d // s for d, s in zip(x.shape, sshape, strict=True)]
    bad = ~np.isfinite(x)
    for axis, t in enumerate(tiles):
        shape = list(bad.shape)
        split = bad.reshape(*shape[:axis], shape[axis] // t, t, *shape[axis + 1 :])
        bad = np.repeat(split.any(axis=axis + 1), t, axis=axis)
    return bad


def _granular_how(qtype, gran):
    kw = dict(GRANULARITIES[gran])
    if qtypes.get(qtype).block_size:
        kw.pop("tiled_axes", None)
        kw.setdefault("channelwise_axes", (0,))
    return HowToQuantize(qtype=qtype, **kw)


@pytest.mark.parametrize("gran", list(GRANULARITIES))
@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_non_finite_values_make_exactly_their_blocks_nan(qtype, gran):
    clean = _x((4, 64), 1)
    if not qtypes.get(qtype).signed:
        clean = np.abs(clean)
    x = _with_bad(clean)
    how = _granular_how(qtype, gran)
    q = quantize(x, how)
    got = np.asarray(dequantize(q))
    bad = _bad_blocks(x, how.scale_shape(x.shape))
    assert np.isnan(got[bad]).all()
    assert not np.isnan(got[~bad]).any()
    # The other blocks equal quantizing the data with the bad blocks zeroed.
    ref = np.asarray(dequantize(quantize(np.where(bad, 0, clean).astype(np.float32), how)))
    np.testing.assert_array_equal(got[~bad], ref[~bad])
    # fake_quant follows the same rule, bit for bit.
    np.testing.assert_array_equal(np.asarray(fake_quant(x, how)), got)


@pytest.mark.parametrize(
    "cal", ["absmax", "absmax,2", "minmax", "rms,3", "percentile,99", "mse", "fixed,-2,2"]
)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_every_calibrator_gives_a_nan_range_for_a_non_finite_block(cal, bad):
    x = _x((3, 16), 3)
    x[1, 5] = bad
    lo, hi = calibration.parse(cal)(
        jnp.asarray(x), (1,), qtype=qtypes.get("int8"), symmetric=cal != "minmax"
    )
    lo, hi = np.asarray(lo).ravel(), np.asarray(hi).ravel()
    assert np.isnan(lo[1]) and np.isnan(hi[1])
    assert np.all(np.isfinite(lo[[0, 2]])) and np.all(np.isfinite(hi[[0, 2]]))
    if cal == "absmax":
        np.testing.assert_array_equal(hi[[0, 2]], np.abs(x[[0, 2]]).max(axis=1))


def test_a_custom_calibrator_gets_the_rule_too():
    def fixed(x, axes, *, qtype, symmetric=True, narrow_range=False):
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
        return jnp.full(shape, -1.0), jnp.full(shape, 1.0)

    x = _x((3, 16), 3)
    x[2, 0] = np.nan
    got = np.asarray(
        dequantize(
            quantize(x, HowToQuantize(qtype="int8", channelwise_axes=(0,), calibration=fixed))
        )
    )
    assert np.isnan(got[2]).all() and not np.isnan(got[:2]).any()


def test_large_finite_values_keep_finite_ranges():
    # rms and absmax,2 overflowed float32 on finite data (x**2, 2 * max).
    x = np.array([[3e38, -1e38, 2e38, 1.0]], np.float32)
    for cal in ("rms,3", "absmax,2", "mse"):
        q = quantize(x, HowToQuantize(qtype="int8", calibration=cal))
        got = np.asarray(dequantize(q))
        assert np.all(np.isfinite(np.asarray(q.scale))) and np.all(np.isfinite(got)), cal
        assert np.all(np.sign(got[0, :3]) == np.sign(x[0, :3])), cal


SCALE_SHAPES = [(1, 1), (4, 1), (4, 2), (1, 64)]


@pytest.mark.parametrize("sshape", SCALE_SHAPES, ids=str)
@pytest.mark.parametrize("qtype", ["int8", "uint4", "int1", "nf4", "float8_e4m3fn", "fp4"])
def test_given_scale_blocks_with_non_finite_values_get_nan_scales(qtype, sshape):
    qt = qtypes.get(qtype)
    clean = _x((4, 64), 4)
    if not qt.signed:
        clean = np.abs(clean)
    x = _with_bad(clean)
    scale = np.random.default_rng(5).uniform(0.05, 0.5, sshape).astype(np.float32)
    q = quantize_with_scale_zero_point(x, qtype, scale)
    bad_block = _bad_blocks(x, sshape).reshape(sshape[0], 4 // sshape[0], sshape[1], -1)[:, 0, :, 0]
    np.testing.assert_array_equal(np.isnan(np.asarray(q.scale)), bad_block)
    np.testing.assert_array_equal(np.asarray(q.scale)[~bad_block], scale[~bad_block])
    got = np.asarray(dequantize(q), np.float64)
    bad = _bad_blocks(x, sshape)
    assert np.isnan(got[bad]).all() and not np.isnan(got[~bad]).any()
    if qt.kind == "int":  # float64 reference of the other blocks
        s = np.repeat(np.repeat(scale.astype(np.float64), 4 // sshape[0], 0), 64 // sshape[1], 1)
        ref = np.clip(np.round(clean / s), qt.qmin, qt.qmax) * s
        np.testing.assert_allclose(got[~bad], ref[~bad], rtol=1e-6)
    fq = np.asarray(fake_quant_with_scale(x, qtype, scale))
    np.testing.assert_array_equal(fq, got.astype(np.float32))


def test_a_nan_token_gives_a_nan_output_row_only():
    x = _x((4, 16), 6)
    w = _x((16, 5), 7)
    x[2, 3] = np.nan
    act = quantize(x, HowToQuantize(qtype="int8", channelwise_axes=(0,)))
    wq = quantize(w, HowToQuantize(qtype="int8", channelwise_axes=(1,)))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    for out in (qcore.dot_general(act, wq, (((1,), (0,)), ((), ()))), qcore.matmul(x, wq)):
        out = np.asarray(out, np.float64)
        assert np.isnan(out[2]).all() and not np.isnan(out[[0, 1, 3]]).any()
        np.testing.assert_allclose(out[[0, 1, 3]], ref[[0, 1, 3]], rtol=0.05, atol=0.1)


def test_a_nan_in_a_per_tensor_activation_makes_the_whole_output_nan():
    x = _x((4, 16), 6)
    x[1, 1] = np.nan
    act = quantize(x, HowToQuantize(qtype="int8"))
    wq = quantize(_x((16, 5), 7), HowToQuantize(qtype="int8", channelwise_axes=(1,)))
    assert np.isnan(np.asarray(qcore.dot_general(act, wq, (((1,), (0,)), ((), ()))))).all()


def test_nvfp4_tensor_scale_ignores_nan_blocks():
    x = _x((2, 32), 8)
    x[0, 0] = np.nan
    q = quantize(x, HowToQuantize(qtype="nvfp4", channelwise_axes=(0,)))
    assert np.isfinite(np.asarray(q.tensor_scale)).all()
    got = np.asarray(dequantize(q))
    assert np.isnan(got[0, :16]).all() and not np.isnan(got[0, 16:]).any()
    assert not np.isnan(got[1]).any()


def test_jit_and_eager_agree_on_non_finite_input():
    x = _with_bad(_x((4, 64), 9))
    how = HowToQuantize(qtype="int4", channelwise_axes=(0,), tiled_axes={1: 16})
    eager = np.asarray(dequantize(quantize(x, how)))
    jitted = np.asarray(jax.jit(lambda v: dequantize(quantize(v, how)))(x))
    np.testing.assert_array_equal(eager, jitted)


# -- concurrency ----------------------------------------------------------------------------------


def test_quantizing_from_8_threads_is_bit_identical_to_one_thread():
    hows = [
        HowToQuantize(qtype="int8", channelwise_axes=(1,)),
        HowToQuantize(qtype="int4", channelwise_axes=(1,), tiled_axes={0: 16}, pack=True),
        HowToQuantize(qtype="nf4", tiled_axes={1: 32}),
        HowToQuantize(qtype="uint8", symmetric=False, calibration="minmax"),
        HowToQuantize(qtype="mxfp4"),
        HowToQuantize(qtype="float8_e4m3fn", calibration="mse"),
        HowToQuantize(qtype="int8", channelwise_axes=(0,)),
        HowToQuantize(qtype="nvfp4"),
    ]
    xs = [_with_bad(_x((64, 64), 20 + i)) for i in range(8)]

    def run(i):
        q = quantize(xs[i], hows[i])
        return [np.asarray(leaf) for leaf in jax.tree.leaves(q)] + [np.asarray(dequantize(q))]

    want = [run(i) for i in range(8)]
    got: list = [None] * 8
    barrier = threading.Barrier(8)

    def worker(i):
        barrier.wait()
        got[i] = [run(i) for _ in range(3)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        for rep in got[i]:
            for a, b in zip(rep, want[i], strict=True):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_scales_outside_the_scale_dtype_never_become_a_finite_stand_in():
    # float16 scales: 1e10 / 127.5 overflows float16 (was replaced by 1.0, dequantizing
    # to ±127); 1e-7 / 127.5 underflows it and is raised to float16's smallest normal.
    how = HowToQuantize(qtype="int8", scale_dtype="float16")
    big = dequantize(quantize(np.array([1e10, -5e9], np.float32), how))
    assert not np.isfinite(np.asarray(big)).any()
    x = np.array([1e-7, -3e-8, 2e-8], np.float32)
    q = quantize(x, how)
    s = float(np.asarray(q.scale, np.float64)[0])
    assert s == float(np.finfo(np.float16).tiny)
    err = np.abs(np.asarray(dequantize(q), np.float64) - x.astype(np.float64))
    assert np.all(err <= s / 2 * (1 + 1e-3))


# -- documented limits (docs/concepts.md, "Non-finite values and degenerate blocks") ------------


def test_limit_asymmetric_values_at_float32_max_can_round_to_inf():
    x = np.array([F32_MAX, 0.0, -F32_MAX, 1.0], np.float32)
    sym = np.asarray(dequantize(quantize(x, HowToQuantize(qtype="int8"))), np.float64)
    assert np.all(np.abs(sym - x.astype(np.float64)) <= F32_MAX / 127 / 2)
    out = np.asarray(dequantize(quantize(x, HowToQuantize(qtype="int8", symmetric=False))))
    assert out[2] == -np.inf and np.isfinite(out[[0, 1, 3]]).all()


def test_limit_float16_scales_overflow_to_nan_and_underflow_to_zero():
    how = HowToQuantize(qtype="int8", scale_dtype="float16")
    f16_max, f16_tiny = float(np.finfo(np.float16).max), float(np.finfo(np.float16).tiny)
    fits = np.array([f16_max * 127 * 0.99, 1.0], np.float32)
    assert np.isfinite(np.asarray(dequantize(quantize(fits, how)))).all()
    big = np.array([f16_max * 127 * 1.01, 1.0], np.float32)
    assert np.isnan(np.asarray(dequantize(quantize(big, how)))).all()
    small = np.array([0.99 * f16_tiny / 2, -1e-6, 1e-7], np.float32)
    np.testing.assert_array_equal(np.asarray(dequantize(quantize(small, how))), 0.0)


def test_limit_products_near_float32_max_can_overflow():
    x = np.array([[3e38, 1.0]], np.float32)
    w = np.array([[0.5], [0.1]], np.float32)
    assert np.isfinite(x.astype(np.float64) @ w.astype(np.float64)).all()  # 1.5e38
    act = quantize(x, HowToQuantize(qtype="int8", channelwise_axes=(0,)))
    wq = quantize(w, HowToQuantize(qtype="int8", channelwise_axes=(1,)))
    out = qcore.dot_general(act, wq, (((1,), (0,)), ((), ())))
    assert np.asarray(out)[0, 0] == np.inf

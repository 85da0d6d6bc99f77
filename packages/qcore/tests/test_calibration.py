"""Calibrators against float64 numpy references, and the string parser."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qcore import calibration, numerics, qtypes

INT8 = qtypes.get("int8")
RNG = np.random.default_rng(0)
X = RNG.standard_normal((6, 50)).astype(np.float32) * 3 + 0.5


def run(cal, x=X, axes=(1,), **kw):
    lo, hi = calibration.parse(cal)(jnp.asarray(x), axes, qtype=kw.pop("qtype", INT8), **kw)
    return np.asarray(lo, np.float64), np.asarray(hi, np.float64)


def test_absmax_and_clip():
    ref = np.max(np.abs(X), axis=1, keepdims=True)
    lo, hi = run("absmax")
    np.testing.assert_allclose(hi, ref, rtol=1e-6)
    np.testing.assert_allclose(lo, -ref, rtol=1e-6)
    np.testing.assert_allclose(run("absmax,0.9")[1], 0.9 * ref, rtol=1e-6)


def test_minmax_includes_zero():
    x = np.abs(X) + 1.0  # all positive: the range must still reach 0
    lo, hi = run("minmax", x)
    np.testing.assert_array_equal(lo, 0.0)
    np.testing.assert_allclose(hi, np.max(x, axis=1, keepdims=True), rtol=1e-6)
    lo, _ = run("minmax", X)
    np.testing.assert_allclose(lo, np.minimum(X.min(axis=1, keepdims=True), 0), rtol=1e-6)


def test_rms():
    ref = 7 * np.sqrt(np.mean(X.astype(np.float64) ** 2, axis=1, keepdims=True))
    np.testing.assert_allclose(run("rms,7")[1], ref, rtol=1e-5)


def test_fixed():
    lo, hi = run("fixed,-6,6")
    assert lo.shape == hi.shape == (6, 1)
    np.testing.assert_array_equal(lo, -6)
    np.testing.assert_array_equal(hi, 6)


def test_percentile_symmetric_and_asymmetric():
    ref = np.percentile(np.abs(X), 99, axis=1, keepdims=True)
    np.testing.assert_allclose(run("percentile,99")[1], ref, rtol=1e-5)
    lo, hi = run("percentile,90", symmetric=False)
    np.testing.assert_allclose(lo, np.percentile(X, 10, axis=1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(hi, np.percentile(X, 90, axis=1, keepdims=True), rtol=1e-5)


def test_reduction_over_several_axes():
    x = RNG.standard_normal((4, 5, 6)).astype(np.float32)
    lo, hi = run("percentile,50", x, axes=(0, 2))
    assert hi.shape == (1, 5, 1)
    ref = np.percentile(np.abs(x), 50, axis=(0, 2), keepdims=True)
    np.testing.assert_allclose(hi, ref, rtol=1e-5)


def _error(x, lo, hi, qtype, symmetric=True):
    scale, zp = numerics.scale_from_range(lo, hi, qtype, symmetric=symmetric)
    shift = 0.0 if zp is None else np.asarray(zp)
    codes = numerics.encode(jnp.asarray(x) / scale + shift, qtype)
    xq = (np.asarray(numerics.decode(codes, qtype)) - shift) * np.asarray(scale)
    return np.sum((xq - x) ** 2, axis=1)


@pytest.mark.parametrize("qtype", ["int4", "int3", "nf4", "float4_e2m1fn"])
def test_mse_never_worse_than_absmax_and_usually_better(qtype):
    qt = qtypes.get(qtype)
    x = RNG.standard_normal((32, 256)).astype(np.float32)
    e_abs = _error(x, *run("absmax", x, qtype=qt), qt)
    e_mse = _error(x, *run("mse", x, qtype=qt), qt)
    assert np.all(e_mse <= e_abs * (1 + 1e-6))
    assert np.mean(e_mse) < 0.95 * np.mean(e_abs)


def test_mse_asymmetric():
    qt = qtypes.get("uint4")
    x = RNG.standard_normal((16, 256)).astype(np.float32) + 1.0
    e_mm = _error(x, *run("minmax", x, qtype=qt, symmetric=False), qt, symmetric=False)
    lo, hi = run("mse", x, qtype=qt, symmetric=False)
    assert np.all(_error(x, lo, hi, qt, symmetric=False) <= e_mm * (1 + 1e-6))


@pytest.mark.parametrize(
    "cal", ["absmax", "minmax", "rms,3", "percentile,99", "mse", "fixed,-1,1", "absmax,0.5"]
)
def test_a_block_holding_a_non_finite_value_gets_a_nan_range(cal):
    # The NaN/Inf policy: rows 1-3 hold inf, -inf, NaN; rows 0, 4, 5 are finite and
    # get the range they get on their own.
    x = X.copy()
    x[1, 3] = np.inf
    x[2, 4] = -np.inf
    x[3, 5] = np.nan
    lo, hi = run(cal, x)
    assert np.isnan(lo[1:4]).all() and np.isnan(hi[1:4]).all()
    lo_ref, hi_ref = run(cal, X[[0, 4, 5]])
    np.testing.assert_array_equal(lo[[0, 4, 5]], lo_ref)
    np.testing.assert_array_equal(hi[[0, 4, 5]], hi_ref)


@pytest.mark.parametrize("cal", ["absmax", "minmax"])
def test_non_finite_blocks_under_jit_and_vmap(cal):
    # Every path must give the float64 range of finite blocks and NaN for the others.
    x = np.stack([X, X.copy(), X.copy()])
    x[1, :, 3] = np.inf
    x[2, 2, 0] = np.nan
    x64 = x.astype(np.float64)
    if cal == "absmax":
        hi_ref = np.max(np.abs(x64), axis=2, keepdims=True)
        lo_ref = -hi_ref
    else:
        lo_ref = np.minimum(x64.min(axis=2, keepdims=True), 0.0)
        hi_ref = np.maximum(x64.max(axis=2, keepdims=True), 0.0)
    bad = ~np.isfinite(x).all(axis=2, keepdims=True)
    lo_ref[bad], hi_ref[bad] = np.nan, np.nan
    c = calibration.parse(cal)
    qt = qtypes.get("int8")
    one = jax.jit(lambda v: c(v, (1,), qtype=qt, symmetric=cal == "absmax"))
    for got in (one(jnp.asarray(x.reshape(-1, x.shape[2]))), jax.vmap(one)(jnp.asarray(x))):
        lo, hi = (np.asarray(a).reshape(lo_ref.shape) for a in got)
        np.testing.assert_array_equal(lo, lo_ref)
        np.testing.assert_array_equal(hi, hi_ref)


def test_all_nan_block_gives_a_nan_range():
    x = np.full((2, 8), np.nan, np.float32)
    for cal in ("absmax", "minmax", "rms,2", "percentile,99", "mse"):
        lo, hi = run(cal, x)
        assert np.isnan(lo).all() and np.isnan(hi).all(), cal


def test_mse_string_arguments():
    assert calibration.parse("mse,64,0.1") == calibration.Mse(64, 0.1)
    assert calibration.parse("mse") == calibration.Mse(32, 0.3)


def test_mse_for_binary_is_the_closed_form_mean_abs():
    # For int1 the codes are sign(x), so sum((|x| - s)^2) is minimal at s = mean|x|.
    lo, hi = run("mse", qtype=qtypes.get("int1"))
    np.testing.assert_allclose(hi, np.mean(np.abs(X), axis=1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(lo, -hi)


def test_callables_pass_through():
    cal = calibration.Fixed(-1.0, 2.0)
    assert calibration.parse(cal) is cal


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("absmx", r"calibration='absmx': unknown method 'absmx'; allowed: absmax, minmax"),
        ("absmax,0", r"calibration='absmax,0': clip=0.0 must be > 0"),
        ("absmax,a", r"calibration='absmax,a': arguments \['a'\] must be numbers"),
        ("rms", r"calibration='rms': 'rms' takes 1 argument"),
        ("rms,-1", r"k=-1.0 must be > 0"),
        ("fixed,6,-6", r"lo=6.0 must be < hi=-6.0"),
        ("fixed,1,2,3", r"'fixed' takes 1 or 2 argument"),
        ("fixed,-1", r"bound=-1.0 must be > 0 \('fixed,<bound>' is the range -bound..bound\)"),
        ("percentile,0", r"q=0.0 must be in \(0, 100\]"),
        ("mse,1.5", r"steps=1.5 must be an integer >= 2"),
        ("mse,8,1.5", r"min_ratio=1.5 must be in \(0, 1\)"),
        ("mse,8,0.1,3", r"'mse' takes 0 or 1 or 2 argument"),
        ("minmax,2", r"'minmax' takes 0 argument"),
        (3.0, r"calibration=3.0 must be a string"),
    ],
)
def test_parse_errors_name_the_value(text, match):
    with pytest.raises(ValueError, match=match):
        calibration.parse(text)

"""Where qcore follows Qwix 0.1.8 (issue 20, item 9), checked without importing Qwix.

Qwix's own results are recorded in ``fixtures/qwix_parity.json`` by
``benchmarks/qwix_parity.py`` (its docstring has the command line); every other reference
is the dequantized float64 value.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcore
from qcore import HowToQuantize, calibration, dequantize, quantize, testing

QWIX = json.loads((pathlib.Path(__file__).parent / "fixtures" / "qwix_parity.json").read_text())
assert QWIX["qwix"] == "0.1.8"


def _values(shape, offset=0.0):
    """The fixture script's deterministic inputs."""
    n = int(np.prod(shape))
    return (np.sin(np.arange(n) * 0.7 + offset) * 3.0).astype(np.float32).reshape(shape)


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


# -- "fixed,N" calibration -------------------------------------------------------------


@pytest.mark.parametrize("method", sorted(QWIX["calibrations"]))
def test_fixed_calibration_strings_give_qwix_codes(method):
    want = QWIX["calibrations"][method]
    # Qwix makes a range symmetric about 0 symmetric; qcore says so with symmetric=.
    how = HowToQuantize(qtype="int8", calibration=method, symmetric=want["zero_point"] is None)
    q = quantize(jnp.asarray(QWIX["x"], jnp.float32), how)
    np.testing.assert_array_equal(np.asarray(q.qvalue), want["qvalue"])
    np.testing.assert_allclose(_f64(q.scale).ravel(), want["scale"], rtol=1e-7)
    zp = None if q.zero_point is None else np.asarray(q.zero_point).ravel().tolist()
    assert zp == want["zero_point"]


@pytest.mark.parametrize("bound", [3.0, 0.5, 6.0, 1e-3])
def test_fixed_with_one_number_is_the_range_minus_n_to_n(bound):
    assert calibration.parse(f"fixed,{bound}") == calibration.Fixed(-bound, bound)
    x = _values((5, 7))
    q = quantize(jnp.asarray(x), HowToQuantize(qtype="int8", calibration=f"fixed,{bound}"))
    # Closed form: one scale bound / 127.5 for the tensor, codes rounded half to even.
    scale = np.float64(np.float32(bound) / np.float32(127.5))  # as float32 divides
    codes = np.clip(np.round(x.astype(np.float64) / scale), -128, 127)
    np.testing.assert_array_equal(np.asarray(q.qvalue, np.float64), codes)
    np.testing.assert_allclose(_f64(q.scale), scale, rtol=2.5e-7)  # 2 float32 ulps


@pytest.mark.parametrize("method", sorted(QWIX["refused"]))
def test_fixed_bounds_qwix_refuses_are_refused(method):
    assert QWIX["refused"][method] is not None  # Qwix raised too
    bound = float(method.split(",")[1])
    with pytest.raises(ValueError, match=rf"calibration='{method}': bound={bound} must be > 0"):
        calibration.parse(method)


# -- QArray views ------------------------------------------------------------------------

VIEWS = {
    "[None]": lambda q: q[None],
    "[:, None]": lambda q: q[:, None],
    "[..., None]": lambda q: q[..., None],
    "[None, ..., None]": lambda q: q[None, ..., None],
    "[1, None]": lambda q: q[1, None],
    "[None, 1:3]": lambda q: q[None, 1:3],
    "mT": lambda q: q.mT,
    "swapaxes(0, 2)": lambda q: q.swapaxes(0, 2),
}
ARRAY_VIEWS = {
    "[None]": lambda a: a[None],
    "[:, None]": lambda a: a[:, None],
    "[..., None]": lambda a: a[..., None],
    "[None, ..., None]": lambda a: a[None, ..., None],
    "[1, None]": lambda a: a[1, None],
    "[None, 1:3]": lambda a: a[None, 1:3],
    "mT": lambda a: np.swapaxes(a, -2, -1),
    "swapaxes(0, 2)": lambda a: np.swapaxes(a, 0, 2),
}


@pytest.fixture(scope="module")
def q486():
    how = HowToQuantize(qtype="int8", channelwise_axes=(0,), tiled_axes={1: 4})
    return quantize(jnp.asarray(_values((4, 8, 6))), how)


def test_scale_tile_shape_matches_qwix(q486):
    base = QWIX["qarray_views"]["base"]
    assert q486.scale.shape == tuple(base["scale_shape"])
    assert q486.scale_tile_shape == tuple(base["scale_tile_shape"]) == (1, 4, 6)
    assert q486.zero_point_tile_shape is None


@pytest.mark.parametrize("name", VIEWS)
def test_views_match_qwix_and_the_dequantized_reference(q486, name):
    view = VIEWS[name](q486)
    want = QWIX["qarray_views"][name]
    assert view.shape == tuple(want["shape"])
    assert view.scale.shape == tuple(want["scale_shape"])
    assert view.scale_tile_shape == tuple(want["scale_tile_shape"])
    ref = ARRAY_VIEWS[name](_f64(dequantize(q486)))
    np.testing.assert_array_equal(_f64(dequantize(view)), ref)


def test_none_index_keeps_zero_points_and_tensor_scales():
    x = jnp.asarray(_values((6, 32)))
    asym = quantize(x, HowToQuantize(qtype="uint8", channelwise_axes=(0,), symmetric=False))
    v = asym[None, 2:5, None]
    assert v.zero_point is not None and v.zero_point.shape == v.scale.shape == (1, 3, 1, 1)
    assert v.zero_point_tile_shape == (1, 1, 1, 32)
    np.testing.assert_array_equal(_f64(dequantize(v)), _f64(dequantize(asym))[None, 2:5, None])
    nv = quantize(x, HowToQuantize(qtype="nvfp4"))
    w = nv[:, None]
    assert w.tensor_scale is not None and w.tensor_scale.shape == (1, 1, 1)
    np.testing.assert_array_equal(_f64(dequantize(w)), _f64(dequantize(nv))[:, None])


def test_view_errors_name_the_argument(q486):
    with pytest.raises(ValueError, match=r"mT needs a QArray of rank >= 2, got shape \(8,\)"):
        _ = q486[0, :, 0].mT
    with pytest.raises(ValueError, match=r"axis2: axis 3 is out of range .* allowed: -3..2"):
        q486.swapaxes(0, 3)
    with pytest.raises(ValueError, match=r"supports up to 3 ints and slices, None"):
        q486[0, 0, 0, 0]
    with pytest.raises(ValueError, match="cuts its tiles of 4"):
        q486[None, :, 1:3]


def test_packed_qarray_mt_and_swapaxes_keep_the_packing():
    x = jnp.asarray(_values((3, 8, 16)))
    q = quantize(x, HowToQuantize(qtype="int4", channelwise_axes=(0, 1), pack=True))
    ref = _f64(dequantize(q))
    np.testing.assert_array_equal(_f64(dequantize(q.mT)), np.swapaxes(ref, -2, -1))
    np.testing.assert_array_equal(_f64(dequantize(q.swapaxes(0, 1))), np.swapaxes(ref, 0, 1))
    assert q.mT.packing == qcore.Packing(-2, 16)


# -- astype --------------------------------------------------------------------------------


def test_astype_changes_the_dequantized_and_result_dtype(q486):
    q16 = q486.astype(jnp.bfloat16)
    want = QWIX["qarray_views"]["astype(bfloat16)"]
    assert str(q16.dtype) == want["dtype"] and q16.scale.shape == tuple(want["scale_shape"])
    assert q16.scale.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(q16.qvalue), np.asarray(q486.qvalue))
    d16 = dequantize(q16)
    assert d16.dtype == jnp.bfloat16
    # A bf16 scale is within bf16's unit roundoff (2**-8) of the float32 one, and the
    # product is rounded to bf16 once more.
    np.testing.assert_allclose(_f64(d16), _f64(dequantize(q486)), rtol=2**-7, atol=0)
    x = jnp.asarray(_values((5, 6), 2.0)).astype(jnp.bfloat16)
    y = qcore.einsum("bk,ijk->bij", x, q16)
    assert y.dtype == jnp.bfloat16
    ref = np.einsum("bk,ijk->bij", _f64(x), _f64(d16))
    assert testing.max_rel_error(y, ref) < 2**-7
    assert q16.astype("float32").dtype == jnp.float32


def test_astype_keeps_block_scales_and_packing():
    x = jnp.asarray(_values((4, 64)))
    mx = quantize(x, HowToQuantize(qtype="mxfp4", pack=True))
    m16 = mx.astype(jnp.bfloat16)
    assert m16.scale.dtype == jnp.float8_e8m0fnu and m16.packing == mx.packing
    assert m16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_f64(dequantize(m16)), _f64(dequantize(mx).astype(jnp.bfloat16)))


@pytest.mark.parametrize("dtype", ["int8", jnp.bool_, "nonsense"])
def test_astype_refuses_non_float_dtypes(q486, dtype):
    with pytest.raises(ValueError, match=r"dtype=.* is not a floating-point dtype; allowed:"):
        q486.astype(dtype)


# -- bool operands -------------------------------------------------------------------------


def test_codes_match_qwix_but_minus_bound_always_gets_qmin():
    """The one documented difference in int8 codes: ``-bound`` gets ``-128``.

    Both map the bound to 127.5, so ``-bound`` lands on the tie -127.5 up to float32
    rounding; Qwix rounds it to -127 or -128 by the bound's last bits (-127 in both
    of this weight's columns whose bound is negative), qcore always to -128.
    """
    want = QWIX["bool_operand"]["weight"]
    w = _values((6, 3), 1.0)
    q = quantize(jnp.asarray(w), HowToQuantize(qtype="int8", channelwise_axes=1))
    np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(want["scale"], np.float32))
    codes, qwix = np.asarray(q.qvalue, np.int64), np.asarray(want["qvalue"])
    at_minus_bound = w == -np.abs(w).max(axis=0)
    assert at_minus_bound.sum() == 2 and np.all(qwix[at_minus_bound] == -127)
    np.testing.assert_array_equal(codes[at_minus_bound], -128)
    np.testing.assert_array_equal(codes[~at_minus_bound], qwix[~at_minus_bound])


@pytest.mark.parametrize("wdtype", ["float32", "bfloat16"])
def test_bool_operand_times_qarray_matches_qwix(wdtype):
    fixture = QWIX["bool_operand"]
    mask = jnp.asarray(np.array(fixture["mask"], bool))
    weight = fixture["weight"]  # Qwix's codes (see the test above)
    qw = qcore.QArray(
        jnp.asarray(weight["qvalue"], jnp.int8),
        jnp.asarray(weight["scale"], jnp.float32),
        qtype="int8",
    )
    qw = qw.astype(wdtype)
    ref = np.asarray(fixture["mask"], np.float64) @ _f64(dequantize(qw))
    want = fixture["results"][wdtype]
    tol = 1e-6 if wdtype == "float32" else 2**-7
    results = {
        "dot_general": qcore.dot_general(mask, qw, (((1,), (0,)), ((), ()))),
        "einsum": qcore.einsum("ij,jk->ik", mask, qw),
        "matmul": qcore.matmul(mask, qw),
        "dot": qcore.dot(mask, qw),
        "rhs": qcore.dot_general(qw.T, mask.T, (((1,), (0,)), ((), ()))).T,
    }
    for name, y in results.items():
        assert str(y.dtype) == want["dtype"] == wdtype, name
        assert testing.max_rel_error(y, ref) < tol, name
        qwix = want.get(name, want["dot_general"])
        np.testing.assert_allclose(_f64(y), qwix, rtol=tol, atol=tol, err_msg=name)


def test_bool_operand_in_conv_and_ragged_dot():
    img = jnp.asarray(_values((1, 5, 5, 2)) > 0)
    k = quantize(
        jnp.asarray(_values((3, 3, 2, 4), 0.5)), HowToQuantize(qtype="int8", channelwise_axes=3)
    )
    dn = ("NHWC", "HWIO", "NHWC")
    y = qcore.conv_general_dilated(img, k, (1, 1), "SAME", dimension_numbers=dn)
    ref = jax.lax.conv_general_dilated(
        img.astype(jnp.float32),
        dequantize(k),
        (1, 1),
        "SAME",
        dimension_numbers=dn,
        precision="highest",
    )
    assert y.dtype == jnp.float32
    assert testing.max_rel_error(y, _f64(ref)) < 1e-5
    groups = jnp.asarray(_values((2, 6, 3), 1.5))
    qg = quantize(groups, HowToQuantize(qtype="int8", channelwise_axes=(0, 2)))
    rows = jnp.asarray(_values((5, 6), 2.5) > 0)
    sizes = jnp.array([2, 3])
    y = qcore.ragged_dot(rows, qg, sizes)
    d = _f64(dequantize(qg))
    r = _f64(rows)
    ref = np.concatenate([r[:2] @ d[0], r[2:] @ d[1]])
    assert y.dtype == jnp.float32
    assert testing.max_rel_error(y, ref) < 1e-6


# -- block-scaled types: blocks along a reduced axis -------------------------------------


@pytest.mark.parametrize(
    ("shape", "channel", "scale_shape"),
    [
        ((64, 16), (1,), (2, 16)),  # a Dense kernel: blocks along the contracted axis 0
        ((4, 64, 16), (0, 2), (4, 2, 16)),
        ((16, 64), (0,), (16, 2)),
        ((64, 2, 8), (), None),  # nothing channelwise: the last axis, of 8: refused
    ],
)
def test_mx_blocks_go_along_the_innermost_non_channelwise_axis(shape, channel, scale_shape):
    if shape[-1] % 32 and not channel:
        with pytest.raises(ValueError, match=r"tile 32 of axis 2 must divide its size 8"):
            HowToQuantize(qtype="mxfp8", channelwise_axes=channel).scale_shape(shape)
        return
    how = HowToQuantize(qtype="mxfp8", channelwise_axes=channel)
    assert how.scale_shape(shape) == scale_shape
    x = _values(shape).astype(np.float64)
    q = quantize(jnp.asarray(x, jnp.float32), how)
    # Closed form: one power-of-two scale per block of 32, 2**ceil(log2(max|x| / 448)).
    axis = next(a for a in reversed(range(len(shape))) if a not in channel)
    blocks = np.moveaxis(x, axis, -1)
    blocks = blocks.reshape(*blocks.shape[:-1], -1, 32)
    want = np.exp2(np.ceil(np.log2(np.abs(blocks).max(-1) / 448.0)))
    np.testing.assert_array_equal(np.moveaxis(_f64(q.scale), axis, -1), want)
    assert testing.max_rel_error(dequantize(q), x) < 0.07


def test_mx_with_every_axis_channelwise_is_refused():
    how = HowToQuantize(qtype="mxfp8", channelwise_axes=(0, 1))
    with pytest.raises(ValueError, match=r"qtype='mxfp8' is block-scaled; it needs an axis"):
        how.scale_shape((4, 32))

"""qcore.take: table lookup on QArrays equals dequantize-then-take, exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcore
from qcore import HowToQuantize

TABLE = jax.random.normal(jax.random.key(0), (12, 16)) * jnp.linspace(0.2, 3.0, 16)
IDS = jnp.array([[3, 0, 11], [7, 7, 1]])

SPECS = {
    "int8 per row": HowToQuantize(qtype="int8", channelwise_axes=(0,)),
    "int8 per tensor": HowToQuantize(qtype="int8"),
    "int8 per column": HowToQuantize(qtype="int8", channelwise_axes=(1,)),
    "int4 row tiles, packed along the row": HowToQuantize(
        qtype="int4", channelwise_axes=(0,), tiled_axes={1: 4}, pack=True, pack_axis=1
    ),
    "int4 per row, packed along the gathered axis": HowToQuantize(
        qtype="int4", channelwise_axes=(0,), pack=True, pack_axis=0
    ),
    "int4 row-pair tiles": HowToQuantize(qtype="int4", tiled_axes={0: 2, 1: 8}),
    "nf4 row tiles, packed": HowToQuantize(
        qtype="nf4", channelwise_axes=(0,), tiled_axes={1: 8}, pack=True
    ),
    "uint4 asymmetric, packed": HowToQuantize(
        qtype="uint4", channelwise_axes=(0,), symmetric=False, pack=True
    ),
    "int3 packed along the gathered axis": HowToQuantize(
        qtype="int3", channelwise_axes=(0,), pack=True, pack_axis=0
    ),
    "float8_e4m3fn per row": HowToQuantize(qtype="float8_e4m3fn", channelwise_axes=(0,)),
    "float4_e2m1fn packed": HowToQuantize(qtype="float4_e2m1fn", channelwise_axes=(0,), pack=True),
}


def _reference(q, ids, axis=0, **kw):
    return jnp.take(qcore.dequantize(q), ids, axis=axis, **kw)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_equals_dequantize_then_take(name, axis):
    q = qcore.quantize(TABLE, SPECS[name])
    ids = IDS if axis == 0 else jnp.array([15, 0, 4, 9])
    np.testing.assert_array_equal(qcore.take(q, ids, axis=axis), _reference(q, ids, axis=axis))


@pytest.mark.parametrize("mode", [None, "fill", "clip", "wrap"])
@pytest.mark.parametrize("name", ["int8 per row", "int4 per row, packed along the gathered axis"])
def test_out_of_range_follows_jnp_take(mode, name):
    q = qcore.quantize(TABLE, SPECS[name])
    ids = jnp.array([-13, -12, -1, 0, 11, 12, 40])
    got = qcore.take(q, ids, mode=mode)
    np.testing.assert_array_equal(got, _reference(q, ids, mode=mode))
    if mode in (None, "fill"):  # the documented default: NaN rows
        assert np.isnan(np.asarray(got)[[0, 5, 6]]).all()
        assert not np.isnan(np.asarray(got)[[1, 2, 3, 4]]).any()
    custom = qcore.take(q, ids, mode="fill", fill_value=-2.5)
    np.testing.assert_array_equal(custom, _reference(q, ids, mode="fill", fill_value=-2.5))


def test_float64_reference_per_row_int8():
    # Independent of qcore.dequantize: codes * scale in float64, rows picked by numpy.
    q = qcore.quantize(TABLE, SPECS["int8 per row"])
    ref = np.asarray(q.qvalue, np.float64) * np.asarray(q.scale, np.float64)
    got = qcore.take(q, IDS)
    np.testing.assert_allclose(np.asarray(got, np.float64), ref[np.asarray(IDS)], rtol=1e-7)
    assert got.dtype == jnp.float32


def test_jit_vmap_and_dtype():
    q = qcore.quantize(TABLE, SPECS["int4 row tiles, packed along the row"])
    jitted = jax.jit(qcore.take, static_argnames=("axis", "mode"))
    np.testing.assert_array_equal(jitted(q, IDS), _reference(q, IDS))
    batched = jax.vmap(lambda i: qcore.take(q, i))(IDS)  # over a batch of id rows
    np.testing.assert_array_equal(batched, _reference(q, IDS))
    tables = jax.vmap(lambda t: qcore.quantize(t, SPECS["int8 per row"]))(
        jnp.stack([TABLE, 2 * TABLE])
    )  # over a stack of tables
    stacked = jax.vmap(lambda t: qcore.take(t, IDS[0]))(tables)
    for i in range(2):
        one = jax.tree.map(lambda x, i=i: x[i], tables)
        np.testing.assert_array_equal(stacked[i], _reference(one, IDS[0]))
    assert qcore.take(q, IDS, dtype=jnp.bfloat16).dtype == jnp.bfloat16


def test_only_requested_rows_are_dequantized():
    # No value of the table's full float shape appears in the computation.
    big = jax.random.normal(jax.random.key(1), (1000, 64))
    for name in ("int8 per row", "nf4 row tiles, packed", "int3 packed along the gathered axis"):
        q = qcore.quantize(big, SPECS[name])
        jaxpr = jax.make_jaxpr(lambda q, i: qcore.take(q, i))(q, jnp.array([5, 999]))
        shapes = _all_shapes(jaxpr.jaxpr)
        assert (1000, 64) not in shapes and (64, 1000) not in shapes, name


def _all_shapes(jaxpr):
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes |= {tuple(v.aval.shape) for v in eqn.outvars}
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    shapes |= _all_shapes(sub)
    return shapes


def test_bad_arguments():
    q = qcore.quantize(TABLE, SPECS["int8 per row"])
    with pytest.raises(ValueError, match="indices must be integers"):
        qcore.take(q, jnp.array([1.0]))
    for mode in ("nearest", "promise_in_bounds"):  # the latter: not a jnp.take mode
        with pytest.raises(ValueError, match=f"mode='{mode}'; allowed: None, 'fill', 'clip'"):
            qcore.take(q, IDS, mode=mode)
    with pytest.raises(ValueError, match="axis"):
        qcore.take(q, IDS, axis=2)
    with pytest.raises(ValueError, match="must be a QArray"):
        qcore.take(TABLE, IDS)

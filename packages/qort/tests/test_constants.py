"""What constants cost in the file, and lookups out of range: JAX's semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import Encoder
from onnx import numpy_helper

import qflax
import qort


def _splat_initializers(exported: qort.Exported) -> list[tuple[str, tuple[int, ...]]]:
    found = []
    for t in exported.model.graph.initializer:
        a = numpy_helper.to_array(t)
        if a.size > 1 and np.all(a == a.flat[0]) and a.nbytes > 64:
            found.append((t.name, a.shape))
    return found


def test_single_valued_constants_cost_the_same_at_any_shape() -> None:
    """A folded ``full`` is a scalar and an Expand, not 16 KiB that grow with the shape."""
    fn = lambda x: x * jnp.full(x.shape, 3.0) + (x > 0)  # noqa: E731
    small = qort.export_function(fn, jnp.ones((8, 8)))
    large = qort.export_function(fn, jnp.ones((64, 64)))
    assert abs(large.nbytes - small.nbytes) < 16, (small.nbytes, large.nbytes)
    assert large.nbytes < 1024
    assert not _splat_initializers(large)
    x = jax.random.normal(jax.random.key(0), (64, 64))
    np.testing.assert_array_equal(qort.Session(large)(x), np.asarray(fn(x)))


def test_quantized_encoder_file_is_smaller_than_float_at_any_length() -> None:
    """The attention mask's fill, (4, 4, 32, 32) float32 = 64 KiB, was stored whole."""
    rules = [
        qflax.QuantizationRule(op_names=["dot_general"], weight_qtype="int8", act_qtype="int8")
    ]
    qmodel = qflax.quantize_model(Encoder(), qflax.PtqProvider(rules))
    sizes = {}
    for length in (8, 32):
        ids = jax.random.randint(jax.random.key(0), (4, length), 1, 100)
        mask = jnp.ones((4, length), jnp.int32)
        fvars = Encoder().init(jax.random.key(1), ids, mask)
        qvars = qmodel.init(jax.random.key(1), ids, mask)
        q = qort.export(qmodel, qvars, ids, mask, validate=False)  # sizes only
        assert not _splat_initializers(q)
        floats = sum(np.asarray(p).nbytes for p in jax.tree.leaves(fvars))
        assert q.nbytes < 0.6 * floats, (length, q.nbytes, floats)
        sizes[length] = q.nbytes
    # Only the folded position rows (24 more of 32 float32) grow with the length.
    assert sizes[32] - sizes[8] < 24 * 32 * 4 + 512, sizes


TABLE = jnp.arange(50 * 6, dtype=jnp.float32).reshape(50, 6) / 7
IDS = jnp.array([[1, 49, 50, 77], [-1, -50, -51, 0]], jnp.int32)  # 50, 77, -51: out of range
LOOKUPS = {
    "index_clamps": lambda t, i: t[i],
    "take_fills_nan": lambda t, i: jnp.take(t, i, axis=0),
    "take_clip": lambda t, i: jnp.take(t, i, axis=0, mode="clip"),
    "take_fill_value": lambda t, i: jnp.take(t, i, axis=0, mode="fill", fill_value=-3.0),
    "take_int_table": lambda t, i: jnp.take((t * 7).astype(jnp.int32), i, axis=0),
    "take_uint8_table": lambda t, i: jnp.take((t * 3).astype(jnp.uint8), i, axis=0),
}


@pytest.mark.parametrize("name", sorted(LOOKUPS))
def test_out_of_range_ids_give_jax_results(name: str) -> None:
    """ONNX Gather fails on such ids; the graph clamps or fills as JAX's mode does."""
    fn = LOOKUPS[name]
    in_range = jnp.clip(IDS, 0, 49)
    for example in (in_range, IDS):  # exported on valid ids, and validated on invalid ones
        exported = qort.export_function(fn, TABLE, example)
        assert exported.report is not None and exported.report.ok, str(exported.report)
        got = qort.Session(exported)(TABLE, IDS)
        np.testing.assert_array_equal(got, np.asarray(fn(TABLE, IDS)))

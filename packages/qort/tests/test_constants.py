"""What constants cost in the file, and lookups out of range: JAX's semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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
        q = qort.export(qmodel, qvars, ids, mask, validate=length == 32)
        assert not _splat_initializers(q)
        floats = sum(np.asarray(p).nbytes for p in jax.tree.leaves(fvars))
        assert q.nbytes < 0.6 * floats, (length, q.nbytes, floats)
        sizes[length] = q.nbytes
    # Only the folded position rows (24 more of 32 float32) grow with the length.
    assert sizes[32] - sizes[8] < 24 * 32 * 4 + 512, sizes

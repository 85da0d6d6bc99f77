"""Float JAX functions exported op by op: each primitive lowering against JAX itself."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_to

import qort

KEY = jax.random.key(0)
X = jax.random.normal(KEY, (2, 5, 8))
IMG = jax.random.normal(KEY, (2, 8, 8, 3))

FUNCTIONS = {
    "elementwise": lambda x: jnp.exp(x) * 2 - jnp.log1p(jnp.abs(x)) / 3 + jnp.maximum(x, 0.1),
    "transcendental": lambda x: jnp.tanh(x) + jax.nn.sigmoid(x) + jax.lax.erf(x) + jnp.sin(x),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "softmax": lambda x: jax.nn.softmax(x, axis=-1),
    "log_softmax": lambda x: jax.nn.log_softmax(x, axis=1),
    "reductions": lambda x: (x.sum(0), x.max(-1), x.min(1), x.mean((0, 2)), jnp.prod(x[:, :2], 1)),
    "argmax": lambda x: jnp.argmax(x, axis=-1),
    "rsqrt_pow": lambda x: jax.lax.rsqrt(x * x + 1) + x**3 - x**-2 * 0,
    "where": lambda x: jnp.where(x > 0, x, -x * 0.5),
    "compare": lambda x: ((x > 0) & (x < 1)) | (x == 0),
    "shapes": lambda x: jnp.concatenate([x.T.reshape(8, 10), x[:, ::2].reshape(8, -1)], axis=1),
    "slice_pad": lambda x: jnp.pad(x[:, 1:4, ::2], ((0, 0), (1, 2), (0, 1)), constant_values=3.0),
    "flip": lambda x: x[..., ::-1] + jnp.flip(x, 1),
    "matmul": lambda x: x @ jnp.arange(8.0 * 3).reshape(8, 3) / 10,
    "batched_matmul": lambda x: jnp.einsum("bqd,bkd->bqk", x, x),
    "layernorm": lambda x: nn.LayerNorm().apply(
        {"params": {"scale": jnp.ones(8), "bias": jnp.zeros(8)}}, x
    ),
    "round_floor": lambda x: jnp.round(x * 3) + jnp.floor(x) + jnp.ceil(x) + jnp.sign(x),
    "clip": lambda x: jnp.clip(x, -0.5, 0.5),
    "cast": lambda x: (x * 10).astype(jnp.int32).astype(jnp.float32),
    "rem": lambda x: jnp.fmod(x * 7, 2.0),
    "split": lambda x: jnp.split(x, 2, axis=-1)[1],
}
IMAGE_FUNCTIONS = {
    "conv_nhwc_same": lambda x: jax.lax.conv_general_dilated(
        x, jnp.ones((3, 3, 3, 4)) / 9, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    ),
    "conv_strided_dilated": lambda x: jax.lax.conv_general_dilated(
        x,
        jnp.ones((3, 3, 3, 4)) / 9,
        (2, 2),
        "VALID",
        rhs_dilation=(2, 1),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    ),
    "depthwise": lambda x: jax.lax.conv_general_dilated(
        x,
        jnp.ones((3, 3, 1, 3)),
        (1, 1),
        "SAME",
        feature_group_count=3,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    ),
    "avg_pool": lambda x: nn.avg_pool(x, (2, 2), strides=(2, 2)),
    "max_pool_same": lambda x: nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME"),
    "global_max": lambda x: jnp.max(x, axis=(1, 2)),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_function_matches_jax(name: str) -> None:
    fn = FUNCTIONS[name]
    exported = qort.export_function(fn, X)
    assert exported.report is not None and exported.report.ok, str(exported.report)
    got, want = qort.Session(exported)(X), fn(X)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if np.issubdtype(np.asarray(w).dtype, np.floating):
            assert_close_to(g, w, 1e-4)
        else:
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("name", sorted(IMAGE_FUNCTIONS))
def test_image_function_matches_jax(name: str) -> None:
    fn = IMAGE_FUNCTIONS[name]
    exported = qort.export_function(fn, IMG)
    assert exported.report is not None and exported.report.ok, str(exported.report)
    assert_close_to(qort.Session(exported)(IMG), fn(IMG), 1e-5)


def test_token_ids_and_embedding_lookup() -> None:
    table = jax.random.normal(KEY, (50, 6))

    def embed(ids, mask):
        x = jnp.take(table, ids, axis=0) + table[jnp.arange(ids.shape[1])]
        m = mask[..., None].astype(x.dtype)
        return jnp.sum(x * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1e-9)

    ids = jnp.array([[1, 7, 49, 0], [3, 3, 2, 11]], jnp.int32)
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], jnp.int32)
    exported = qort.export_function(embed, ids, mask, input_names=["ids", "mask"])
    assert exported.input_names == ["ids", "mask"]
    session = qort.Session(exported)
    # int64 ids (what NumPy and tokenizers give) are accepted when they fit int32.
    got = session(np.asarray(ids, np.int64), mask)
    assert_close_to(got, embed(ids, mask), 1e-6)


def test_pytree_outputs_keep_their_structure() -> None:
    exported = qort.export_function(lambda x: {"a": x + 1, "b": (x * 2, x.sum())}, X)
    out = qort.Session(exported)(X)
    assert set(out) == {"a", "b"}
    assert_close_to(out["b"][1], X.sum())


def test_constant_folding_keeps_only_what_runs() -> None:
    w = jax.random.normal(KEY, (8, 4))
    # The transpose and scaling of the weight happen at export time: one MatMul remains.
    exported = qort.export_function(lambda x: x @ (w.T * 2).T, X)
    ops = [n.op_type for n in exported.model.graph.node]
    assert ops.count("MatMul") == 1 and "Transpose" not in ops


def test_scalar_results_keep_their_rank() -> None:
    """A 0-d constant stays 0-d (it was stored as shape (1,))."""
    for fn in (lambda x: x / (jnp.sqrt(jnp.sum(x * x)) + 1e-6), lambda x: x.sum() + 1):
        exported = qort.export_function(fn, X)
        assert exported.report is not None and exported.report.ok
        assert_close_to(qort.Session(exported)(X), fn(X), 1e-5)


def test_int64_example_inputs() -> None:
    """NumPy int64 ids as the example: JAX traces them as int32, validation too."""
    table = jnp.arange(30.0).reshape(10, 3)
    ids = np.array([[1, 2], [9, 0]], np.int64)
    exported = qort.export_function(lambda i: table[i], ids)
    np.testing.assert_array_equal(qort.Session(exported)(ids), np.asarray(table)[ids])


def test_repeated_computations_are_computed_once() -> None:
    """Equal nodes on equal inputs are merged; graph outputs and random ops stay."""
    from onnx import helper  # noqa: PLC0415

    from qort._graph import deduplicated  # noqa: PLC0415

    nodes = [
        helper.make_node("Add", ["x", "y"], ["a"]),
        helper.make_node("Add", ["x", "y"], ["b"]),
        helper.make_node("Mul", ["a", "x"], ["c"]),
        helper.make_node("Mul", ["b", "x"], ["d"]),
        helper.make_node("Mul", ["b", "x"], ["out"]),
        helper.make_node("Transpose", ["c"], ["e"], perm=[1, 0]),
        helper.make_node("Transpose", ["d"], ["f"], perm=[0, 1]),
        helper.make_node("RandomNormalLike", ["x"], ["r1"]),
        helper.make_node("RandomNormalLike", ["x"], ["r2"]),
    ]
    kept = deduplicated(nodes, ["out"])
    assert [(n.op_type, list(n.input), list(n.output)) for n in kept] == [
        ("Add", ["x", "y"], ["a"]),
        ("Mul", ["a", "x"], ["c"]),
        ("Mul", ["a", "x"], ["out"]),
        ("Transpose", ["c"], ["e"]),
        ("Transpose", ["c"], ["f"]),
        ("RandomNormalLike", ["x"], ["r1"]),
        ("RandomNormalLike", ["x"], ["r2"]),
    ]
    assert nodes[1].input == ["x", "y"]  # the caller's nodes are not modified

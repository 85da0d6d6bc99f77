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


# Edge values: halves (rounding ties), NaN, infinities, both zeros, repeated values
# (sort ties), 0.49999997 and 2**23 + 1 (where |x| + 0.5 rounds in float32).
EDGE = np.array(
    [
        [1.5, -2.5, 0.5, -0.5, 2.5, np.nan, 0.0, -0.0, 1.5, -7.25],
        [3.0, 1.5, -np.inf, np.inf, 1.5, -7.25, 0.49999997, 8388609.0, 0.0, -3.5],
        [2.0, 2.0, 2.0, -1.0, -1.0, 0.0, -0.0, 0.0, np.nan, 5.0],
    ],
    np.float32,
)
FINITE = np.nan_to_num(EDGE, nan=0.5, posinf=4.0, neginf=-4.0)
INTS = np.array([[7, -7, 0, -1, 13, -128, 127, 5], [-2147483648, 2147483647, 3, -3, 1, 2, -5, 64]])
INTS = INTS.astype(np.int32)
AMOUNTS = np.array([[0, 1, 2, 31, 32, 40, -1, 3], [1, 4, 7, 8, 0, 30, 31, -5]], np.int32)
DIVISORS = np.array([[3, 3, 5, 0, -4, -1, 0, 2], [-1, 7, -3, -3, 1, 0, 2, 9]], np.int32)
PACKED = np.arange(0, 256, 16, dtype=np.uint8).reshape(2, 8) + np.uint8(9)
ONE = np.int32(1)
# Starts that JAX clamps (past the end, far negative) for dynamic slices and updates.
STARTS = [np.int32(s) for s in (0, 2, 7, -1, -9)]
IDS = np.array([0, 2, 2, -1], np.int32)
OOB_IDS = [IDS, np.array([5, 1, -4, 0], np.int32), np.array([3, 3, 3, 3], np.int32)]
OOB_IDS.append(np.array([12, -13, 2, 9], np.int32))  # past both ends of 10 columns too


def _int4_unpack(p):
    """Two int4 codes per byte: low nibble, high nibble, sign-extended."""
    low = jax.lax.shift_left(p, jnp.uint8(4)).astype(jnp.int8)
    low = jax.lax.shift_right_arithmetic(low, jnp.int8(4))
    high = jax.lax.shift_right_arithmetic(p.astype(jnp.int8), jnp.int8(4))
    return jnp.stack([low, high], -1).reshape(*p.shape[:-1], -1)


# name: (function, example inputs, more inputs to run the same export on).
PRIMITIVES = {
    "cumsum": (lambda x: (jnp.cumsum(x, 1), jax.lax.cumsum(x, 0, reverse=True)), (EDGE,), ()),
    "cumsum_int8": (lambda x: jax.lax.cumsum(x.astype(jnp.int8), 1), (INTS,), ()),
    "cumprod": (lambda x: (jnp.cumprod(x, 1), jax.lax.cumprod(x, 0, reverse=True)), (EDGE,), ()),
    "cummax_cummin": (
        lambda x, y: (
            jax.lax.cummax(x, 1),
            jax.lax.cummin(x, 1, reverse=True),
            jax.lax.cummax(y.astype(jnp.int16), 0),
            jax.lax.cumprod(y.astype(jnp.int8), 1),
        ),
        (EDGE, INTS),
        (),
    ),
    "scatter_set": (lambda x: (x.at[1].set(0.0), x.at[:, 2:4].set(-1.0)), (EDGE,), ()),
    "scatter_add": (
        lambda x: x.at[:, 2].add(1.0) + x.at[jnp.array([0, 2, 0])].add(x[1]),
        (EDGE,),
        (),
    ),
    "scatter_ops": (
        lambda x: (
            x.at[1].mul(3.0),
            x.at[:, 0].max(2.0),
            x.at[2, 1:3].min(-1.0),
            x.at[0, ::2].subtract(x[1, :5]),
        ),
        (FINITE,),
        (),
    ),
    "scatter_runtime_ids": (
        lambda x, i: (x.at[i].set(x[0]), x.at[i].add(x[1]), x.at[i, 1].set(9.0, mode="clip")),
        (FINITE[:, :6], IDS),
        [(FINITE[:, :6], ids) for ids in OOB_IDS],
    ),
    "scatter_vmap": (
        jax.vmap(lambda x, i: (x.at[i].set(-1.0), x.at[i].add(x[0]))),
        (FINITE[:, :6], IDS[:3]),
        [(FINITE[:, :6], ids[1:]) for ids in OOB_IDS],
    ),
    "scatter_int": (
        lambda x, i: x.at[i].add(7),
        (INTS[0], IDS),
        [(INTS[0], ids) for ids in OOB_IDS],
    ),
    "dynamic_slice": (
        lambda x, i: (jax.lax.dynamic_slice(x, (i, i), (2, 3)), x[i], x[:, i]),
        (FINITE, ONE),
        [(FINITE, s) for s in STARTS],
    ),
    "dynamic_update_slice": (
        lambda x, i: (
            jax.lax.dynamic_update_slice(x, jnp.full((2, 3), -9.0), (i, i)),
            x.at[i].set(x[0] * 2),
        ),
        (FINITE, ONE),
        [(FINITE, s) for s in STARTS],
    ),
    # Gathers other than whole rows: JAX clamps (x[i], mode="clip") or fills (NaN).
    "gather": (
        lambda x, i: (
            jnp.take_along_axis(x, jnp.argsort(x, axis=1), axis=1),
            x[:, i],
            x[i, 1:3],
            jnp.take(x, i, axis=1, mode="fill"),
            jnp.take(x, i, axis=1, mode="clip"),
        ),
        (FINITE, IDS),
        [(FINITE, ids) for ids in OOB_IDS],
    ),
    "sort": (lambda x: (jnp.sort(x, 1), jnp.sort(x, 0, descending=True)), (EDGE,), ()),
    "argsort": (lambda x: (jnp.argsort(x, 1), jnp.argsort(x, 0, descending=True)), (EDGE,), ()),
    "sort_int": (lambda x: (jnp.sort(x, 1), jnp.argsort(x // 5, 1)), (INTS,), ()),
    "sort_key_val": (
        lambda x: jax.lax.sort_key_val(jnp.round(x), x, 1),
        (FINITE,),
        (),
    ),
    "sort_two_keys": (
        lambda x: jax.lax.sort((jnp.floor(x / 2), -x, x * 10), 1, num_keys=2),
        (FINITE,),
        (),
    ),
    # All of each row (+0.0 before -0.0, NaN first), and the first 3.
    "top_k": (lambda x: (jax.lax.top_k(x, 10), jax.lax.top_k(x[:2], 3)), (EDGE,), ()),
    "top_k_int": (lambda x: jax.lax.top_k(x // 3, 5), (INTS,), ()),
    "stack": (lambda x: (jnp.stack([x, x * 2], 1), jnp.stack([x[0], x[1]])), (FINITE,), ()),
    "tile": (lambda x: (jnp.tile(x, (2, 1, 3)), jnp.tile(x[0], 2)), (FINITE,), ()),
    "exp2": (lambda x: jnp.exp2(x / 4), (EDGE,), ()),
    "shifts": (
        lambda x, n: (x << n, x >> n, jax.lax.shift_right_logical(x, n)),
        (INTS, AMOUNTS),
        (),
    ),
    "shifts_narrow": (
        lambda x, n: (
            x.astype(jnp.int8) >> n.astype(jnp.int8),
            x.astype(jnp.uint8) << n.astype(jnp.uint8),
            jax.lax.shift_right_logical(x.astype(jnp.int16), n.astype(jnp.int16)),
            jax.lax.shift_right_arithmetic(x.astype(jnp.uint8), n.astype(jnp.uint8)),
        ),
        (INTS, AMOUNTS),
        (),
    ),
    "int4_unpack": (_int4_unpack, (PACKED,), ()),
    "population_count": (
        lambda x: (jax.lax.population_count(x), jax.lax.population_count(x.astype(jnp.uint8))),
        (INTS,),
        (),
    ),
    "clamp": (
        lambda x, y: (
            jax.lax.clamp(-1.0, x, 2.0),
            jnp.clip(y, -3, 4),
            jax.lax.clamp(jnp.int16(-3), y.astype(jnp.int16), jnp.int16(4)),
        ),
        (EDGE, INTS),
        (),
    ),
    "rem_int": (
        lambda x, d: (
            jax.lax.rem(x, d),
            jax.lax.rem(x.astype(jnp.int8), d.astype(jnp.int8)),
            jax.lax.rem(x.astype(jnp.uint8), d.astype(jnp.uint8)),
            jax.lax.rem(x.astype(jnp.int16), d.astype(jnp.int16)),
            x % 5,
        ),
        (INTS, DIVISORS),
        (),
    ),
    "rem_float": (lambda x: (jax.lax.rem(x, 2.0), jax.lax.rem(x, x[::-1]), x % -1.5), (EDGE,), ()),
    "sign": (lambda x, y: (jnp.sign(x), jnp.sign(y.astype(jnp.int32))), (EDGE, FINITE), ()),
    "round": (
        lambda x: (
            jnp.round(x),
            jax.lax.round(x, jax.lax.RoundingMethod.AWAY_FROM_ZERO),
            jax.lax.round(x, jax.lax.RoundingMethod.TO_NEAREST_EVEN),
        ),
        (EDGE,),
        (),
    ),
    # Both branches of the approximation (w < 5 and w >= 5), the poles, outside [-1, 1].
    "erf_inv": (
        jax.scipy.special.erfinv,
        (np.array([[0.0, 1e-8, -0.3, 0.5, 0.97, -0.999, 0.9999999, -1.0, 1.0, 1.5, np.nan]]),),
        (),
    ),
    "is_finite": (lambda x: (jnp.isfinite(x), jnp.isnan(x), jnp.isinf(x)), (EDGE,), ()),
}


# Lowerings that only select, move or round values: their floats must be equal too.
EXACT = {
    "argsort",
    "clamp",
    "cummax_cummin",
    "dynamic_slice",
    "dynamic_update_slice",
    "rem_float",
    "round",
    "scatter_set",
    "sign",
    "sort",
    "sort_key_val",
    "sort_two_keys",
    "stack",
    "tile",
    "top_k",
}


def _assert_matches(got, want, exact: bool) -> None:
    """Equal for integers, booleans, non-finite floats (and all with ``exact``); else close."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.dtype, want.dtype)
    if exact or not np.issubdtype(want.dtype, np.floating):
        np.testing.assert_array_equal(got, want)
        return
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
    assert_close_to(got[finite], want[finite], 1e-5)


@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_primitive_matches_jax(name: str) -> None:
    """Each newly lowered primitive, on edge cases; dynamic ones on several inputs."""
    fn, args, more = PRIMITIVES[name]
    args = tuple(jnp.asarray(a) for a in args)
    exported = qort.export_function(fn, *args)
    assert exported.report is not None and exported.report.ok, str(exported.report)
    session = qort.Session(exported)
    for inputs in [args, *more]:
        got, want = session(*inputs), fn(*(jnp.asarray(a) for a in inputs))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            _assert_matches(g, w, name in EXACT)


def test_hadamard_rotated_model_exports() -> None:
    """qflax's Hadamard rotation (a fast Walsh-Hadamard transform: slices and `stack`)."""
    import qflax  # noqa: PLC0415

    class Rotated(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(x)

    rule = qflax.QuantizationRule(
        op_names=["dot_general"],
        weight_qtype="int8",
        act_qtype="int8",
        rotation="hadamard",
        rotation_seed=3,
    )
    qmodel = qflax.quantize_model(Rotated(), qflax.PtqProvider([rule]))
    x = jax.random.normal(KEY, (3, 2))
    variables = jax.jit(qmodel.init)(jax.random.key(1), x)
    exported = qort.export(qmodel, variables, x)
    assert exported.report is not None and exported.report.ok, str(exported.report)
    assert exported.report.integer_sites == 1 == exported.report.integer_kernels
    assert "Concat" in [n.op_type for n in exported.model.graph.node]  # the stacks
    assert_close_to(qort.Session(exported)(x), qmodel.apply(variables, x), 1e-5)


def test_unstable_sort_with_values_is_refused() -> None:
    """XLA's order of equal keys in an unstable sort is its own: refused, named."""
    x = jnp.asarray(EDGE)
    with pytest.raises(qort.ExportError, match=r"sort with is_stable=False .* \(at sort"):
        qort.export_function(lambda x: jnp.argsort(x, stable=False), x)
    exported = qort.export_function(lambda x: jnp.sort(x, stable=False), x)  # keys alone
    _assert_matches(qort.Session(exported)(x), jnp.sort(x, stable=False), exact=True)

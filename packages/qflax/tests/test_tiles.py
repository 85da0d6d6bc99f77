"""One int4 rule (``tile_size=32``) on every kind of weight: which axis is tiled, and how.

The tile runs along the weight's innermost (last) contracted axis, every other axis
keeps one scale per index, so a block holds ``tile_size`` values; an innermost axis
no longer than the tile is one block, which takes in whole contracted axes before
it while the block still holds at most ``tile_size`` values. Each case checks the
scale shape against that closed form and the codes against a float64 numpy
blockwise absmax reference.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import qcore
import qflax
from qflax import QuantizationRule as Rule

TILE = 32
INT4 = [Rule(weight_qtype="int4", tile_size=TILE)]
TAKE = (*qflax.op_names(),)  # every op, including the table lookup
INT4_TABLES = [Rule(weight_qtype="int4", tile_size=TILE, op_names=TAKE)]


def blockwise_int4(w, axis, reduced=()):
    """float64 numpy reference: absmax int4, blocks of ``TILE`` (or the whole axis if
    shorter) along ``axis``, shared by the ``reduced`` axes, one scale per index elsewhere.

    Returns the dequantized weight, the scale (in its stored shape) and a mask of the
    values that sit within float32 rounding of a rounding tie (either code is right).
    """
    w = np.asarray(w, np.float64)
    n = w.shape[axis]
    t = min(TILE, n)
    split = w.reshape(w.shape[:axis] + (n // t, t) + w.shape[axis + 1 :])
    red = tuple(a + (a > axis) for a in reduced) + (axis + 1,)
    scale = np.max(np.abs(split), axis=red, keepdims=True) / 7.5
    ratio = split / scale
    tie = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) < 1e-4
    codes = np.clip(np.round(ratio), -8, 7)
    deq = (codes * scale).reshape(w.shape)
    return deq, np.squeeze(scale, axis + 1), np.broadcast_to(tie, split.shape).reshape(w.shape)


def assert_matches_reference(qa, w, axis, reduced=()):
    """``qa`` holds the reference's scales and, away from rounding ties, its values."""
    ref, scale, tie = blockwise_int4(w, axis, reduced)
    assert qa.scale.shape == scale.shape
    np.testing.assert_allclose(np.asarray(qa.scale, np.float64), scale, rtol=1e-6)
    deq = np.asarray(qcore.dequantize(qa), np.float64)
    step = np.max(scale) * 1.0001
    off = np.abs(deq - ref) > 1e-6 * np.max(np.abs(ref))
    assert not np.any(off & ~tie) and np.all(np.abs(deq - ref)[off] <= step)
    return deq


class Einsums(nn.Module):
    """Attention projections as einsums: q (d, heads, head_dim) and out (heads, head_dim, d)."""

    heads: int
    head_dim: int

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        d = x.shape[-1]
        wq = self.param("query", init, (d, self.heads, self.head_dim))
        wo = self.param("out", init, (self.heads, self.head_dim, d))
        h = jnp.einsum("bsd,dhk->bshk", x, wq)
        return jnp.einsum("bshk,hkd->bsd", h, wo)


class Moe(nn.Module):
    """Two experts' (experts, d, f) weights on ``lax.ragged_dot``."""

    @nn.compact
    def __call__(self, x):
        w = self.param("experts", nn.initializers.lecun_normal(), (2, x.shape[-1], 16))
        return lax.ragged_dot(x, w, jnp.array([x.shape[0] // 2] * 2, jnp.int32))


class Lm(nn.Module):
    """Embedding lookup (``take``) and tied logits (``attend``)."""

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(50, 64, name="embed")
        return embed.attend(embed(ids))


class Net(nn.Module):
    """One layer as a submodule, so its params sit under ``layer``."""

    layer: nn.Module

    @nn.compact
    def __call__(self, x):
        return self.layer(x)


def _key(i):
    return jax.random.key(i)


# (model, input, [(param path, innermost contracted axis, reduced contracted axes,
#   closed-form scale shape)])
CASES = {
    "dense": (
        Net(nn.Dense(16)),
        jax.random.normal(_key(1), (4, 64)),
        [(("layer", "kernel"), 0, (), (64 // TILE, 16))],
    ),
    "einsum attention, head_dim 64": (
        Einsums(heads=4, head_dim=64),
        jax.random.normal(_key(1), (2, 3, 64)),
        [
            (("query",), 0, (), (64 // TILE, 4, 64)),
            (("out",), 1, (), (4, 64 // TILE, 64)),  # failed: tile 32 of axis 0 (heads=4)
        ],
    ),
    "einsum attention, head_dim 16": (
        Einsums(heads=4, head_dim=16),
        jax.random.normal(_key(1), (2, 3, 64)),
        [
            (("query",), 0, (), (64 // TILE, 4, 16)),
            (("out",), 1, (), (4, 1, 64)),  # 16 < 32: one block per head (4 x 16 > 32)
        ],
    ),
    "conv 2-D": (
        Net(nn.Conv(8, (3, 3))),
        jax.random.normal(_key(1), (2, 6, 6, 64)),
        [(("layer", "kernel"), 2, (), (3, 3, 64 // TILE, 8))],  # failed: tile 32 of kh=3
    ),
    "conv 1-D": (
        Net(nn.Conv(8, (3,))),
        jax.random.normal(_key(1), (2, 7, 8)),
        [(("layer", "kernel"), 1, (0,), (1, 1, 8))],  # 3 x 8 = 24 values: one block
    ),
    "stem conv, cin=3": (
        Net(nn.Conv(8, (3, 3))),
        jax.random.normal(_key(1), (2, 6, 6, 3)),
        [(("layer", "kernel"), 2, (0, 1), (1, 1, 1, 8))],  # 27 values per output channel
    ),
    "conv, cin 16": (
        Net(nn.Conv(8, (3, 3))),
        jax.random.normal(_key(1), (2, 6, 6, 16)),
        [(("layer", "kernel"), 2, (), (3, 3, 1, 8))],  # 16 per tap (3 x 16 > 32)
    ),
    "depthwise conv": (
        Net(nn.Conv(16, (3, 3), feature_group_count=16)),
        jax.random.normal(_key(1), (2, 6, 6, 16)),
        [(("layer", "kernel"), 2, (0, 1), (1, 1, 1, 16))],  # 9 values per channel
    ),
    "moe ragged_dot": (
        Moe(),
        jax.random.normal(_key(1), (6, 64)),
        [(("experts",), 1, (), (2, 64 // TILE, 16))],
    ),
}


def _param(tree, path):
    for k in path:
        tree = tree[k]
    return tree


@pytest.mark.parametrize("case", list(CASES))
def test_one_int4_rule_quantizes_every_weight_in_blocks_of_the_tile(case):
    model, x, weights = CASES[case]
    fp = model.init(_key(0), x)["params"]
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(INT4))
    qp = qmodel.init(_key(0), x)["params"]
    deq_params = fp
    for path, axis, reduced, scale_shape in weights:
        qa = _param(qp, path).qarray
        assert qa.scale.shape == scale_shape, path
        deq = assert_matches_reference(qa, _param(fp, path), axis, reduced)
        deq_params = _replace(deq_params, path, jnp.asarray(deq, jnp.float32))
    # The jitted quantized model is the float model on the blockwise-dequantized weights,
    # and quantize_params gives the in-model quantization.
    want = model.apply({"params": deq_params}, x)
    got = jax.jit(qmodel.apply)({"params": qp}, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    abstract = jax.eval_shape(qmodel.init, _key(0), x)["params"]
    offline = qflax.quantize_params(fp, abstract)
    for path, *_ in weights:
        a, b = _param(offline, path).qarray, _param(qp, path).qarray
        assert jnp.array_equal(a.qvalue, b.qvalue) and jnp.array_equal(a.scale, b.scale)


def _replace(tree, path, value):
    if not path:
        return value
    return {**tree, path[0]: _replace(tree[path[0]], path[1:], value)}


def test_a_looked_up_and_tied_table_has_blocks_of_the_tile_along_its_rows():
    ids = jnp.array([[3, 17, 49, 0]])
    model = Lm()
    fp = model.init(_key(0), ids)["params"]
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(INT4_TABLES))
    qp = qmodel.init(_key(0), ids)["params"]
    qa = qp["embed"]["embedding"].qarray
    assert qa.scale.shape == (50, 64 // TILE)
    deq = assert_matches_reference(qa, fp["embed"]["embedding"], 1)
    want = model.apply({"params": {"embed": {"embedding": jnp.asarray(deq, jnp.float32)}}}, ids)
    np.testing.assert_allclose(
        jax.jit(qmodel.apply)({"params": qp}, ids), want, rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
    ("model", "x", "match"),
    [
        (
            Net(nn.Dense(8)),
            jnp.ones((2, 48)),
            r"weight 'layer/kernel' of shape \(48, 8\): tile_size=32: contracted axis 0 \(the "
            r"one tiled\) has size 48, which is not a multiple of the tile 32; allowed: a "
            r"tile_size that divides 48, or one of at least 48",
        ),
        (
            Net(nn.Conv(8, (3, 3))),
            jnp.ones((1, 4, 4, 40)),
            r"weight 'layer/kernel' of shape \(3, 3, 40, 8\): tile_size=32: contracted axis 2 "
            r"\(the one tiled\) has size 40",
        ),
        (
            Einsums(heads=2, head_dim=48),
            jnp.ones((1, 2, 64)),
            r"weight 'out' of shape \(2, 48, 64\): tile_size=32: contracted axis 1 \(the one "
            r"tiled\) has size 48",
        ),
    ],
)
def test_an_innermost_axis_longer_than_the_tile_and_not_a_multiple_is_refused(model, x, match):
    with pytest.raises(ValueError, match=match):
        qflax.quantize_model(model, qflax.PtqProvider(INT4)).init(_key(0), x)


def test_a_fraction_tiles_the_innermost_axis_and_a_mapping_only_the_axes_it_names():
    frac = Rule(weight_qtype="int4", tile_size=0.5).weight_spec((4, 64, 8), (0, 1))
    assert frac is not None and frac.scale_shape((4, 64, 8)) == (4, 2, 8)
    named = Rule(weight_qtype="int4", tile_size={0: 2}).weight_spec((4, 64, 8), (0, 1))
    assert named is not None and named.scale_shape((4, 64, 8)) == (2, 1, 8)


@pytest.mark.parametrize("case", ["einsum attention, head_dim 64", "conv 2-D", "depthwise conv"])
def test_qat_with_the_int4_rule_runs_the_ptq_forward_and_trains(case):
    model, x, _ = CASES[case]
    qat = qflax.quantize_model(model, qflax.QtProvider(INT4))
    variables = qat.init(_key(0), x)
    grads = jax.grad(lambda p: jnp.sum(qat.apply({**variables, "params": p}, x) ** 2))(
        variables["params"]
    )
    leaves = jax.tree.leaves(grads)
    assert leaves and all(bool(jnp.all(jnp.isfinite(g))) and bool(jnp.any(g != 0)) for g in leaves)
    ptq = qflax.quantize_model(model, qflax.PtqProvider(INT4))
    abstract = jax.eval_shape(ptq.init, _key(0), x)["params"]
    params = qflax.quantize_params(variables["params"], abstract)
    np.testing.assert_allclose(
        qat.apply(variables, x), ptq.apply({"params": params}, x), rtol=1e-5, atol=1e-6
    )


class NnxAttentionAndConv(nnx.Module):
    """An NNX output projection ``(heads, head_dim, d)`` and a 3x3 conv, both from one rule."""

    def __init__(self, rngs):
        self.out = nnx.Param(jax.random.normal(rngs.params(), (4, 64, 16)) * 0.1)
        self.conv = nnx.Conv(16, 8, (3, 3), rngs=rngs)

    def __call__(self, h):
        y = jnp.einsum("bshk,hkd->bsd", h, self.out[...])  # (b, s, 16): an image of s x 1
        return self.conv(y[:, :, None, :])


def test_nnx_model_gets_the_same_blocks():
    model = NnxAttentionAndConv(nnx.Rngs(0))
    h = jax.random.normal(_key(1), (2, 5, 4, 64))
    out, kernel = np.asarray(model.out[...]), np.asarray(model.conv.kernel[...])
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(INT4), h)
    qout = qmodel.out.get_raw_value().qarray
    qkernel = qmodel.conv.kernel.get_raw_value().qarray
    assert qout.scale.shape == (4, 64 // TILE, 16)
    assert qkernel.scale.shape == (3, 3, 1, 8)  # 16 input channels: 3 x 16 > 32, per tap
    assert_matches_reference(qout, out, 1)
    assert_matches_reference(qkernel, kernel, 2)

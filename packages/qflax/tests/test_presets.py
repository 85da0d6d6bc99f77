"""The 4-bit preset (qflax.presets.four_bit) and mixed precision over embedding tables."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx

import qcore
import qflax
from qflax.gptq import gptq
from qflax.mixed_precision import mixed_precision
from qflax.presets import four_bit

VOCAB, WIDTH, HIDDEN = 512, 128, 256
BATCHES = [jax.random.randint(jax.random.key(i), (4, 16), 0, VOCAB) for i in range(2)]


class Tiny(nn.Module):
    """A lookup in the largest param, then two matmuls."""

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, WIDTH, name="embed")(ids)
        x = nn.gelu(nn.Dense(HIDDEN, name="up")(x))
        return nn.Dense(WIDTH, name="down")(x)


class NnxTiny(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

    def __call__(self, ids):
        return self.down(nnx.gelu(self.up(self.embed(ids))))


@pytest.fixture(scope="module")
def linen():
    params = Tiny().init(jax.random.key(0), BATCHES[0])["params"]
    return params, four_bit(Tiny(), params, BATCHES, budget_ratio=0.25, jit=False, progress=False)


def _nbytes(tree):
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def test_mixed_precision_with_take_treats_each_table_as_an_op():
    params = Tiny().init(jax.random.key(0), BATCHES[0])["params"]
    kw = dict(candidates=("int8", "int4"), tile_size={"int4": 32}, jit=False, progress=False)
    with_tables = mixed_precision(
        Tiny(), params, BATCHES, budget_ratio=0.3, op_names=("dot_general", "take"), **kw
    )
    assert set(with_tables.assignment) == {("embed", "take"), ("up", "dot_general"),
                                           ("down", "dot_general")}  # fmt: skip
    assert with_tables.total_bytes <= 0.3 * with_tables.float_bytes
    # Without "take", the table stays float and counts at its float size: 0.3x is then
    # below the smallest possible total.
    with pytest.raises(ValueError, match="below the smallest possible total"):
        mixed_precision(Tiny(), params, BATCHES, budget_ratio=0.3, **kw)


def test_four_bit_meets_the_budget_and_serves_its_params(linen):
    params, result = linen
    assert result.total_bytes == _nbytes(result.params)  # as stored, codes packed
    assert result.total_bytes <= result.budget_bytes == int(0.25 * result.float_bytes)
    assert result.float_bytes == _nbytes(params)
    assert {(r.module_path, r.op_name) for r in result.rows} == {
        ("embed", "take"),
        ("up", "dot_general"),
        ("down", "dot_general"),
    }
    # The PTQ model on these params is the float model on their dequantized values.
    qmodel = qflax.quantize_model(Tiny(), qflax.PtqProvider(result.rules))
    y = qmodel.apply({"params": result.params}, BATCHES[0])
    deq = jax.tree.map(
        lambda x: qcore.dequantize(x.qarray) if isinstance(x, qflax.QuantizedParam) else x,
        result.params,
        is_leaf=lambda x: isinstance(x, qflax.QuantizedParam),
    )
    np.testing.assert_allclose(y, Tiny().apply({"params": deq}, BATCHES[0]), rtol=1e-5, atol=1e-5)
    ref = Tiny().apply({"params": params}, BATCHES[0])
    assert float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) < 0.1


def test_four_bit_uses_gptq_for_matmuls_and_nearest_for_tables(linen):
    params, result = linen
    methods = {(r.op_name, r.method) for r in result.rows}
    assert methods == {("take", "nearest"), ("dot_general", "GPTQ")}
    matmuls = [r for r in result.rules if "take" not in r.op_names]
    expected = gptq(Tiny(), params, matmuls, BATCHES, progress=False)
    for name in ("up", "down"):
        for a, b in zip(
            jax.tree.leaves(result.params[name]), jax.tree.leaves(expected[name]), strict=True
        ):
            np.testing.assert_array_equal(a, b)
    qmodel = qflax.quantize_model(Tiny(), qflax.PtqProvider(result.rules))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), BATCHES[0])["params"]
    rtn = qflax.quantize_params(params, abstract)["embed"]["embedding"]
    table = result.params["embed"]["embedding"]
    assert table.recipe == rtn.recipe
    for a, b in zip(jax.tree.leaves(table), jax.tree.leaves(rtn), strict=True):
        np.testing.assert_array_equal(a, b)


def test_report_names_every_op_and_the_totals(linen):
    _, result = linen
    text = result.to_text()
    for r in result.rows:
        assert r.module_path in text
    assert f"{result.total_bytes:,} bytes" in text and "x float" in text


def test_nnx_result_loads_into_the_ptq_model():
    model = NnxTiny(nnx.Rngs(0))
    result = four_bit(model, None, BATCHES, budget_ratio=0.25, jit=False, progress=False)
    assert result.total_bytes <= result.budget_bytes
    abstract = nnx.eval_shape(
        lambda: qflax.quantize_model(
            NnxTiny(nnx.Rngs(0)), qflax.PtqProvider(result.rules), BATCHES[0]
        )
    )
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, result.params)
    loaded = nnx.merge(graphdef, state)
    y, ref = loaded(BATCHES[0]), model(BATCHES[0])
    assert float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) < 0.1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"candidates": ("int8", "int5x")}, "candidates"),
        ({"search_batches": 0}, "search_batches=0"),
        ({"budget_ratio": 0.01}, "below the smallest possible total"),
        ({"tile_size": {"int4": 48, "nf4": 48}}, "tile 48"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, match):
    params = Tiny().init(jax.random.key(0), BATCHES[0])["params"]
    before = jax.tree.map(np.array, params)
    with pytest.raises(ValueError, match=match):
        four_bit(Tiny(), params, BATCHES, **{"jit": False, "progress": False, **kwargs})
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)  # inputs untouched

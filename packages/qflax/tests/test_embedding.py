"""Quantized embedding tables: lookups (jnp.take) and the tied output projection."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qcore
import qflax
from qflax import QuantizationRule as Rule
from qflax import checkpoint

VOCAB, WIDTH = 50, 16
IDS = jnp.array([[1, 2, 49], [0, 3, 3]])
TABLE_RULE = Rule(module_path="embed", op_names=("take", "dot"), weight_qtype="int4", tile_size=8)
RULES = [TABLE_RULE, Rule(weight_qtype="int8")]


class TiedLM(nn.Module):
    """Lookup, one Dense, and the table reused as the output projection."""

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, WIDTH, name="embed")
        return embed.attend(nn.Dense(WIDTH, name="dense")(embed(ids)))


class NnxTiedLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.dense = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, ids):
        return self.embed.attend(self.dense(self.embed(ids)))


def _float_reference(params, q):
    """The float model on the dequantized table and kernel (float64 numpy)."""
    table = np.asarray(qcore.dequantize(q["embed"]["embedding"].qarray), np.float64)
    kernel = np.asarray(qcore.dequantize(q["dense"]["kernel"].qarray), np.float64)
    x = table[np.asarray(IDS)] @ kernel + np.asarray(params["dense"]["bias"], np.float64)
    return x @ table.T


@pytest.fixture(scope="module")
def linen():
    model = TiedLM()
    params = model.init(jax.random.key(0), IDS)["params"]
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(RULES))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), IDS)["params"]
    return model, params, qmodel, abstract


def test_tied_table_is_stored_once_packed_in_its_own_layout(linen):
    _, params, _, abstract = linen
    table = abstract["embed"]["embedding"]
    assert isinstance(table, qflax.QuantizedParam)
    assert table.recipe.compute_shape() == (VOCAB, WIDTH)  # the lookup's layout, not attend's
    q = qflax.quantize_params(params, abstract)
    qa = q["embed"]["embedding"].qarray
    assert qa.qvalue.shape == (VOCAB, WIDTH // 2) and qa.qvalue.dtype == jnp.uint8
    assert qa.scale.shape == (VOCAB, WIDTH // 8)  # per row, tiles of 8
    assert jax.tree.leaves(q["embed"]) == [qa.qvalue, qa.scale]  # nothing else stored


def test_lookup_and_attend_match_the_float_model_on_the_dequantized_table(linen):
    _, params, qmodel, abstract = linen
    q = qflax.quantize_params(params, abstract)
    y = jax.jit(qmodel.apply)({"params": q}, IDS)
    np.testing.assert_allclose(
        np.asarray(y, np.float64), _float_reference(params, q), rtol=2e-5, atol=2e-5
    )


def test_quantize_params_is_bit_identical_to_in_model_quantization(linen):
    _, params, qmodel, abstract = linen
    _, state = qmodel.apply({"params": params}, IDS, mutable=["params"])
    a = jax.tree.leaves(qflax.quantize_params(params, abstract))
    b = jax.tree.leaves(state["params"])
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_out_of_range_ids_follow_jnp_take_fill(linen):
    model, params, qmodel, abstract = linen
    q = qflax.quantize_params(params, abstract)
    bad = jnp.array([[VOCAB, -VOCAB - 1, 5]])
    y = qmodel.apply({"params": q}, bad)
    ref = model.apply({"params": params}, bad)
    # nn.Embed looks up with jnp.take's default mode ("fill"): NaN rows, as in float.
    assert np.array_equal(np.isnan(np.asarray(y)), np.isnan(np.asarray(ref)))
    assert np.isnan(np.asarray(y)[0, :2]).all() and not np.isnan(np.asarray(y)[0, 2]).any()


def test_rules_that_do_not_name_take_leave_the_table_float(linen):
    model, params, _, _ = linen
    qmodel = qflax.quantize_model(model, qflax.PtqProvider([Rule(weight_qtype="int8")]))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), IDS)["params"]
    # attend's dot is a contraction, so the default rule quantizes the table there.
    assert abstract["embed"]["embedding"].recipe.compute_shape() == (WIDTH, VOCAB)
    only_dense = [Rule(module_path="dense", weight_qtype="int8")]
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(only_dense))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), IDS)["params"]
    assert isinstance(abstract["embed"]["embedding"], jax.ShapeDtypeStruct)


DISAGREE = [
    Rule(module_path="embed", op_names=("take",), weight_qtype="int4", tile_size=8),
    Rule(module_path="embed", op_names=("dot",), weight_qtype="int8"),
    Rule(weight_qtype="int8"),
]


def test_lookup_and_attend_rules_that_disagree_are_refused(linen):
    model, _, _, _ = linen
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(DISAGREE))
    with pytest.raises(ValueError, match="'embed/embedding' is used by two ops"):
        qmodel.init(jax.random.key(0), IDS)


def test_nnx_lookup_and_attend_rules_that_disagree_are_refused():
    model = NnxTiedLM(nnx.Rngs(0))
    with pytest.raises(ValueError, match="'embed/embedding' is used by two ops"):
        qflax.quantize_model(model, qflax.PtqProvider(DISAGREE), IDS)
    assert not isinstance(model.embed.embedding.get_raw_value(), qflax.QuantizedParam)


def test_tile_that_does_not_divide_the_width_is_a_clear_error(linen):
    model, _, _, _ = linen
    rules = [Rule(module_path="embed", op_names=("take",), weight_qtype="int4", tile_size=5)]
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    with pytest.raises(ValueError, match=r"'embed/embedding' of shape \(50, 16\)"):
        qmodel.init(jax.random.key(0), IDS)


def test_safetensors_round_trip(linen, tmp_path):
    _, params, qmodel, abstract = linen
    q = qflax.quantize_params(params, abstract)
    file = checkpoint.export_safetensors(tmp_path / "lm.safetensors", q, rules=RULES)
    back = checkpoint.import_safetensors(file, abstract)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(q), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(
        qmodel.apply({"params": back}, IDS), qmodel.apply({"params": q}, IDS)
    )


def test_nnx_embed_and_attend():
    model = NnxTiedLM(nnx.Rngs(0))
    float_out = model(IDS)
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(RULES), IDS)
    q = nnx.to_pure_dict(nnx.state(qmodel))
    table = q["embed"]["embedding"]
    assert isinstance(table, qflax.QuantizedParam)
    assert table.recipe.compute_shape() == (VOCAB, WIDTH)
    q = {"embed": q["embed"], "dense": {"kernel": q["dense"]["kernel"], "bias": q["dense"]["bias"]}}
    params = {"dense": {"bias": np.asarray(q["dense"]["bias"])}}
    y = qmodel(IDS)
    np.testing.assert_allclose(
        np.asarray(y, np.float64), _float_reference(params, q), rtol=2e-5, atol=2e-5
    )
    assert float(jnp.max(jnp.abs(y - float_out))) < 0.2 * float(jnp.max(jnp.abs(float_out)))


def test_qat_lookup_gradient_is_straight_through_to_the_looked_up_rows():
    class Lookup(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return nn.Embed(VOCAB, WIDTH, name="embed")(ids)

    model = Lookup()
    params = model.init(jax.random.key(0), IDS)["params"]
    rules = [Rule(module_path="embed", op_names=("take",), weight_qtype="int8")]
    qat = qflax.quantize_model(model, qflax.QtProvider(rules))
    weights = jax.random.normal(jax.random.key(2), (*IDS.shape, WIDTH))

    def loss(apply, p):
        return jnp.sum(apply({"params": p}, IDS) * weights)

    g = jax.grad(lambda p: loss(qat.apply, p))(params)["embed"]["embedding"]
    g_float = jax.grad(lambda p: loss(model.apply, p))(params)["embed"]["embedding"]
    np.testing.assert_array_equal(g, g_float)  # STE: the float lookup's gradient
    untouched = np.setdiff1d(np.arange(VOCAB), np.asarray(IDS))
    assert not np.asarray(g)[untouched].any() and np.asarray(g)[np.asarray(IDS)].any()
    # Forward: the PTQ lookup's values.
    ptq = qflax.quantize_model(model, qflax.PtqProvider(rules))
    q = qflax.quantize_params(params, jax.eval_shape(ptq.init, jax.random.key(0), IDS)["params"])
    np.testing.assert_array_equal(qat.apply({"params": params}, IDS), ptq.apply({"params": q}, IDS))


def test_orbax_round_trip_and_rules(linen, tmp_path):
    _, params, qmodel, abstract = linen
    q = qflax.quantize_params(params, abstract)
    checkpoint.save(tmp_path / "ckpt", q, rules=RULES)
    back = checkpoint.load(tmp_path / "ckpt", abstract)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(q), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert checkpoint.load_rules(tmp_path / "ckpt") == RULES
    np.testing.assert_array_equal(
        qmodel.apply({"params": back}, IDS), qmodel.apply({"params": q}, IDS)
    )


class Indexing(nn.Module):
    """A table looked up by plain indexing, and sliced (not a lookup: left float)."""

    mode: str | None = None

    @nn.compact
    def __call__(self, ids):
        table = self.param("table", nn.initializers.normal(1.0), (VOCAB, WIDTH))
        rows = table[ids] if self.mode is None else table.at[ids].get(mode=self.mode)
        return rows, table[:, :4]


INDEX_RULES = [Rule(module_path=".*", op_names=("take",), weight_qtype="int4", tile_size=8)]
# In range, negative (counted from the end), and out of range on both sides.
ODD_IDS = jnp.array([[0, 7, VOCAB - 1], [-1, VOCAB + 3, -VOCAB - 5]])


@pytest.mark.parametrize("mode", [None, "clip", "fill", "promise_in_bounds"])
def test_plain_indexing_of_a_param_is_a_quantized_lookup(mode):
    model = Indexing(mode)
    params = model.init(jax.random.key(0), IDS)["params"]
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(INDEX_RULES))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), IDS)["params"]
    q = qflax.quantize_params(params, abstract)
    assert isinstance(q["table"], qflax.QuantizedParam)
    assert q["table"].qarray.qvalue.shape == (VOCAB, WIDTH // 2)  # int4, packed
    dequantized = qcore.dequantize(q["table"].qarray)
    rows, sliced = jax.jit(qmodel.apply)({"params": q}, ODD_IDS)
    # JAX's own indexing of the dequantized table, out-of-range rule included
    # (clamped, or NaN rows for "fill"), never the whole table dequantized in the model.
    expected = dequantized[ODD_IDS] if mode is None else dequantized.at[ODD_IDS].get(mode=mode)
    np.testing.assert_array_equal(rows, expected)
    assert np.isnan(np.asarray(rows)).any() == (mode == "fill")
    # The slice is not a lookup: it reads the dequantized table like the float model.
    np.testing.assert_array_equal(sliced, dequantized[:, :4])


def test_nnx_plain_indexing_is_a_quantized_lookup():
    class NnxIndexing(nnx.Module):
        def __init__(self, rngs):
            self.table = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, WIDTH)))

        def __call__(self, ids):
            return self.table[ids]

    model = NnxIndexing(nnx.Rngs(0))
    float_table = np.asarray(model.table[...])
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(INDEX_RULES), IDS)
    table = nnx.to_pure_dict(nnx.state(qmodel))["table"]
    assert isinstance(table, qflax.QuantizedParam)
    dequantized = qcore.dequantize(table.qarray)
    np.testing.assert_array_equal(qmodel(ODD_IDS), dequantized[ODD_IDS])
    assert 0 < float(jnp.max(jnp.abs(dequantized - float_table))) < 0.5


def test_frozen_quantized_table_passes_gradients_to_the_trainable_params(linen):
    # QLoRA-style fine-tuning: the quantized table is a constant, the Dense trains.
    _, params, qmodel, abstract = linen
    q = qflax.quantize_params(params, abstract)
    ptq = qflax.quantize_model(TiedLM(), qflax.PtqProvider([TABLE_RULE]))  # Dense float
    table_only = {
        "embed": q["embed"],
        "dense": {k: np.asarray(v) for k, v in params["dense"].items()},
    }
    target = jax.random.normal(jax.random.key(5), (*IDS.shape, VOCAB))

    def loss(apply, dense, table):
        return jnp.sum(apply({"params": {"embed": table, "dense": dense}}, IDS) * target)

    g = jax.grad(loss, argnums=1)(ptq.apply, table_only["dense"], q["embed"])
    float_table = {"embedding": qcore.dequantize(q["embed"]["embedding"].qarray)}
    g_ref = jax.grad(loss, argnums=1)(TiedLM().apply, table_only["dense"], float_table)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # The table's codes are integers: JAX gives them no gradient (float0).
    codes_grad = jax.grad(lambda t: loss(ptq.apply, table_only["dense"], t), allow_int=True)(
        q["embed"]
    )["embedding"].qarray.qvalue
    assert codes_grad.dtype == jax.dtypes.float0


def test_nnx_quantize_params_on_a_template_is_bit_identical_to_in_model_quantization():
    float_model = NnxTiedLM(nnx.Rngs(0))
    floats = nnx.to_pure_dict(nnx.state(float_model, nnx.Param))
    abstract = nnx.eval_shape(
        lambda: qflax.quantize_model(NnxTiedLM(nnx.Rngs(0)), qflax.PtqProvider(RULES), IDS)
    )
    q = qflax.quantize_params(floats, abstract)
    assert isinstance(q["embed"]["embedding"], qflax.QuantizedParam)
    in_model = qflax.quantize_model(NnxTiedLM(nnx.Rngs(0)), qflax.PtqProvider(RULES), IDS)
    expected = nnx.to_pure_dict(nnx.state(in_model, nnx.Param))
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, q)
    np.testing.assert_array_equal(nnx.merge(graphdef, state)(IDS), in_model(IDS))

"""quantize_params: model-free, bit-identical to in-model quantization, subtrees, errors."""

import re
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from archs import small as zoo
from flax import nnx

import qflax
from qflax import QuantizationRule as Rule

RULES = [Rule(module_path="Dense_0", weight_qtype="int4", tile_size=32), Rule(weight_qtype="int8")]
NNX_RULES = [Rule(module_path="fc1", weight_qtype="int4", tile_size=32), Rule(weight_qtype="int8")]
X = jax.random.normal(jax.random.key(1), (8, 128))


def assert_trees_identical(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def linen():
    model = zoo.LinenMLP()
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(RULES))
    fp = model.init(jax.random.key(5), X)["params"]
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), X)["params"]
    return qmodel, fp, abstract


def test_abstract_template_gives_bit_identical_params_to_the_two_in_model_routes(linen):
    qmodel, fp, abstract = linen
    assert isinstance(abstract["Dense_0"]["kernel"].qarray.qvalue, jax.ShapeDtypeStruct)
    quantized = qflax.quantize_params(fp, abstract)
    _, in_model = qmodel.apply({"params": fp}, X, mutable=["params"])
    assert_trees_identical(quantized, in_model["params"])
    _, jitted = jax.jit(lambda p: qmodel.apply({"params": p}, X, mutable=["params"]))(fp)
    assert_trees_identical(quantized, jitted["params"])
    # init quantizes the float params of the model's own init
    fp0 = zoo.LinenMLP().init(jax.random.key(0), X)["params"]
    assert_trees_identical(
        qflax.quantize_params(fp0, abstract), qmodel.init(jax.random.key(0), X)["params"]
    )


def test_a_subtree_is_quantized_on_its_own(linen):
    _, fp, abstract = linen
    full = qflax.quantize_params(fp, abstract)
    part = qflax.quantize_params({"Dense_1": fp["Dense_1"]}, abstract)
    assert list(part) == ["Dense_1"]
    assert_trees_identical(part["Dense_1"], full["Dense_1"])


def test_extra_params_raise_unless_allowed_then_are_dropped(linen):
    _, fp, abstract = linen
    extra = {**fp, "loss_head": {"w": jnp.ones(3)}}
    with pytest.raises(ValueError, match=re.escape("params['loss_head/w'] is not in")):
        qflax.quantize_params(extra, abstract)
    # Dropped, as Qwix does: the result is the quantized model's params, nothing else.
    out = qflax.quantize_params(extra, abstract, allow_extra_params=True)
    assert "loss_head" not in out
    assert_trees_identical(out, qflax.quantize_params(fp, abstract))


def test_shape_mismatch_names_the_path_and_both_shapes(linen):
    _, fp, abstract = linen
    bad = {"Dense_1": {**fp["Dense_1"], "kernel": jnp.ones((64, 256))}}
    with pytest.raises(
        ValueError, match=re.escape("params['Dense_1/kernel'] has shape (64, 256)")
    ) as e:
        qflax.quantize_params(bad, abstract)
    assert "(128, 256)" in str(e.value)


def test_quantized_input_is_rejected(linen):
    _, fp, abstract = linen
    quantized = qflax.quantize_params(fp, abstract)
    with pytest.raises(ValueError, match="already quantized"):
        qflax.quantize_params(quantized, abstract)


def test_float_params_where_quantized_ones_are_due_raise_a_clear_error(linen):
    qmodel, fp, _ = linen
    with pytest.raises(ValueError, match=r"param 'Dense_\d/kernel' is float .*quantize_params"):
        qmodel.apply({"params": fp}, X)


def test_boxed_partitioned_params_keep_their_boxes():
    model = nn.Dense(
        64, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    )
    qmodel = qflax.quantize_model(model, qflax.PtqProvider([Rule(weight_qtype="int8")]))
    qv = qmodel.init(jax.random.key(0), X)
    kernel = qv["params"]["kernel"]
    assert isinstance(kernel, qflax.QuantizedParam)
    # Each leaf has its own box: codes keep the axes, scales only the per-channel one.
    assert isinstance(kernel.qarray.qvalue, nn.Partitioned)
    assert kernel.qarray.qvalue.names == ("embed", "mlp")
    assert kernel.qarray.scale.names == (None, "mlp")
    fp = nn.unbox(model.init(jax.random.key(0), X)["params"])
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), X)["params"]
    assert_trees_identical(qflax.quantize_params(fp, abstract), nn.unbox(qv["params"]))
    y = qmodel.apply(qv, X)
    assert y.shape == (8, 64)


def test_nnx_in_place_quantization_equals_quantize_params_on_an_abstract_model():
    def build():
        return zoo.NnxMLP(nnx.Rngs(0))

    fp = nnx.to_pure_dict(nnx.state(build(), nnx.Param))
    provider = qflax.PtqProvider(NNX_RULES)
    abstract = nnx.eval_shape(lambda: qflax.quantize_model(build(), provider, X))
    quantized = qflax.quantize_params(fp, abstract)
    in_place = qflax.quantize_model(build(), provider, X)
    assert_trees_identical(quantized, nnx.to_pure_dict(nnx.state(in_place, nnx.Param)))
    # Loading the quantized params into the abstract model gives a working model.
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, quantized)
    loaded = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(loaded(X), in_place(X))


class _NnxLayers(nnx.Module):
    """Layers in an ``nnx.List``: ``nnx.to_pure_dict`` keys them by int."""

    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(128, 128, rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_quantize_params_keeps_the_int_keys_of_an_nnx_list():
    fp = nnx.to_pure_dict(nnx.state(_NnxLayers(nnx.Rngs(0)), nnx.Param))
    assert set(fp["layers"]) == {0, 1}
    in_place = qflax.quantize_model(_NnxLayers(nnx.Rngs(0)), qflax.PtqProvider(NNX_RULES), X)
    quantized = qflax.quantize_params(fp, in_place)
    assert set(quantized["layers"]) == {0, 1}
    assert_trees_identical(quantized, nnx.to_pure_dict(nnx.state(in_place, nnx.Param)))


def test_nnx_quantization_replaces_the_float_weights_without_a_copy():
    model = zoo.NnxMLP(nnx.Rngs(0))
    float_kernel = weakref.ref(model.fc1.kernel.get_raw_value())
    same = qflax.quantize_model(model, qflax.PtqProvider(NNX_RULES), X)
    assert same is model
    assert float_kernel() is None  # nothing holds the float weight any more

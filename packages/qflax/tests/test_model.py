"""quantize_model: argument errors, concurrency, and behaviour outside quantized calls."""

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from archs import small as zoo
from flax import nnx

import qflax
from qflax import QuantizationRule as Rule

X = jax.random.normal(jax.random.key(1), (8, 128))
W8 = [Rule(weight_qtype="int8", act_qtype="int8")]


def test_bad_arguments_get_clear_errors():
    with pytest.raises(ValueError, match="must be a qflax.PtqProvider or QtProvider"):
        qflax.quantize_model(zoo.LinenMLP(), W8)
    with pytest.raises(ValueError, match="has no method 'encode'"):
        qflax.quantize_model(zoo.LinenMLP(), qflax.PtqProvider(W8), methods=["encode"])
    with pytest.raises(ValueError, match="neither a flax.linen nor an nnx.Module"):
        qflax.quantize_model(lambda x: x, qflax.PtqProvider(W8))
    with pytest.raises(ValueError, match="NNX models need example inputs"):
        qflax.quantize_model(zoo.NnxMLP(nnx.Rngs(0)), qflax.PtqProvider(W8))
    with pytest.raises(ValueError, match="not ops qflax intercepts"):
        Rule(op_names=["conv_transpose"], weight_qtype="int8")


def test_a_tile_that_does_not_divide_the_weight_names_it():
    qmodel = qflax.quantize_model(
        zoo.LinenMLP(), qflax.PtqProvider([Rule(weight_qtype="int4", tile_size=48)])
    )
    with pytest.raises(ValueError, match=r"weight 'Dense_1/kernel' of shape \(128, 256\):.*48"):
        qmodel.init(jax.random.key(0), X)


def test_nnx_stochastic_qat_is_refused_with_a_reason():
    import qcore

    sr = [Rule(weight_qtype="int8", act_qtype="int8")]
    provider = qflax.QtProvider(
        sr, dlhs=qcore.BackwardQuant(grad=qcore.HowToQuantize(qtype="int8", rounding="stochastic"))
    )
    with pytest.raises(ValueError, match="stochastic rounding in QtProvider needs a Linen model"):
        qflax.quantize_model(zoo.NnxMLP(nnx.Rngs(0)), provider, X)


def test_a_failed_nnx_quantization_leaves_the_model_untouched():
    model = zoo.NnxMLP(nnx.Rngs(0))
    before = nnx.to_pure_dict(nnx.state(model))
    with pytest.raises(ValueError, match="act_static_scale needs statistics"):
        qflax.quantize_model(
            model,
            qflax.PtqProvider([Rule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]),
            X,
        )
    assert type(model) is zoo.NnxMLP
    after = nnx.to_pure_dict(nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, before, after)


def test_the_original_linen_model_is_unaffected():
    model = zoo.LinenMLP()
    fp = model.init(jax.random.key(0), X)
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(W8))
    qv = qmodel.init(jax.random.key(0), X)
    ref = model.apply(fp, X)
    qmodel.apply(qv, X)
    np.testing.assert_array_equal(model.apply(fp, X), ref)


def _work(i):
    """Quantize and run a Linen and an NNX model whose sizes depend on ``i``."""
    d = 16 * (i + 1)
    x = jax.random.normal(jax.random.key(i), (4, d))
    rules = [Rule(weight_qtype="int4" if i % 2 else "int8", act_qtype="int8")]
    lin = qflax.quantize_model(nn.Dense(d), qflax.PtqProvider(rules))
    y_linen = lin.apply(lin.init(jax.random.key(i), x), x)
    n = qflax.quantize_model(nnx.Linear(d, 8, rngs=nnx.Rngs(i)), qflax.PtqProvider(rules), x)
    return np.asarray(y_linen), np.asarray(n(x))


def test_eight_threads_quantizing_different_models_match_the_sequential_results():
    sequential = [_work(i) for i in range(8)]
    results = [None] * 8
    errors = []
    barrier = threading.Barrier(8)

    def run(i):
        try:
            barrier.wait()
            results[i] = _work(i)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for got, want in zip(results, sequential, strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_methods_other_than_the_quantized_ones_are_refused_at_apply():
    class Net(nn.Module):
        def setup(self):
            self.dense = nn.Dense(4)

        def __call__(self, x):
            return self.dense(x)

        def features(self, x):
            return self.dense(x) * 2

    x = jnp.ones((2, 8))
    qmodel = qflax.quantize_model(Net(), qflax.PtqProvider([Rule(act_qtype="int8")]))
    variables = qmodel.init(jax.random.key(0), x)
    for method in ("features", Net.features, qmodel.features):
        with pytest.raises(ValueError, match="method='features' of Net does not run quantized"):
            qmodel.apply(variables, x, method=method)
    both = qflax.quantize_model(
        Net(), qflax.PtqProvider([Rule(act_qtype="int8")]), methods=["__call__", "features"]
    )
    float_out = Net().apply(variables, x, method="features")
    for method in ("features", Net.features):
        out = both.apply(variables, x, method=method)
        np.testing.assert_array_equal(out, 2 * both.apply(variables, x))
        assert not np.array_equal(out, float_out)

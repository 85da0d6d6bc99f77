"""SmoothQuant (qflax.smoothquant)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from archs import small as zoo
from flax import nnx

import qcore
import qflax
from qcore.testing import primitive_dtypes
from qflax.smoothquant import smoothquant

K, N = 32, 16
W8A8 = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]


Normed = zoo.Normed
OUTLIERS = (80.0, 120.0, 60.0)  # channels 1, 7 and 20, times the rest


def outlier_inputs(key, batches=4, rows=64):
    return zoo.outlier_inputs(key, OUTLIERS, batches, rows, K)


def reference(fparams, x):
    """The float layer in float64 numpy."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), fparams)
    x = np.asarray(x, np.float64)
    return (x * p["g"][None]) @ p["dense"]["kernel"] + p["dense"]["bias"][None]


def ptq(model, rules, x, params):
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
    return qmodel, qflax.quantize_params(params, abstract)


def mae(qmodel, params, fparams, xs):
    apply = jax.jit(qmodel.apply)
    errs = [
        np.mean(
            np.abs(np.asarray(apply({"params": params}, x), np.float64) - reference(fparams, x))
        )
        for x in xs
    ]
    return float(np.mean(errs))


def setup():
    model = Normed()
    xs = outlier_inputs(jax.random.key(0))
    fparams = model.init(jax.random.key(2), xs[0])["params"]
    return model, xs, fparams


def test_smoothquant_beats_plain_w8a8_on_inputs_with_outlier_channels():
    model, xs, fparams = setup()
    held_out = outlier_inputs(jax.random.key(1), batches=2)
    qmodel, plain = ptq(model, W8A8, xs[0], fparams)
    out = smoothquant(model, fparams, W8A8, xs, fold_into={"dense/kernel": "g"}, progress=False)
    e_plain = mae(qmodel, plain, fparams, held_out)
    e_sq = mae(qmodel, out, fparams, held_out)
    print(f"w8a8 MAE: plain {e_plain:.5f} SmoothQuant {e_sq:.5f}")
    assert e_sq < 0.7 * e_plain
    # The returned params are the plain PTQ model's: same recipe, same structure.
    assert out["dense"]["kernel"].recipe == plain["dense"]["kernel"].recipe
    assert jax.tree.structure(out) == jax.tree.structure(plain)
    np.testing.assert_array_equal(np.asarray(fparams["g"]), 1.0)  # input untouched


def test_carried_scale_keeps_the_integer_path_and_matches_the_folded_one():
    model, xs, fparams = setup()
    held_out = outlier_inputs(jax.random.key(1), batches=2)
    qmodel, plain = ptq(model, W8A8, xs[0], fparams)
    out = smoothquant(model, fparams, W8A8, xs, progress=False)
    folded = smoothquant(model, fparams, W8A8, xs, fold_into={"dense/kernel": "g"}, progress=False)
    kernel = out["dense"]["kernel"]
    # Same s either way: carried in the param, or as 1/s in g.
    np.testing.assert_allclose(np.asarray(kernel.input_scale) * np.asarray(folded["g"]), 1.0, 1e-6)
    np.testing.assert_array_equal(np.asarray(out["g"]), 1.0)
    e_plain = mae(qmodel, plain, fparams, held_out)
    e_sq = mae(qmodel, out, fparams, held_out)
    print(f"w8a8 MAE: plain {e_plain:.5f} SmoothQuant (carried) {e_sq:.5f}")
    assert e_sq < 0.7 * e_plain

    # The division happens before the int8 quantization: the same integer-code dot as
    # plain w8a8 runs (qcore contracts the codes as int8 -> int32, or as exact bf16 codes
    # for this (K, N) weight layout on CPU), never a float32 dequantize-then-dot.
    def dots(params):
        return primitive_dtypes(
            lambda x: qmodel.apply({"params": params}, x), held_out[0], name="dot_general"
        )

    f32 = jnp.dtype(jnp.float32)
    assert dots(out) == dots(plain)
    assert len(dots(out)) == 1 and dots(out)[0][0] != (f32, f32)


def test_scale_matches_a_float64_reference():
    model, xs, fparams = setup()
    alpha = 0.7
    out = smoothquant(
        model, fparams, W8A8, xs, fold_into={"dense/kernel": "g"}, alpha=alpha, progress=False
    )
    x_max = np.max(np.abs(np.concatenate([np.asarray(x, np.float64) for x in xs])), axis=0)
    w = np.asarray(fparams["dense"]["kernel"], np.float64)
    s = x_max**alpha / np.max(np.abs(w), axis=1) ** (1 - alpha)
    np.testing.assert_allclose(np.asarray(out["g"], np.float64), 1.0 / s, rtol=1e-5)
    # The stored weight is int8 of s W per output channel: within half a step of it.
    sw = w * s[:, None]
    step = np.max(np.abs(sw), axis=0, keepdims=True) / 127.0
    got = np.asarray(qcore.dequantize(out["dense"]["kernel"].qarray), np.float64)
    assert np.all(np.abs(got - sw) <= 0.5 * step * (1 + 1e-4))
    assert np.max(np.abs(got - sw) / step) > 0.3  # and really quantized


def test_zero_channels_keep_scale_one_and_alpha_zero_changes_nothing():
    model, xs, fparams = setup()
    xs = [x.at[:, 3].set(0.0) for x in xs]
    out = smoothquant(model, fparams, W8A8, xs, fold_into={"dense/kernel": "g"}, progress=False)
    assert float(out["g"][3]) == 1.0
    assert np.all(np.isfinite(np.asarray(out["g"])))
    zero = fparams["dense"]["kernel"].at[5].set(0.0)
    p = {**fparams, "dense": {**fparams["dense"], "kernel": zero}}
    out = smoothquant(model, p, W8A8, xs, fold_into={"dense/kernel": "g"}, progress=False)
    assert float(out["g"][5]) == 1.0


def test_bad_inputs_are_clear_errors():
    model, xs, fparams = setup()
    fold = {"dense/kernel": "g"}
    for alpha in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match=r"alpha=.*\[0, 1\]"):
            smoothquant(model, fparams, W8A8, xs, fold_into=fold, alpha=alpha, progress=False)
    with pytest.raises(ValueError, match="no calibration data"):
        smoothquant(model, fparams, W8A8, [], fold_into=fold, progress=False)
    with pytest.raises(ValueError, match="no calibration data: calibration_batches=None"):
        smoothquant(model, fparams, W8A8, None, fold_into=fold, progress=False)
    with pytest.raises(ValueError, match=r"'nope' is not a param .*float params: \['g'"):
        smoothquant(model, fparams, W8A8, xs, fold_into={"dense/kernel": "nope"}, progress=False)
    with pytest.raises(ValueError, match=r"'dense/bias' has shape \(16,\).*32 input channels"):
        smoothquant(
            model, fparams, W8A8, xs, fold_into={"dense/kernel": "dense/bias"}, progress=False
        )
    with pytest.raises(ValueError, match=r"no quantized weight .*quantized: \['dense/kernel'\]"):
        smoothquant(model, fparams, W8A8, xs, fold_into={"g": "dense/bias"}, progress=False)


class NnxNormed(nnx.Module):
    def __init__(self, rngs):
        self.g = nnx.Param(jnp.ones(K))
        self.dense = nnx.Linear(K, N, rngs=rngs)

    def __call__(self, x):
        return self.dense(x * self.g[None])


def test_nnx_output_loads_into_the_ptq_model():
    xs = outlier_inputs(jax.random.key(0))
    model = NnxNormed(nnx.Rngs(0))
    out = smoothquant(model, None, W8A8, xs, fold_into={"dense/kernel": "g"}, progress=False)
    np.testing.assert_array_equal(np.asarray(model.g[...]), 1.0)  # model untouched
    ptq_model = nnx.eval_shape(
        lambda: qflax.quantize_model(NnxNormed(nnx.Rngs(0)), qflax.PtqProvider(W8A8), xs[0])
    )
    graphdef, state = nnx.split(ptq_model)
    nnx.replace_by_pure_dict(state, out)
    y = nnx.merge(graphdef, state)(xs[1])
    fparams = {
        "g": np.asarray(model.g[...]),
        "dense": {"kernel": model.dense.kernel[...], "bias": model.dense.bias[...]},
    }
    err = np.mean(np.abs(np.asarray(y, np.float64) - reference(fparams, xs[1])))
    assert err < 0.2

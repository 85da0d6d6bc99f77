"""Calibration collection (qflax.layer_stats), GPTQ (qflax.gptq) and AWQ (qflax.awq)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from archs import small as zoo
from flax import nnx

import qcore
import qflax
from qflax.awq import awq
from qflax.gptq import gptq, quantize_weight
from qflax.layer_stats import collect
from qflax.qparam import stand_in

K, N = 32, 16


class Einsum(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(1.0), (x.shape[-1], 2, 4))
        return jnp.einsum("btd,dnh->btnh", x, w)


class TwoLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(N, name="a")(x)
        return nn.Dense(8, name="b")(h)


class Conv(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Conv(4, (3,), name="conv")(x)


class PerHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(1.0), (2, x.shape[-1], 4))
        return jnp.einsum("bhd,hdk->bhk", x, w)


class SharedWeight(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(1.0), (x.shape[-1], x.shape[-1]))
        return x @ w + x @ w.T


def correlated(key, batches=4, rows=64, k=K):
    """Inputs x = z @ M (one fixed mixing matrix M: correlated channels), in batches."""
    mix = jax.random.normal(jax.random.key(99), (k, k)) / np.sqrt(k) + 0.5 * jnp.eye(k)
    return [z @ mix for z in jax.random.normal(key, (batches, rows, k))]


def ptq(model, rules, x, params):
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
    return qmodel, qflax.quantize_params(params, abstract)


def mae(qmodel, params, model, fparams, xs):
    errs = [
        jnp.mean(jnp.abs(qmodel.apply({"params": params}, x) - model.apply({"params": fparams}, x)))
        for x in xs
    ]
    return float(np.mean(errs))


# -- calibration collection ------------------------------------------------------


def test_hessian_and_abs_stats_accumulate_across_batches():
    model = nn.Dense(N)
    xs = [jax.random.normal(jax.random.key(i), (3, 5, K)) * (i + 1) for i in range(3)]
    params = model.init(jax.random.key(0), xs[0])["params"]
    rules = [qflax.QuantizationRule(weight_qtype="int4")]
    stats = collect(model, params, rules, iter(xs), progress=False)
    rows = np.concatenate([np.asarray(x, np.float64).reshape(-1, K) for x in xs])
    s = stats["kernel"]
    assert int(s.count) == rows.shape[0] == 45
    np.testing.assert_allclose(np.asarray(s.hessian), rows.T @ rows, rtol=2e-6, atol=1e-4)
    np.testing.assert_allclose(np.asarray(s.abs_sum), np.abs(rows).sum(0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s.abs_max), np.abs(rows).max(0), rtol=0)
    np.testing.assert_allclose(
        np.asarray(s.mean_hessian()), rows.T @ rows / 45, rtol=2e-6, atol=1e-5
    )
    eager = collect(model, params, rules, xs, jit=False, progress=False)["kernel"]
    np.testing.assert_allclose(np.asarray(eager.hessian), np.asarray(s.hessian), rtol=1e-6)


def test_stats_of_an_einsum_weight_use_its_contracting_axis():
    model = Einsum()
    xs = [jax.random.normal(jax.random.key(i), (2, 3, 8)) for i in range(2)]
    params = model.init(jax.random.key(0), xs[0])["params"]
    rules = [qflax.QuantizationRule(weight_qtype="int8")]
    s = collect(model, params, rules, xs, progress=False)["w"]
    rows = np.concatenate([np.asarray(x, np.float64).reshape(-1, 8) for x in xs])
    np.testing.assert_allclose(np.asarray(s.hessian), rows.T @ rows, rtol=2e-6, atol=1e-5)
    assert s.site.axis == 0 and s.recipe.spec.channelwise_axes == (1, 2)


def test_collection_writes_nothing_and_shows_progress(capsys):
    model = nn.Dense(N)
    xs = correlated(jax.random.key(0), batches=2)
    params = model.init(jax.random.key(0), xs[0])["params"]
    before = jax.tree.map(np.array, params)
    collect(model, params, [qflax.QuantizationRule(weight_qtype="int4")], xs)
    assert "calibration batches: 2/2" in capsys.readouterr().err
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.array, params))


# -- GPTQ numerics -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("qtype", "tile", "act_order"),
    [
        ("int4", None, False),
        ("int4", 8, False),
        ("int4", None, True),
        ("int4", 8, True),
        ("nf4", None, False),
    ],
)
def test_gptq_beats_rtn_on_correlated_inputs(qtype, tile, act_order):
    model = nn.Dense(N)
    xs = correlated(jax.random.key(1))
    held_out = correlated(jax.random.key(2), batches=2)
    fparams = model.init(jax.random.key(3), xs[0])["params"]
    rules = [qflax.QuantizationRule(weight_qtype=qtype, tile_size=tile)]
    qmodel, rtn = ptq(model, rules, xs[0], fparams)
    out = gptq(model, fparams, rules, xs, act_order=act_order, block_size=8, progress=False)
    e_rtn = mae(qmodel, rtn, model, fparams, held_out)
    e_gptq = mae(qmodel, out, model, fparams, held_out)
    print(f"{qtype} tile={tile} act_order={act_order}: MAE RTN {e_rtn:.5f} GPTQ {e_gptq:.5f}")
    assert e_gptq < 0.9 * e_rtn
    assert out["kernel"].recipe == rtn["kernel"].recipe
    same_scales = np.array_equal(out["kernel"].qarray.scale, rtn["kernel"].qarray.scale)
    # Per channel and with static groups (act_order) the scales are RTN's and only the
    # codes move; dynamic groups (tiles without act_order) recompute the tiles' scales.
    assert same_scales == (tile is None or act_order)
    assert out["bias"] is fparams["bias"]


def test_dynamic_groups_beat_static_groups_on_correlated_inputs():
    model = nn.Dense(N)
    xs = correlated(jax.random.key(1))
    held_out = correlated(jax.random.key(2), batches=2)
    fparams = model.init(jax.random.key(3), xs[0])["params"]
    rules = [qflax.QuantizationRule(weight_qtype="int4", tile_size=8)]
    qmodel, _ = ptq(model, rules, xs[0], fparams)
    errors = {
        static: mae(qmodel, gptq(model, fparams, rules, xs, static_groups=static,
                                 block_size=8, progress=False), model, fparams, held_out)
        for static in (True, False)
    }  # fmt: skip
    print(f"int4 tile=8 GPTQ MAE: static groups {errors[True]:.5f}, dynamic {errors[False]:.5f}")
    assert errors[False] < errors[True]


def test_block_size_does_not_change_the_result():
    w = jax.random.normal(jax.random.key(0), (K, N))
    x = correlated(jax.random.key(1), batches=1)[0]
    h = x.T @ x / x.shape[0]
    spec = qflax.QuantizationRule(weight_qtype="int4").weight_spec((K, N), (0,))
    assert spec is not None
    a = quantize_weight(w, h, spec, block_size=K)
    b = quantize_weight(w, h, spec, block_size=5)
    diff = np.asarray(qcore.dequantize(a) - qcore.dequantize(b)) / np.asarray(a.scale)
    assert np.mean(diff != 0) < 0.02  # float32 summation order may flip a rare tie


def test_gptq_weight_matches_a_float64_reference():
    """An independent float64 numpy GPTQ (no blocks) gives the same codes."""
    k, n = 12, 5
    w = np.asarray(jax.random.normal(jax.random.key(0), (k, n)), np.float64)
    x = np.asarray(correlated(jax.random.key(1), batches=1, k=k)[0], np.float64)
    h = x.T @ x / x.shape[0]
    spec = qcore.HowToQuantize(qtype="int4", channelwise_axes=(1,))
    got = quantize_weight(jnp.asarray(w, jnp.float32), h, spec, block_size=4, damping=0.01)
    s = np.asarray(got.scale, np.float64)[0]
    hd = h + 0.01 * np.mean(np.diag(h)) * np.eye(k)
    u = np.linalg.cholesky(np.linalg.inv(hd)).T
    work, codes = w.copy(), np.zeros((k, n))
    for i in range(k):
        codes[i] = np.clip(np.round(work[i] / s), -8, 7)
        err = (work[i] - codes[i] * s) / u[i, i]
        work[i + 1 :] -= np.outer(u[i, i + 1 :], err)
    agree = np.mean(np.asarray(got.qvalue) == codes)
    assert agree > 0.95, agree  # ties at +-7.5 steps may round either way in float32


def test_dynamic_groups_with_zero_points():
    w = jax.random.normal(jax.random.key(0), (K, N))
    x = correlated(jax.random.key(1), batches=1)[0]
    spec = qflax.QuantizationRule(weight_qtype="uint4", tile_size=8).weight_spec((K, N), (0,))
    assert spec is not None
    spec = dataclasses.replace(spec, symmetric=False)
    q = quantize_weight(w, x.T @ x / x.shape[0], spec)
    rtn = qcore.quantize(w, spec)
    assert q.zero_point is not None and q.zero_point.shape == rtn.zero_point.shape == (4, N)
    y = np.asarray(x @ w, np.float64)

    def err(qa):
        return np.mean(np.abs(np.asarray(x @ qcore.dequantize(qa), np.float64) - y))

    assert err(q) < 0.9 * err(rtn)


def test_dynamic_groups_match_a_float64_reference():
    """Tiles of 4 rows: each tile's absmax scale is taken from the updated rows."""
    k, n, tile = 12, 5, 4
    w = np.asarray(jax.random.normal(jax.random.key(0), (k, n)), np.float64)
    x = np.asarray(correlated(jax.random.key(1), batches=1, k=k)[0], np.float64)
    h = x.T @ x / x.shape[0]
    spec = qflax.QuantizationRule(weight_qtype="int4", tile_size=tile).weight_spec((k, n), (0,))
    assert spec is not None
    got = quantize_weight(jnp.asarray(w, jnp.float32), h, spec, block_size=3)  # -> 4
    hd = h + 0.01 * np.mean(np.diag(h)) * np.eye(k)
    u = np.linalg.cholesky(np.linalg.inv(hd)).T
    work, codes, scales = w.copy(), np.zeros((k, n)), np.zeros((k // tile, n))
    for i in range(k):
        if i % tile == 0:
            # qcore's symmetric int4 absmax scale: |x| max is (qmax - qmin) / 2 = 7.5 steps
            scales[i // tile] = np.max(np.abs(work[i : i + tile]), axis=0) / 7.5
        s = scales[i // tile]
        codes[i] = np.clip(np.round(work[i] / s), -8, 7)
        err = (work[i] - codes[i] * s) / u[i, i]
        work[i + 1 :] -= np.outer(u[i, i + 1 :], err)
    # A tile's max lands exactly on a rounding tie (7.5 steps), which float32 and float64
    # may break differently; a flipped code then shifts the later tiles of its column.
    close = np.isclose(np.asarray(got.scale, np.float64), scales, rtol=1e-4)
    assert np.all(close[0]) and np.mean(close) >= 0.9, close
    assert not np.allclose(scales, np.max(np.abs(w.reshape(3, tile, n)), axis=1) / 7.5)
    step = np.repeat(np.asarray(got.scale, np.float64), tile, axis=0)
    got_codes = np.round(np.asarray(qcore.dequantize(got), np.float64) / step)
    # Every column agrees exactly except where such a tie flipped (one column here).
    assert np.sum(np.any(got_codes != codes, axis=0)) <= 1, got_codes - codes
    np.testing.assert_array_equal(got_codes[:tile], codes[:tile])


# -- loading into the plain PTQ model ------------------------------------------------


def test_linen_output_loads_into_the_ptq_model_and_equals_the_weight_by_hand():
    model = TwoLayer()
    xs = correlated(jax.random.key(0))
    fparams = model.init(jax.random.key(1), xs[0])["params"]
    rules = [qflax.QuantizationRule(module_path="a", weight_qtype="int4", tile_size=8)]
    out = gptq(model, fparams, rules, xs, progress=False)
    assert isinstance(out["a"]["kernel"], qflax.QuantizedParam)
    assert out["b"]["kernel"] is fparams["b"]["kernel"]  # unselected: float, untouched
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    y = jax.jit(qmodel.apply)({"params": out}, xs[0])
    wq = qcore.dequantize(out["a"]["kernel"].qarray)
    h = xs[0] @ wq + fparams["a"]["bias"][None]
    ref = h @ fparams["b"]["kernel"] + fparams["b"]["bias"][None]
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-4, atol=1e-4)


def test_nnx_output_loads_into_the_ptq_model():
    xs = correlated(jax.random.key(0))
    model = nnx.Linear(K, N, rngs=nnx.Rngs(0))
    kernel = np.array(model.kernel.get_value())
    rules = [qflax.QuantizationRule(weight_qtype="int4", act_qtype="int8")]
    out = gptq(model, None, rules, xs, act_order=True, progress=False)
    np.testing.assert_array_equal(model.kernel.get_value(), kernel)  # model left float
    abstract = nnx.eval_shape(
        lambda: qflax.quantize_model(
            nnx.Linear(K, N, rngs=nnx.Rngs(0)), qflax.PtqProvider(rules), xs[0]
        )
    )
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, out)
    loaded = nnx.merge(graphdef, state)
    y = loaded(xs[0])
    act = rules[0].act_spec(2, (1,))
    assert act is not None
    x_q = qcore.dequantize(qcore.quantize(xs[0], act))
    ref = x_q @ qcore.dequantize(out["kernel"].qarray) + out["bias"][None]
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-4, atol=1e-4)


def test_int8_and_einsum_weights_land_on_the_grid():
    model = Einsum()
    xs = [jax.random.normal(jax.random.key(i), (2, 16, 8)) for i in range(2)]
    fparams = model.init(jax.random.key(0), xs[0])["params"]
    rules = [qflax.QuantizationRule(weight_qtype="int8")]
    out = gptq(model, fparams, rules, xs, progress=False)
    qmodel, rtn = ptq(model, rules, xs[0], fparams)
    assert out["w"].recipe == rtn["w"].recipe
    np.testing.assert_allclose(
        np.asarray(qmodel.apply({"params": out}, xs[0])),
        np.asarray(jnp.einsum("btd,dnh->btnh", xs[0], qcore.dequantize(out["w"].qarray))),
        rtol=1e-4,
        atol=1e-4,
    )


# -- bad input ---------------------------------------------------------------------


def _dense():
    model = nn.Dense(N)
    x = jnp.ones((2, K))
    return model, model.init(jax.random.key(0), x)["params"], x


INT4 = [qflax.QuantizationRule(weight_qtype="int4")]


def test_no_calibration_data_is_an_error():
    model, params, _ = _dense()
    with pytest.raises(ValueError, match="no calibration data"):
        gptq(model, params, INT4, [], progress=False)
    with pytest.raises(ValueError, match="no calibration data"):
        gptq(model, params, INT4, None, progress=False)


def test_rules_selecting_nothing_or_unsupported_ops_are_errors():
    model, params, x = _dense()
    with pytest.raises(ValueError, match="select no weight"):
        gptq(
            model,
            params,
            [qflax.QuantizationRule(module_path="nope", weight_qtype="int4")],
            [x],
            progress=False,
        )
    conv = Conv()
    xc = jnp.ones((1, 8, 3))
    with pytest.raises(ValueError, match="conv_general_dilated.*does not handle"):
        gptq(conv, conv.init(jax.random.key(0), xc)["params"], INT4, [xc], progress=False)
    heads = PerHead()
    xh = jnp.ones((3, 2, 8))
    with pytest.raises(ValueError, match="batch axes"):
        gptq(heads, heads.init(jax.random.key(0), xh)["params"], INT4, [xh], progress=False)
    shared = SharedWeight()
    xs = jnp.ones((3, 8))
    with pytest.raises(ValueError, match="different layouts"):
        gptq(shared, shared.init(jax.random.key(0), xs)["params"], INT4, [xs], progress=False)


def test_bad_arguments_are_errors():
    model, params, x = _dense()
    with pytest.raises(ValueError, match="block_size"):
        gptq(model, params, INT4, [x], block_size=0, progress=False)
    with pytest.raises(ValueError, match="act_order=True needs static_groups"):
        gptq(model, params, INT4, [x], act_order=True, static_groups=False, progress=False)
    with pytest.raises(ValueError, match="static_groups='yes' must be None, True or False"):
        gptq(model, params, INT4, [x], static_groups="yes", progress=False)
    with pytest.raises(ValueError, match="params=None"):
        gptq(nnx.Linear(K, N, rngs=nnx.Rngs(0)), params, INT4, [x], progress=False)
    _, q = ptq(model, INT4, x, params)
    with pytest.raises(ValueError, match="already quantized"):
        gptq(model, q, INT4, [x], progress=False)
    with pytest.raises(ValueError, match="not positive definite"):
        gptq(
            model,
            params,
            INT4,
            [jnp.zeros((1, K)).at[0, 0].set(1.0) + x],
            damping=0.0,
            progress=False,
        )


def test_an_interrupted_run_leaves_the_inputs_intact():
    model, params, _ = _dense()
    before = jax.tree.map(np.array, params)

    def batches():
        yield from correlated(jax.random.key(0), batches=2)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gptq(model, params, INT4, batches(), progress=False)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.array, params))
    assert all(isinstance(v, jax.Array) for v in jax.tree.leaves(params))


class Boxed(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
        return nn.Dense(N, kernel_init=init, name="dense")(x)


def test_boxed_params_keep_their_boxes_and_load():
    model = Boxed()
    xs = correlated(jax.random.key(0), batches=2)
    fparams = model.init(jax.random.key(1), xs[0])["params"]
    rules = [qflax.QuantizationRule(weight_qtype="int4")]
    out = gptq(model, fparams, rules, xs, progress=False)
    kernel = out["dense"]["kernel"]
    assert isinstance(kernel, qflax.QuantizedParam)
    assert isinstance(kernel.qarray.qvalue, nn.Partitioned)
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    y = qmodel.apply({"params": out}, xs[0])
    wq = qcore.dequantize(nn.meta.unbox(kernel).qarray)
    ref = xs[0] @ wq + fparams["dense"]["bias"][None]
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-4, atol=1e-4)


class NnxStack(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(K, K, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(K, N, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.head(x)


def test_nnx_list_paths_and_reusing_collected_stats():
    xs = correlated(jax.random.key(0), batches=2)
    model = NnxStack(nnx.Rngs(0))
    rules = [
        qflax.QuantizationRule(module_path="head", weight_qtype=None),
        qflax.QuantizationRule(weight_qtype="int4", tile_size=16),
    ]
    stats = collect(model, None, rules, xs, progress=False)
    assert list(stats) == ["layers/0/kernel", "layers/1/kernel"]
    a = gptq(model, None, rules, None, stats=stats, progress=False)
    b = gptq(model, None, rules, None, stats=stats, act_order=True, progress=False)
    assert isinstance(a["layers"][1]["kernel"], qflax.QuantizedParam)
    assert isinstance(b["layers"][0]["kernel"], qflax.QuantizedParam)
    assert isinstance(a["head"]["kernel"], jax.Array)
    ptq_model = nnx.eval_shape(
        lambda: qflax.quantize_model(NnxStack(nnx.Rngs(0)), qflax.PtqProvider(rules), xs[0])
    )
    graphdef, state = nnx.split(ptq_model)
    nnx.replace_by_pure_dict(state, a)
    y = nnx.merge(graphdef, state)(xs[0])
    h = xs[0]
    for i in range(2):
        w = qcore.dequantize(a["layers"][i]["kernel"].qarray)
        h = jax.nn.relu(h @ w + a["layers"][i]["bias"][None])
    ref = h @ a["head"]["kernel"] + a["head"]["bias"][None]
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-4, atol=1e-4)


# -- AWQ (qflax.awq) -----------------------------------------------------------------


Normed = zoo.Normed
OUTLIERS = (25.0, 40.0, 15.0)  # channels 1, 7 and 20, times the rest


def outlier_inputs(key, batches=4, rows=64):
    return zoo.outlier_inputs(key, OUTLIERS, batches, rows, K)


TILE = 8


def awq_case():
    """Normed, calibration and held-out outlier inputs, int4 rules with tiles, RTN params.

    AWQ needs sub-channel tiles (groups): with one scale per output channel over only
    K=32 inputs, scaling the salient rows up raises the whole channel's scale and the
    search keeps alpha near 0 (RTN).
    """
    model = Normed()
    xs = outlier_inputs(jax.random.key(0))
    held_out = outlier_inputs(jax.random.key(1), batches=2)
    fparams = model.init(jax.random.key(2), xs[0])["params"]
    rules = [qflax.QuantizationRule(weight_qtype="int4", tile_size=TILE)]
    return model, xs, held_out, fparams, rules, *ptq(model, rules, xs[0], fparams)


def test_awq_beats_rtn_on_inputs_with_outlier_channels():
    model, xs, held_out, fparams, rules, qmodel, rtn = awq_case()
    out = awq(model, fparams, rules, xs, fold_into={"dense/kernel": "g"}, progress=False)
    e_rtn = mae(qmodel, rtn, model, fparams, held_out)
    e_awq = mae(qmodel, out, model, fparams, held_out)
    print(f"AWQ int4 tile={TILE}: MAE RTN {e_rtn:.5f} AWQ {e_awq:.5f}")
    assert e_awq < 0.95 * e_rtn
    assert out["dense"]["kernel"].recipe == rtn["dense"]["kernel"].recipe
    assert not np.allclose(np.asarray(out["g"]), 1.0)  # 1/s folded into g
    np.testing.assert_array_equal(np.asarray(fparams["g"]), 1.0)  # input untouched
    # The plain PTQ model computes (x * g / s) @ dequantize(Q(s W)).
    x = held_out[0]
    ref = (x * out["g"][None]) @ qcore.dequantize(out["dense"]["kernel"].qarray)
    y = qmodel.apply({"params": out}, x)
    np.testing.assert_allclose(
        np.asarray(y), np.asarray(ref + fparams["dense"]["bias"][None]), rtol=1e-4, atol=1e-4
    )


def test_awq_carried_scale_beats_rtn_and_is_computed_as_stated():
    # Without a fold target the scale rides in the QuantizedParam and the op divides
    # its input by it: the model (and g) stay untouched.
    model, xs, held_out, fparams, rules, qmodel, rtn = awq_case()
    out = awq(model, fparams, rules, xs, progress=False)
    kernel = out["dense"]["kernel"]
    assert kernel.recipe.input_scale_axis == 0
    assert kernel.recipe.spec == rtn["dense"]["kernel"].recipe.spec
    np.testing.assert_array_equal(np.asarray(out["g"]), np.asarray(fparams["g"]))
    s = np.asarray(kernel.input_scale, np.float64)
    assert s.shape == (K,) and np.ptp(s) > 0.1  # a real scale, not ones
    e_rtn = mae(qmodel, rtn, model, fparams, held_out)
    e_awq = mae(qmodel, out, model, fparams, held_out)
    folded = awq(model, fparams, rules, xs, fold_into={"dense/kernel": "g"}, progress=False)
    e_folded = mae(qmodel, folded, model, fparams, held_out)
    print(f"AWQ int4 tile={TILE}: MAE RTN {e_rtn:.5f} carried {e_awq:.5f} folded {e_folded:.5f}")
    assert e_awq < 0.95 * e_rtn
    assert e_awq == pytest.approx(e_folded, rel=1e-3)  # same s, the same model
    # float64: y = (x * g / s) @ dequantize(Q(s W)) + b
    x = np.asarray(held_out[0], np.float64)
    wq = np.asarray(qcore.dequantize(kernel.qarray), np.float64)
    ref = (x * np.asarray(fparams["g"], np.float64)[None] / s[None]) @ wq
    ref += np.asarray(fparams["dense"]["bias"], np.float64)[None]
    y = jax.jit(qmodel.apply)({"params": out}, held_out[0])
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-4, atol=1e-4)
    # What the module sees in place of the weight is Q(s W) / s.
    np.testing.assert_allclose(
        np.asarray(stand_in(kernel), np.float64), wq / s[:, None], rtol=1e-6, atol=1e-7
    )


def test_awq_carried_scale_keeps_boxes_and_works_under_nnx():
    model = Boxed()
    xs = outlier_inputs(jax.random.key(0), batches=2)
    fparams = model.init(jax.random.key(1), xs[0])["params"]
    rules = [qflax.QuantizationRule(weight_qtype="int4", tile_size=8)]
    out = awq(model, fparams, rules, xs, progress=False)
    kernel = out["dense"]["kernel"]
    assert isinstance(kernel.input_scale, nn.Partitioned)
    assert kernel.input_scale.names == (None,)
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    y = qmodel.apply({"params": out}, xs[0])
    plain = nn.meta.unbox(kernel)
    ref = (xs[0] / plain.input_scale[None]) @ qcore.dequantize(plain.qarray)
    np.testing.assert_allclose(
        np.asarray(y), np.asarray(ref + fparams["dense"]["bias"][None]), rtol=1e-4, atol=1e-4
    )

    class NnxDense(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(K, N, rngs=rngs)

        def __call__(self, x):
            return self.dense(x)

    nmodel = NnxDense(nnx.Rngs(0))
    nout = awq(nmodel, None, rules, xs, progress=False)
    ptq_model = nnx.eval_shape(
        lambda: qflax.quantize_model(NnxDense(nnx.Rngs(0)), qflax.PtqProvider(rules), xs[0])
    )
    graphdef, state = nnx.split(ptq_model)
    nnx.replace_by_pure_dict(state, nout)
    y = nnx.merge(graphdef, state)(xs[1])
    nk = nout["dense"]["kernel"]
    ref = (xs[1] / nk.input_scale[None]) @ qcore.dequantize(nk.qarray)
    ref = ref + nout["dense"]["bias"][None]
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-4, atol=1e-4)


def test_quantized_param_input_scale_must_match_its_recipe():
    model = Normed()
    xs = outlier_inputs(jax.random.key(0), batches=1)
    fparams = model.init(jax.random.key(2), xs[0])["params"]
    kernel = awq(model, fparams, INT4, xs, progress=False)["dense"]["kernel"]
    with pytest.raises(ValueError, match=r"input_scale=None does not match .*input_scale_axis=0"):
        qflax.QuantizedParam(kernel.qarray, kernel.recipe)
    bare = dataclasses.replace(kernel.recipe, input_scale_axis=None)
    with pytest.raises(ValueError, match="give both or neither"):
        qflax.QuantizedParam(kernel.qarray, bare, kernel.input_scale)


def test_awq_bad_fold_targets_are_errors():
    model = Normed()
    xs = outlier_inputs(jax.random.key(0), batches=1)
    fparams = model.init(jax.random.key(2), xs[0])["params"]
    with pytest.raises(ValueError, match="not a param"):
        awq(model, fparams, INT4, xs, fold_into={"dense/kernel": "nope"}, progress=False)
    with pytest.raises(ValueError, match="no quantized weight"):
        awq(model, fparams, INT4, xs, fold_into={"g": "dense/bias"}, progress=False)
    with pytest.raises(ValueError, match="input channels"):
        awq(model, fparams, INT4, xs, fold_into={"dense/kernel": "dense/bias"}, progress=False)
    with pytest.raises(ValueError, match="no calibration data"):
        awq(model, fparams, INT4, [], fold_into={}, progress=False)

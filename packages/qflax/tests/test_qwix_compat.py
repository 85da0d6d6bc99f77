"""qflax where Qwix 0.1.8 users expect Qwix's behaviour (issue 20, item 9), without Qwix.

The references are the float model, qcore's own quantization of the same weight, and
closed forms; Qwix's numbers are recorded in ``packages/qcore/tests/fixtures``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcore
import qflax
from qflax import QuantizationRule as Rule

X = jax.random.normal(jax.random.key(1), (4, 8, 32))


def _rel(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _ptq(model, rules, x):
    params = model.init(jax.random.key(0), x)["params"]
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
    return params, qmodel, qflax.quantize_params(params, abstract)


def test_fixed_with_one_bound_is_the_symmetric_range():
    short = [Rule(weight_qtype="int8", weight_calibration_method="fixed,0.5")]
    full = [Rule(weight_qtype="int8", weight_calibration_method="fixed,-0.5,0.5")]
    model = nn.Dense(16)
    params, _, q_short = _ptq(model, short, X)
    _, _, q_full = _ptq(model, full, X)
    a, b = q_short["kernel"].qarray, q_full["kernel"].qarray
    np.testing.assert_array_equal(np.asarray(a.qvalue), np.asarray(b.qvalue))
    np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
    # Closed form: codes round(w / (0.5 / 127.5)), one scale for the whole kernel.
    w = np.asarray(params["kernel"], np.float64)
    step = np.float64(np.float32(0.5) / np.float32(127.5))
    np.testing.assert_array_equal(np.asarray(a.qvalue), np.clip(np.round(w / step), -128, 127))


class _Attention(nn.Module):
    """Owns no param itself: its q @ k einsum sits between its Dense submodules."""

    @nn.compact
    def __call__(self, x):
        q, k = nn.Dense(32, name="q")(x), nn.Dense(32, name="k")(x)
        att = jax.nn.softmax(jnp.einsum("bsd,btd->bst", q, k) / 32**0.5)
        return nn.Dense(16, name="out")(att @ x)


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _Attention(name="attention")(x)


STATIC = [Rule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]


def test_static_scales_of_a_module_without_params_are_made():
    model = _Net()
    qat = qflax.quantize_model(model, qflax.QtProvider(STATIC))
    variables = qat.init(jax.random.key(0), X)
    _, stats = qat.apply(variables, X, mutable=["quant_stats"])
    ptq = qflax.quantize_model(model, qflax.PtqProvider(STATIC))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), X)["params"]
    assert isinstance(abstract["attention"]["einsum0_lhs_scale"], qflax.ActScale)
    params = qflax.quantize_params(variables["params"], abstract, stats["quant_stats"])
    got = params["attention"]["einsum0_lhs_scale"].scale
    stat = stats["quant_stats"]["attention"]["einsum0_lhs"]
    assert float(got) == pytest.approx(max(-float(stat["lo"]), float(stat["hi"])) / 127.5)
    y = ptq.apply({"params": params}, X)
    np.testing.assert_array_equal(y, qat.apply({**variables, **stats}, X))
    assert _rel(y, model.apply({"params": variables["params"]}, X)) < 0.03
    # A piece of the params (a checkpoint loaded module by module) brings the scales of
    # the param-less modules above it; pieces elsewhere do not.
    scales = {k for k in abstract["attention"] if k.endswith("_scale")}
    assert {"einsum0_lhs_scale", "einsum0_rhs_scale"} <= scales
    piece = {"attention": {"q": variables["params"]["attention"]["q"]}}
    only_q = qflax.quantize_params(piece, abstract, stats["quant_stats"])
    assert set(only_q["attention"]) == {"q"} | scales
    for name in scales:
        assert only_q["attention"][name].scale == params["attention"][name].scale


def test_static_scales_are_per_tensor_scalars():
    """Kept on purpose (Qwix keeps the operand's rank, (1, seq, 1) for a Dense input)."""
    model = nn.Dense(16)
    qat = qflax.quantize_model(model, qflax.QtProvider(STATIC))
    variables = qat.init(jax.random.key(0), X)
    _, stats = qat.apply(variables, X, mutable=["quant_stats"])
    ptq = qflax.quantize_model(model, qflax.PtqProvider(STATIC))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), X)["params"]
    params = qflax.quantize_params(variables["params"], abstract, stats["quant_stats"])
    assert params["dot_general0_lhs_scale"].scale.shape == ()
    # The same scale serves a rank-2 input (decode step) and a rank-3 one.
    for x in (X[:, 0], X):
        y = ptq.apply({"params": params}, x)
        assert _rel(y, model.apply({"params": variables["params"]}, x)) < 0.03


class _Proj(nn.Module):
    """An attention output projection: kernel (heads, head_dim, d), two contracted axes."""

    @nn.compact
    def __call__(self, x):
        return nn.DenseGeneral(24, axis=(-2, -1))(x)


def _kernel(tree):
    return tree["kernel"] if "kernel" in tree else tree["DenseGeneral_0"]["kernel"]


@pytest.mark.parametrize("model", [nn.Dense(16), _Proj()], ids=["dense", "two_contracted"])
def test_mxfp8_weights_get_blocks_of_32_along_the_innermost_contracted_axis(model):
    x = X if isinstance(model, nn.Dense) else X.reshape(4, 8, 2, 16).repeat(2, -1)
    params, qmodel, qparams = _ptq(model, [Rule(weight_qtype="mxfp8")], x)
    w = _kernel(params)
    q = _kernel(qparams).qarray
    # Qwix's spec for tile_size=32: blocks of 32 along the last contracted axis, one
    # scale per output channel, other contracted axes reduced.
    ndim = w.ndim
    how = qcore.HowToQuantize(qtype="mxfp8", channelwise_axes=ndim - 1, tiled_axes={ndim - 2: 32})
    assert q.scale.shape == how.scale_shape(w.shape)
    assert q.scale_tile_shape[ndim - 2] == 32
    assert q.scale.dtype == jnp.float8_e8m0fnu
    ref = qcore.quantize(jnp.asarray(w), how)
    np.testing.assert_array_equal(
        np.asarray(q.qvalue, np.float32), np.asarray(ref.qvalue, np.float32)
    )
    y = qmodel.apply({"params": qparams}, x)
    assert _rel(y, model.apply({"params": params}, x)) < 0.05

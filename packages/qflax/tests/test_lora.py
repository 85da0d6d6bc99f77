"""LoRA / QLoRA: the output formula against float64 numpy, frozen bases under optax,
jit / grad / remat / scan, shardings of the factors, and errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from archs import small as zoo
from flax import nnx

import qcore
import qflax
from qcore import testing
from qflax.lora import LoraParam, LoraProvider, LoraRule, merge_params, split_params
from qflax.qparam import stand_in

RANDOM_B = nn.initializers.normal(1.0)  # a non-zero B, so the adapter path shows


def f64(a):
    return np.asarray(a, dtype=np.float64)


def dense_ref(x, kernel, bias, a, b, scale):
    """Float64 ``x W + bias + x A B * scale``."""
    x = f64(x)
    return x @ f64(kernel) + f64(bias) + (x @ f64(a)) @ f64(b) * scale


def conv_ref(x, kernel):
    """Float64 NHWC / HWIO convolution, stride 1, 'SAME' padding, odd window."""
    x, kernel = f64(x), f64(kernel)
    kh, kw = kernel.shape[:2]
    pad = np.pad(x, ((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)))
    n, h, w, _ = x.shape
    out = np.zeros((n, h, w, kernel.shape[3]))
    for i in range(h):
        for j in range(w):
            out[:, i, j] = np.einsum("nhwc,hwco->no", pad[:, i : i + kh, j : j + kw], kernel)
    return out


def linen(rule, model, x, rngs=None):
    qmodel = qflax.quantize_model(model, LoraProvider([rule]))
    variables = qmodel.init(jax.random.key(0), x)
    return qmodel, variables


# -- rule validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, "rank=0 must be an int >= 1"),
        ({"rank": -2}, "rank=-2 must be an int >= 1"),
        ({"rank": 1.5}, "rank=1.5 must be an int >= 1"),
        ({"rank": True}, "rank=True must be an int >= 1"),
        ({"rank": 2, "alpha": -1.0}, r"alpha=-1.0 must be a finite number > 0 \(or None\)"),
        ({"rank": 2, "alpha": 0}, "alpha=0 must be a finite number > 0"),
        ({"rank": 2, "alpha": float("nan")}, "alpha=nan must be a finite number > 0"),
        ({"rank": 2, "dropout": 1.0}, r"dropout=1.0 must be a number in \[0, 1\)"),
        ({"rank": 2, "dropout": -0.1}, r"dropout=-0.1 must be a number in \[0, 1\)"),
        ({"rank": 2, "a_initializer": 3}, "a_initializer=3 must be a callable"),
        ({"rank": 2, "act_qtype": "int8"}, "act_qtype='int8': LoraRule quantizes only"),
        ({"rank": 2, "weight_qtype": "int5x"}, "weight_qtype"),
        ({"rank": 2, "op_names": ["ragged_dot"]}, "not available for ragged_dot"),
    ],
)
def test_bad_rules_name_the_argument_and_the_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraRule(**kwargs)


def test_rule_is_keyword_only_frozen_and_scales_by_alpha_over_rank():
    rule = LoraRule(rank=4, alpha=2.0)
    assert rule.scale == 0.5
    assert LoraRule(rank=4).scale == 1.0
    with pytest.raises(TypeError):
        LoraRule(4)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        rule.rank = 3  # type: ignore[misc]


# -- the output formula ----------------------------------------------------------------


@pytest.mark.parametrize("qtype", [None, "nf4", "int4"])
def test_linen_dense_output_is_base_plus_scaled_low_rank_path(qtype):
    x = jax.random.normal(jax.random.key(1), (3, 8))
    rule = LoraRule(rank=2, alpha=3.0, b_initializer=RANDOM_B, weight_qtype=qtype, tile_size=4)
    qmodel, variables = linen(rule, nn.Dense(5), x)
    p = variables["params"]
    a, b = p["dot_general0_lora_a"], p["dot_general0_lora_b"]
    assert a.shape == (8, 2) and b.shape == (2, 5)
    assert float(jnp.abs(b).max()) > 0
    kernel = p["kernel"]
    if qtype is not None:
        assert isinstance(kernel, qflax.QuantizedParam)
        assert kernel.recipe.spec.resolved_qtype.name == qtype
        kernel = stand_in(kernel)  # the base the op computes with
    y = jax.jit(qmodel.apply)(variables, x)
    np.testing.assert_allclose(y, dense_ref(x, kernel, p["bias"], a, b, 1.5), rtol=1e-5, atol=1e-5)


def test_qlora_on_an_awq_base_divides_only_the_base_input_by_the_carried_scale():
    from qflax.awq import awq

    channels = jnp.ones(8).at[2].set(30.0)
    xs = [jax.random.normal(jax.random.key(i), (32, 8)) * channels[None] for i in range(3)]
    fparams = nn.Dense(5).init(jax.random.key(0), xs[0])["params"]
    base = awq(nn.Dense(5), fparams, [qflax.QuantizationRule(weight_qtype="int4", tile_size=4)],
               xs, progress=False)  # fmt: skip
    kernel = base["kernel"]
    s = f64(kernel.input_scale)
    assert np.ptp(s) > 0.1
    rule = LoraRule(rank=2, alpha=3.0, b_initializer=RANDOM_B, weight_qtype="int4", tile_size=4)
    qmodel, variables = linen(rule, nn.Dense(5), xs[0])
    p = {**variables["params"], "kernel": kernel}
    a, b = p["dot_general0_lora_a"], p["dot_general0_lora_b"]
    y = jax.jit(qmodel.apply)({"params": p}, xs[1])
    w = f64(qcore.dequantize(kernel.qarray)) / s[:, None]  # (x / s) Q(s W) = x (Q(s W) / s)
    ref = dense_ref(xs[1], w, p["bias"], a, b, 1.5)  # the adapter sees x itself
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


def test_default_init_starts_at_the_base_model_exactly():
    x = jax.random.normal(jax.random.key(1), (3, 8))
    qmodel, variables = linen(LoraRule(rank=2), nn.Dense(5), x)
    p = variables["params"]
    assert not np.any(np.asarray(p["dot_general0_lora_b"]))
    assert float(jnp.std(p["dot_general0_lora_a"])) > 0.1  # He uniform, not zeros
    base = nn.Dense(5).apply({"params": {"kernel": p["kernel"], "bias": p["bias"]}}, x)
    np.testing.assert_array_equal(qmodel.apply(variables, x), base)
    # Same for NNX.
    model = nnx.Linear(8, 5, rngs=nnx.Rngs(0))
    ref = model(x)
    model = qflax.quantize_model(model, LoraProvider([LoraRule(rank=2)]), x)
    np.testing.assert_array_equal(model(x), ref)


class EinsumLayer(nn.Module):
    """A 3-D weight contracted over two axes: ``A`` is (4*6, r), ``B`` is (r, 5)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (4, 5, 6))
        return jnp.einsum("bij,ikj->bk", x, w)


def test_einsum_adapter_is_a_b_laid_out_as_the_weight():
    x = jax.random.normal(jax.random.key(1), (2, 4, 6))
    rule = LoraRule(rank=3, alpha=6.0, b_initializer=RANDOM_B)
    qmodel, variables = linen(rule, EinsumLayer(), x)
    p = variables["params"]
    a, b = f64(p["einsum0_lora_a"]), f64(p["einsum0_lora_b"])
    assert a.shape == (24, 3) and b.shape == (3, 5)
    # Independent: contract x's (i, j) with A viewed as (i, j, r), then with B.
    h = np.einsum("bij,ijr->br", f64(x), a.reshape(4, 6, 3))
    ref = np.einsum("bij,ikj->bk", f64(x), f64(p["w"])) + h @ b * 2.0
    np.testing.assert_allclose(jax.jit(qmodel.apply)(variables, x), ref, rtol=1e-5, atol=1e-5)


def test_conv_adapter_is_a_rank_r_conv_then_a_1x1_conv():
    x = jax.random.normal(jax.random.key(1), (1, 4, 4, 3))
    rule = LoraRule(rank=2, alpha=1.0, b_initializer=RANDOM_B)
    model = nn.Conv(4, (3, 3), use_bias=False)
    qmodel, variables = linen(rule, model, x)
    p = variables["params"]
    a, b = p["conv_general_dilated0_lora_a"], p["conv_general_dilated0_lora_b"]
    assert a.shape == (27, 2) and b.shape == (2, 4)
    low = conv_ref(x, f64(a).reshape(3, 3, 3, 2))  # same window, rank output channels
    ref = conv_ref(x, p["kernel"]) + low @ f64(b) * 0.5  # then the 1x1 conv B
    np.testing.assert_allclose(jax.jit(qmodel.apply)(variables, x), ref, rtol=1e-5, atol=1e-5)


def test_matmul_operator_gets_an_adapter_too():
    class MatmulLayer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x @ self.param("w", nn.initializers.lecun_normal(), (8, 4))

    x = jax.random.normal(jax.random.key(1), (3, 8))
    qmodel, variables = linen(LoraRule(rank=2, b_initializer=RANDOM_B), MatmulLayer(), x)
    p = variables["params"]
    ref = f64(x) @ f64(p["w"]) + f64(x) @ f64(p["matmul0_lora_a"]) @ f64(p["matmul0_lora_b"])
    np.testing.assert_allclose(jax.jit(qmodel.apply)(variables, x), ref, rtol=1e-5, atol=1e-5)


def test_nnx_output_formula_and_qlora_base():
    x = jax.random.normal(jax.random.key(1), (3, 8))
    rule = LoraRule(rank=2, alpha=1.0, b_initializer=RANDOM_B, weight_qtype="nf4", tile_size=4)
    model = qflax.quantize_model(nnx.Linear(8, 5, rngs=nnx.Rngs(0)), LoraProvider([rule]), x)
    kernel = model.kernel.get_raw_value()
    assert isinstance(kernel, qflax.QuantizedParam)
    a, b = model.dot_general0_lora_a.get_raw_value(), model.dot_general0_lora_b.get_raw_value()
    assert isinstance(model.dot_general0_lora_a, LoraParam)
    ref = dense_ref(x, stand_in(kernel), model.bias.get_raw_value(), a, b, 0.5)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(model, x), ref, rtol=1e-5, atol=1e-5)


# -- training: only the adapters move ----------------------------------------------------


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb, strict=True)
    )


@pytest.mark.parametrize("qtype", [None, "nf4"])
def test_linen_optax_trains_only_the_factors(qtype):
    x = jax.random.normal(jax.random.key(1), (4, 8))
    target = jax.random.normal(jax.random.key(2), (4, 5))
    rule = LoraRule(rank=2, weight_qtype=qtype, tile_size=4)
    qmodel, variables = linen(rule, nn.Dense(5), x)
    lora, frozen = split_params(variables["params"])
    assert sorted(lora) == ["dot_general0_lora_a", "dot_general0_lora_b"]
    frozen_before = jax.tree.map(np.array, frozen)
    tx = optax.sgd(0.1)
    state = tx.init(lora)

    def loss(lora):
        y = qmodel.apply({"params": merge_params(lora, frozen)}, x)
        return jnp.mean((y - target) ** 2)

    @jax.jit
    def step(lora, state):
        value, grads = jax.value_and_grad(loss)(lora)
        updates, state = tx.update(grads, state)
        return optax.apply_updates(lora, updates), state, value

    losses = []
    start = lora
    for _ in range(5):
        lora, state, value = step(lora, state)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    assert not np.array_equal(lora["dot_general0_lora_b"], start["dot_general0_lora_b"])
    assert not np.array_equal(lora["dot_general0_lora_a"], start["dot_general0_lora_a"])
    assert leaves_equal(frozen, frozen_before)  # the base is bit-identical
    if qtype is not None:
        kernel = merge_params(lora, frozen)["kernel"]
        assert isinstance(kernel, qflax.QuantizedParam)
        assert kernel.recipe.spec.resolved_qtype.name == "nf4" and kernel.recipe.spec.pack
        assert kernel.qarray.qvalue.dtype == jnp.uint8  # packed nf4 codes
        assert kernel.qarray.qvalue.shape == (4, 5)


@pytest.mark.parametrize("qtype", [None, "int4"])
def test_nnx_optimizer_with_lora_param_filter_trains_only_the_factors(qtype):
    x = jax.random.normal(jax.random.key(1), (4, 8))
    target = jax.random.normal(jax.random.key(2), (4, 5))
    rule = LoraRule(rank=2, weight_qtype=qtype, tile_size=4)
    model = qflax.quantize_model(nnx.Linear(8, 5, rngs=nnx.Rngs(0)), LoraProvider([rule]), x)
    base_before = jax.tree.map(np.array, nnx.state(model, nnx.Not(LoraParam)))
    lora_before = jax.tree.map(np.array, nnx.state(model, LoraParam))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=LoraParam)

    @nnx.jit
    def step(model, optimizer):
        def loss(model):
            return jnp.mean((model(x) - target) ** 2)

        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, LoraParam))(model)
        optimizer.update(model, grads)
        return value

    losses = [float(step(model, optimizer)) for _ in range(5)]
    assert losses[-1] < losses[0]
    assert leaves_equal(nnx.state(model, nnx.Not(LoraParam)), base_before)
    assert not leaves_equal(nnx.state(model, LoraParam), lora_before)
    if qtype is not None:
        kernel = model.kernel.get_raw_value()
        assert isinstance(kernel, qflax.QuantizedParam)
        assert kernel.qarray.qvalue.dtype == jnp.uint8 and kernel.qarray.qvalue.shape == (4, 5)


# -- transforms ------------------------------------------------------------------------


def test_linen_scan_stacks_the_factors_and_matches_a_per_layer_loop():
    x = jax.random.normal(jax.random.key(1), (2, 32))
    rule = LoraRule(rank=3, alpha=6.0, b_initializer=RANDOM_B, weight_qtype="int8")
    qmodel, variables = linen(rule, zoo.LinenScan(), x)
    p = variables["params"]["layers"]["Dense_0"]
    assert p["dot_general0_lora_a"].shape == (4, 32, 3)
    assert p["dot_general0_lora_b"].shape == (4, 3, 32)
    assert p["kernel"].qarray.qvalue.shape == (4, 32, 32)
    y = jax.jit(qmodel.apply)(variables, x)
    h = f64(x)
    for i in range(4):
        kernel = stand_in(jax.tree.map(lambda v, i=i: v[i], p["kernel"]))
        a, b = p["dot_general0_lora_a"][i], p["dot_general0_lora_b"][i]
        h = np.tanh(dense_ref(h, kernel, p["bias"][i], a, b, 2.0))
    np.testing.assert_allclose(y, h, rtol=1e-4, atol=1e-5)
    lora, frozen = split_params(variables["params"])
    grads = jax.jit(
        jax.grad(lambda lo: jnp.sum(qmodel.apply({"params": merge_params(lo, frozen)}, x)))
    )(lora)
    g = grads["layers"]["Dense_0"]
    assert g["dot_general0_lora_b"].shape == (4, 3, 32)
    assert all(float(jnp.abs(g["dot_general0_lora_b"][i]).max()) > 0 for i in range(4))


class LinenRemat(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.remat(nn.Dense)(4, name="dense")(jnp.tanh(x))


def test_linen_remat_and_grad_match_finite_formula():
    x = jax.random.normal(jax.random.key(1), (2, 6))
    qmodel, variables = linen(LoraRule(rank=2, b_initializer=RANDOM_B), LinenRemat(), x)
    p = variables["params"]["dense"]
    ref = dense_ref(
        np.tanh(f64(x)),
        p["kernel"],
        p["bias"],
        p["dot_general0_lora_a"],
        p["dot_general0_lora_b"],
        1.0,
    )
    np.testing.assert_allclose(jax.jit(qmodel.apply)(variables, x), ref, rtol=1e-5, atol=1e-5)
    lora, frozen = split_params(variables["params"])
    grads = jax.jit(
        jax.grad(lambda lo: jnp.sum(qmodel.apply({"params": merge_params(lo, frozen)}, x)))
    )(lora)
    # d sum(h A B) / dB = (h A)^T 1 : checked against float64.
    h = np.tanh(f64(x)) @ f64(p["dot_general0_lora_a"])
    want = h.T @ np.ones((2, 4))
    np.testing.assert_allclose(grads["dense"]["dot_general0_lora_b"], want, rtol=1e-5, atol=1e-5)


class NnxRemat(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(6, 4, rngs=rngs)

    def __call__(self, x):
        return nnx.remat(lambda m, x: m(x))(self.linear, jnp.tanh(x))


def test_nnx_scan_and_remat():
    x = jax.random.normal(jax.random.key(1), (2, 32))
    rule = LoraRule(rank=2, b_initializer=RANDOM_B)
    model = qflax.quantize_model(zoo.NnxScan(nnx.Rngs(0)), LoraProvider([rule]), x)
    lin = model.layers.linear
    a, b = lin.dot_general0_lora_a.get_raw_value(), lin.dot_general0_lora_b.get_raw_value()
    assert a.shape == (4, 32, 2) and b.shape == (4, 2, 32)
    assert not np.array_equal(b[0], b[1])  # each layer its own init
    y = nnx.jit(lambda m, x: m(x))(model, x)
    h = f64(x)
    kernel, bias = lin.kernel.get_raw_value(), lin.bias.get_raw_value()
    for i in range(4):
        h = np.tanh(dense_ref(h, kernel[i], bias[i], a[i], b[i], 1.0))
    np.testing.assert_allclose(y, h, rtol=1e-4, atol=1e-5)
    grads = nnx.jit(
        lambda m: nnx.grad(lambda m: jnp.sum(m(x)), argnums=nnx.DiffState(0, LoraParam))(m)
    )(model)
    assert jax.tree.leaves(grads)[0].shape in ((4, 32, 2), (4, 2, 32))
    assert len(jax.tree.leaves(grads)) == 2
    # nnx.remat
    x = jax.random.normal(jax.random.key(1), (2, 6))
    model = qflax.quantize_model(NnxRemat(nnx.Rngs(0)), LoraProvider([rule]), x)
    lin = model.linear
    ref = dense_ref(
        np.tanh(f64(x)),
        lin.kernel.get_raw_value(),
        lin.bias.get_raw_value(),
        lin.dot_general0_lora_a.get_raw_value(),
        lin.dot_general0_lora_b.get_raw_value(),
        1.0,
    )
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(model, x), ref, rtol=1e-5, atol=1e-5)
    grads = nnx.jit(
        lambda m: nnx.grad(lambda m: jnp.sum(m(x)), argnums=nnx.DiffState(0, LoraParam))(m)
    )(model)
    assert float(jnp.abs(grads["linear"]["dot_general0_lora_b"][...]).max()) > 0


# -- dropout -----------------------------------------------------------------------------


def test_linen_dropout_only_with_the_rng_stream_and_drops_inputs():
    x = jax.random.normal(jax.random.key(1), (6, 4)) + 3.0  # no exact zeros
    rule = LoraRule(rank=4, dropout=0.5, b_initializer=RANDOM_B)
    qmodel, variables = linen(rule, nn.Dense(4), x)
    p = variables["params"]
    a, b = f64(p["dot_general0_lora_a"]), f64(p["dot_general0_lora_b"])
    base = f64(x) @ f64(p["kernel"]) + f64(p["bias"])
    eval_y = jax.jit(qmodel.apply)(variables, x)
    np.testing.assert_allclose(eval_y, base + f64(x) @ a @ b, rtol=1e-5, atol=1e-4)
    train_y = jax.jit(qmodel.apply)(variables, x, rngs={"dropout": jax.random.key(7)})
    # Recover the adapter's input: delta = x_d A B with A B square and invertible.
    x_d = (f64(train_y) - base) @ np.linalg.inv(a @ b)
    dropped = np.isclose(x_d, 0.0, atol=1e-3)
    kept = np.isclose(x_d, 2.0 * f64(x), rtol=1e-3)
    assert np.all(dropped | kept)
    assert 0 < dropped.sum() < dropped.size
    other = qmodel.apply(variables, x, rngs={"dropout": jax.random.key(8)})
    assert not np.allclose(other, train_y)


def test_nnx_dropout_follows_train_and_eval():
    x = jax.random.normal(jax.random.key(1), (6, 4)) + 3.0
    rule = LoraRule(rank=4, dropout=0.5, b_initializer=RANDOM_B)
    model = qflax.quantize_model(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), LoraProvider([rule]), x)
    assert isinstance(model.dot_general0_lora_dropout, nnx.Dropout)
    a = f64(model.dot_general0_lora_a.get_raw_value())
    b = f64(model.dot_general0_lora_b.get_raw_value())
    base = f64(x) @ f64(model.kernel.get_raw_value()) + f64(model.bias.get_raw_value())
    run = nnx.jit(lambda m, x: m(x))
    first, second = run(model, x), run(model, x)  # training mode: the stream advances
    assert not np.allclose(first, second)
    x_d = (f64(first) - base) @ np.linalg.inv(a @ b)
    dropped = np.isclose(x_d, 0.0, atol=1e-3)
    assert np.all(dropped | np.isclose(x_d, 2.0 * f64(x), rtol=1e-3))
    assert 0 < dropped.sum() < dropped.size
    model.eval()
    np.testing.assert_allclose(run(model, x), base + f64(x) @ a @ b, rtol=1e-5, atol=1e-4)


def test_nnx_dropout_on_stacked_layers_is_a_clear_error():
    x = jnp.ones((2, 32))
    with pytest.raises(ValueError, match="on stacked NNX layers .* is not available yet"):
        qflax.quantize_model(
            zoo.NnxScan(nnx.Rngs(0)), LoraProvider([LoraRule(rank=2, dropout=0.1)]), x
        )


# -- shardings ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [None, "int8"])
def test_factors_follow_the_base_weights_partitioning(qtype):
    init = nn.initializers.lecun_normal()

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
            return nn.Dense(8, kernel_init=nn.with_partitioning(init, ("model", "data")))(x)

    x = jnp.ones((2, 8))
    qmodel = qflax.quantize_model(Net(), LoraProvider([LoraRule(rank=2, weight_qtype=qtype)]))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)
    specs = nn.get_partition_spec(abstract)["params"]
    P = jax.sharding.PartitionSpec
    assert specs["Dense_0"]["dot_general0_lora_a"] == P("embed", None)
    assert specs["Dense_0"]["dot_general0_lora_b"] == P(None, "mlp")
    assert specs["Dense_1"]["dot_general0_lora_a"] == P("model", None)
    assert specs["Dense_1"]["dot_general0_lora_b"] == P(None, "data")
    variables = qmodel.init(jax.random.key(0), x)
    assert isinstance(
        variables["params"]["Dense_0"]["dot_general0_lora_a"], nn.LogicallyPartitioned
    )
    assert isinstance(variables["params"]["Dense_1"]["dot_general0_lora_b"], nn.Partitioned)
    lora, frozen = split_params(variables["params"])
    y = qmodel.apply({"params": merge_params(lora, frozen)}, x)
    assert y.shape == (2, 8)


# -- errors ------------------------------------------------------------------------------


def test_rank_larger_than_the_weight_allows_is_an_error():
    qmodel = qflax.quantize_model(nn.Dense(3), LoraProvider([LoraRule(rank=4)]))
    with pytest.raises(
        ValueError, match=r"rank=4 is larger than min\(in_features, out_features\)=3"
    ):
        qmodel.init(jax.random.key(0), jnp.ones((1, 8)))


@pytest.mark.parametrize("weight_qtype", [None, "int8"])
def test_a_failed_nnx_conversion_leaves_the_model_as_it_was(weight_qtype):
    # fc1 (128 -> 256) takes rank 100; fc2 (256 -> 64) does not: nothing may be added.
    model = zoo.NnxMLP(nnx.Rngs(0))
    before = nnx.to_pure_dict(nnx.state(model))
    rules = [LoraRule(rank=100, weight_qtype=weight_qtype)]
    with pytest.raises(ValueError, match=r"rank=100 is larger than .*=64"):
        qflax.quantize_model(model, LoraProvider(rules), jnp.ones((2, 128)))
    assert type(model) is zoo.NnxMLP
    assert not nnx.state(model, LoraParam)
    after = nnx.to_pure_dict(nnx.state(model))
    assert jax.tree.structure(after) == jax.tree.structure(before)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)


def test_rule_matching_only_ops_without_a_weight_is_an_error():
    class Attention(nn.Module):
        @nn.compact
        def __call__(self, q):
            return jnp.einsum("bqd,bkd->bqk", q, q)

    qmodel = qflax.quantize_model(Attention(), LoraProvider([LoraRule(rank=2)]))
    with pytest.raises(ValueError, match="matched only ops without a weight operand"):
        qmodel.init(jax.random.key(0), jnp.ones((1, 3, 4)))


def test_ops_without_a_weight_are_skipped_when_the_rule_also_adapts_weights():
    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            wq = self.param("wq", nn.initializers.lecun_normal(), (4, 4))
            q = jnp.einsum("btd,de->bte", x, wq)
            att = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, x))  # no weight: skipped
            return nn.Dense(4)(jnp.einsum("bqk,bkd->bqd", att, x))

    x = jax.random.normal(jax.random.key(1), (1, 3, 4))
    rule = LoraRule(rank=2, b_initializer=RANDOM_B)
    qmodel, variables = linen(rule, Attention(), x)
    p = variables["params"]
    assert sorted(split_params(p)[0]) == ["Dense_0", "einsum0_lora_a", "einsum0_lora_b"]
    xd = f64(x)[0]
    q = xd @ f64(p["wq"]) + xd @ f64(p["einsum0_lora_a"]) @ f64(p["einsum0_lora_b"])
    logits = q @ xd.T
    att = np.exp(logits - logits.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    d = p["Dense_0"]
    ref = dense_ref(
        att @ xd, d["kernel"], d["bias"], d["dot_general0_lora_a"], d["dot_general0_lora_b"], 1.0
    )
    np.testing.assert_allclose(jax.jit(qmodel.apply)(variables, x)[0], ref, rtol=1e-5, atol=1e-5)


def test_missing_factors_at_apply_are_an_error():
    x = jnp.ones((1, 8))
    float_params = nn.Dense(3).init(jax.random.key(0), x)
    qmodel = qflax.quantize_model(nn.Dense(3), LoraProvider([LoraRule(rank=2)]))
    with pytest.raises(ValueError, match="LoRA params dot_general0_lora_a/_lora_b are missing"):
        qmodel.apply(float_params, x)
    # Applying with mutable params and a params key adds them to a float checkpoint.
    _, new = qmodel.apply(float_params, x, mutable=["params"], rngs={"params": jax.random.key(1)})
    assert new["params"]["dot_general0_lora_a"].shape == (8, 2)


NNX_SHARDED = """
import jax, jax.numpy as jnp
from flax import nnx
import qflax
from qcore import testing
from qflax.lora import LoraProvider, LoraRule
from jax.sharding import PartitionSpec as P

mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", "model"))
x = jnp.ones((2, 8))
with jax.set_mesh(mesh):
    model = nnx.Linear(8, 4, kernel_init=init, rngs=nnx.Rngs(0))
    model = qflax.quantize_model(model, LoraProvider([LoraRule(rank=2, weight_qtype="int8")]), x)
    a, b = model.dot_general0_lora_a.get_raw_value(), model.dot_general0_lora_b.get_raw_value()
    assert a.sharding.spec == P("data", None), a.sharding
    assert b.sharding.spec == P(None, "model"), b.sharding
    assert nnx.jit(lambda m, x: m(x))(model, x).shape == (2, 4)
print("ok")
"""


def test_nnx_factors_follow_the_base_weights_named_sharding():
    assert testing.run_on_cpu_devices(NNX_SHARDED, 4).strip() == "ok"


# -- shardings and per-expert adapters (Qwix 0.1.8 gives these shapes and specs too) ----

LORA2 = LoraRule(rank=2, b_initializer=RANDOM_B)


class ShardedNnx(nnx.Module):
    """A Linear, an einsum with two output axes and a stack of 3 experts (batch axis 0)."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        part = nnx.with_partitioning
        self.lin = nnx.Linear(16, 8, kernel_init=part(init, ("x", "tp")), rngs=rngs)
        self.ein = nnx.Einsum(
            "bd,dhk->bhk", (8, 4, 2), kernel_init=part(init, (None, "tp", None)), rngs=rngs
        )
        experts = jax.random.normal(rngs.params(), (3, 8, 6))
        self.experts = nnx.Param(experts, out_sharding=("ep", None, "tp"))

    def __call__(self, x):
        h = self.ein(self.lin(x)).reshape(x.shape[0], 8)
        per_expert = jnp.broadcast_to(h, (3, *h.shape))  # (experts, batch, d)
        return jax.lax.dot_general(per_expert, self.experts[...], (((2,), (1,)), ((0,), (0,))))


def test_nnx_factors_carry_sharding_metadata_and_keep_output_and_expert_axes():
    P = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((1, 1, 1), ("x", "tp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    x = jax.random.normal(jax.random.key(1), (2, 16))
    with jax.set_mesh(mesh):
        model = qflax.quantize_model(ShardedNnx(nnx.Rngs(0)), LoraProvider([LORA2]), x)
        want = {  # name: (shape, spec)
            "lin/dot_general0_lora_a": ((16, 2), P("x", None)),
            "lin/dot_general0_lora_b": ((2, 8), P(None, "tp")),
            "ein/einsum0_lora_a": ((8, 2), P(None, None)),
            "ein/einsum0_lora_b": ((2, 4, 2), P(None, "tp", None)),  # was flat (2, 8), replicated
            "dot_general0_lora_a": ((3, 8, 2), P("ep", None, None)),  # one adapter per expert
            "dot_general0_lora_b": ((3, 2, 6), P("ep", None, "tp")),
        }
        state = nnx.state(model, LoraParam)
        got = {
            "/".join(map(str, k)): (v.get_value().shape, v.get_value().sharding.spec)
            for k, v in nnx.to_flat_state(state)
        }
        assert got == want
        # The metadata says it too, so re-sharding (get_partition_spec) keeps the axes.
        specs = {
            "/".join(map(str, k)): v.get_value()
            for k, v in nnx.to_flat_state(nnx.get_partition_spec(state))
        }
        assert specs == {k: s for k, (_, s) in want.items()}
        # Qwix's filter (flax's nnx.LoRAParam) selects the same variables.
        assert len(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))) == len(want)
        y = nnx.jit(lambda m, x: m(x))(model, x)
    # Each expert's output is its base matmul plus its own low-rank path (float64).
    lin, ein = model.lin, model.ein
    xf = f64(x)
    h1 = xf @ f64(lin.kernel[...]) + f64(lin.bias[...])
    h1 += (xf @ f64(lin.dot_general0_lora_a[...])) @ f64(lin.dot_general0_lora_b[...])
    w = f64(ein.kernel[...])
    h2 = np.einsum("bd,dhk->bhk", h1, w)
    lo = h1 @ f64(ein.einsum0_lora_a[...])
    h2 += np.einsum("br,rhk->bhk", lo, f64(ein.einsum0_lora_b[...]))
    h2 = h2.reshape(2, 8)
    a, b = f64(model.dot_general0_lora_a[...]), f64(model.dot_general0_lora_b[...])
    for e in range(3):
        ref = h2 @ f64(model.experts[...][e]) + (h2 @ a[e]) @ b[e]
        np.testing.assert_allclose(np.asarray(y[e]), ref, rtol=2e-4, atol=2e-4)


def test_linen_einsum_experts_get_one_adapter_each_and_boxed_output_axes():
    init = nn.initializers.normal(1.0)

    class Moe(nn.Module):
        @nn.compact
        def __call__(self, x):  # x: (experts, tokens, d)
            w = self.param("w", nn.with_partitioning(init, ("ep", "d", "tp", None)), (3, 8, 2, 3))
            y = jnp.einsum("etd,edhk->ethk", x, w)
            out = self.param("out", nn.with_partitioning(init, ("tp", None, "d")), (2, 3, 5))
            return jnp.einsum("ethk,hkf->etf", y, out)  # two contracted axes

    x = jax.random.normal(jax.random.key(1), (3, 4, 8))
    qmodel, variables = linen(LORA2, Moe(), x)
    specs = nn.get_partition_spec(variables)["params"]
    P = jax.sharding.PartitionSpec
    assert specs["einsum0_lora_a"] == P("ep", "d", None)
    assert specs["einsum0_lora_b"] == P("ep", None, "tp", None)
    assert specs["einsum1_lora_a"] == P("tp", None)  # (h * k, rank): the first axis's name
    assert specs["einsum1_lora_b"] == P(None, "d")
    p = nn.unbox(variables["params"])
    a, b, w = f64(p["einsum0_lora_a"]), f64(p["einsum0_lora_b"]), f64(p["w"])
    assert a.shape == (3, 8, 2) and b.shape == (3, 2, 2, 3)
    y = np.einsum("etd,edhk->ethk", f64(x), w)
    y += np.einsum("etr,erhk->ethk", np.einsum("etd,edr->etr", f64(x), a), b)
    a1, b1 = f64(p["einsum1_lora_a"]), f64(p["einsum1_lora_b"])
    assert a1.shape == (6, 2) and b1.shape == (2, 5)
    ref = np.einsum("ethk,hkf->etf", y, f64(p["out"]))
    ref += (y.reshape(3, 4, 6) @ a1) @ b1
    np.testing.assert_allclose(jax.jit(qmodel.apply)(variables, x), ref, rtol=1e-5, atol=1e-5)

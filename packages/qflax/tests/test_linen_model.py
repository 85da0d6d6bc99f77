"""The quantized Linen model: one-pass init, decode caches, loops, and standing in for the model."""

import pickle

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from archs.tiny_lm import LMConfig, TinyLM, greedy_decode

import qflax
from qflax import QuantizationRule as Rule

W8 = [Rule(weight_qtype="int8")]
W8A8 = [Rule(weight_qtype="int8", act_qtype="int8")]


CFG = LMConfig()
IDS = jax.random.randint(jax.random.key(1), (2, CFG.max_len), 0, CFG.vocab)
FIRST = IDS[:, 0]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


# -- one-pass init -------------------------------------------------------------------


def test_init_float_params_are_exactly_model_inits():
    """QtProvider keeps float params: they must be model.init's, bit for bit."""
    rules = [Rule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
    want = TinyLM(CFG).init(jax.random.key(0), IDS)
    got = qflax.quantize_model(TinyLM(CFG), qflax.QtProvider(rules)).init(jax.random.key(0), IDS)
    jax.tree.map(np.testing.assert_array_equal, got["params"], want["params"])
    assert set(got) == {"params", "quant_stats"}


def test_ptq_init_is_quantize_params_of_model_init():
    qmodel = qflax.quantize_model(TinyLM(CFG), qflax.PtqProvider(W8A8))
    got = qmodel.init(jax.random.key(0), IDS)["params"]
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), IDS)["params"]
    want = qflax.quantize_params(TinyLM(CFG).init(jax.random.key(0), IDS)["params"], abstract)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert isinstance(got["embed"]["embedding"], qflax.QuantizedParam)  # take and attend


def test_init_runs_the_models_init_branch():
    class Branchy(nn.Module):
        @nn.compact
        def __call__(self, x):
            calls = self.variable("counters", "calls", jnp.zeros, (), jnp.int32)
            if not self.is_initializing():
                calls.value += 1
            return nn.Dense(4)(x)

    x = jnp.ones((2, 8))
    want = Branchy().init(jax.random.key(0), x)
    got = qflax.quantize_model(Branchy(), qflax.PtqProvider(W8)).init(jax.random.key(0), x)
    assert int(want["counters"]["calls"]) == 0
    assert int(got["counters"]["calls"]) == 0


@pytest.mark.parametrize("decode", [False, True])
def test_decode_attention_inits_quantized_also_abstractly(decode):
    qmodel = qflax.quantize_model(TinyLM(CFG, decode=decode), qflax.PtqProvider(W8))
    variables = qmodel.init(jax.random.key(0), IDS)
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), IDS)
    assert jax.tree.structure(variables) == jax.tree.structure(abstract)
    shapes = [(a.shape, a.dtype) for a in jax.tree.leaves(variables)]
    assert shapes == [(a.shape, a.dtype) for a in jax.tree.leaves(abstract)]
    assert ("cache" in variables) == decode
    assert isinstance(variables["params"]["attn"]["query"]["kernel"], qflax.QuantizedParam)


@pytest.mark.parametrize("rules", [W8, W8A8], ids=["w8", "w8a8"])
def test_quantized_decode_with_cache_matches_the_float_decode(rules):
    model = TinyLM(CFG)
    fparams = model.init(jax.random.key(0), IDS)["params"]
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    qparams = qmodel.init(jax.random.key(0), IDS)["params"]
    steps = CFG.max_len
    ftok, flogits = greedy_decode(model, fparams, FIRST, steps)
    # Teacher-forced with the float tokens, so one early difference does not
    # change every later step.
    qtok, qlogits = greedy_decode(qmodel, qparams, FIRST, steps, forced=ftok)
    assert float(jnp.mean(qtok == ftok)) >= 0.95
    assert _rel(qlogits, flogits) < 0.05
    # The cache decode computes what a full causal pass computes.
    full = qmodel.apply({"params": qparams}, jnp.concatenate([FIRST[:, None], ftok[:, :-1]], 1))
    tol = 1e-4 if rules is W8 else 0.05  # w8a8: per-call activation scales differ
    assert _rel(qlogits, full) < tol
    # The free-running quantized sampler agrees with the float one too.
    qfree, _ = greedy_decode(qmodel, qparams, FIRST, steps)
    assert float(jnp.mean(qfree == ftok)) >= 0.95


def test_a_while_loop_decoder_runs_the_quantized_model_step_by_step():
    qmodel = qflax.quantize_model(TinyLM(CFG), qflax.PtqProvider(W8))
    qparams = qmodel.init(jax.random.key(0), IDS)["params"]
    decoder = qmodel.clone(decode=True)
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), qmodel.init_cache(2))

    @jax.jit
    def generate(params, cache, first):
        def body(state):
            t, tok, cache, out = state
            logits, mutated = decoder.apply(
                {"params": params, "cache": cache}, tok[:, None], mutable=["cache"]
            )
            nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            return t + 1, nxt, mutated["cache"], out.at[:, t].set(nxt)

        out = jnp.zeros((first.shape[0], CFG.max_len), jnp.int32)
        state = (jnp.int32(0), first, cache, out)
        return jax.lax.while_loop(lambda s: s[0] < CFG.max_len, body, state)[3]

    want, _ = greedy_decode(qmodel, qparams, FIRST, CFG.max_len)
    np.testing.assert_array_equal(generate(qparams, cache, FIRST), want)


# -- loops inside the model ------------------------------------------------------------


class LoopFirst(nn.Module):
    """Its Dense is first called inside fori_loop: its params are created in the loop."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(x.shape[-1])
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(dense(h)), x)


class LoopAfter(nn.Module):
    """Creates its Dense's params before the loop, then applies it inside."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(x.shape[-1])
        h = jnp.tanh(dense(x))
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(dense(h)), h)


class WhileFirst(nn.Module):
    """Its Dense is first called inside a while_loop whose condition depends on the input."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(x.shape[-1])

        def body(state):
            i, h = state
            return i + 1, jnp.tanh(dense(h))

        return jax.lax.while_loop(lambda s: s[0] < x.shape[0] + jnp.sum(x) * 0, body, (0, x))[1]


@pytest.mark.parametrize("cls", [LoopFirst, WhileFirst])
def test_params_created_inside_a_loop_are_refused_with_what_to_do(cls):
    x = jnp.ones((2, 8))
    # Flax itself cannot do it: the float "init" returns leaked tracers.
    kernel = cls().init(jax.random.key(0), x)["params"]["Dense_0"]["kernel"]
    assert isinstance(kernel, jax.core.Tracer)
    qmodel = qflax.quantize_model(cls(), qflax.PtqProvider(W8))
    with pytest.raises(ValueError, match=r"'Dense_0/kernel'.*inside a JAX transform.*before"):
        qmodel.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"'Dense_0/kernel'.*inside a JAX transform.*before"):
        jax.jit(qmodel.init)(jax.random.key(0), x)


def test_a_module_applied_inside_fori_loop_is_quantized():
    x = jax.random.normal(jax.random.key(2), (4, 32))
    fvars = LoopAfter().init(jax.random.key(0), x)
    qmodel = qflax.quantize_model(LoopAfter(), qflax.PtqProvider(W8A8))
    qvars = qmodel.init(jax.random.key(0), x)
    kernel = qvars["params"]["Dense_0"]["kernel"]
    assert isinstance(kernel, qflax.QuantizedParam)
    want = LoopAfter().apply(fvars, x)
    got = qmodel.apply(qvars, x)
    assert 0 < _rel(got, want) < 0.05
    np.testing.assert_allclose(jax.jit(qmodel.apply)(qvars, x), got, rtol=1e-5, atol=1e-6)


# -- standing in for the model ---------------------------------------------------------


def test_the_quantized_model_is_an_instance_of_the_models_class():
    model = TinyLM(CFG)
    provider = qflax.PtqProvider(W8)
    qmodel = qflax.quantize_model(model, provider)
    assert isinstance(qmodel, TinyLM) and isinstance(qmodel, qflax.QuantizedLinen)
    assert qmodel.config is CFG and qmodel.decode is False
    assert qmodel.provider is provider and qmodel.methods == ("__call__",)
    assert qmodel.model == model and type(qmodel.model) is TinyLM
    assert "TinyLM" in repr(qmodel)
    decoder = qmodel.clone(decode=True)
    assert type(decoder) is type(qmodel) and decoder.provider is provider and decoder.decode
    # One class per (class, methods), whatever the provider.
    other = qflax.quantize_model(TinyLM(CFG), qflax.PtqProvider(W8A8))
    assert type(other) is type(qmodel) and other.provider is not provider


def test_the_quantized_model_pickles():
    qmodel = qflax.quantize_model(TinyLM(CFG), qflax.PtqProvider(W8))
    params = qmodel.init(jax.random.key(0), IDS)["params"]
    again = pickle.loads(pickle.dumps(qmodel))
    assert type(again) is type(qmodel) and again.config == CFG
    np.testing.assert_array_equal(
        again.apply({"params": params}, IDS), qmodel.apply({"params": params}, IDS)
    )


def test_bind_methods_and_functions_run_quantized():
    class Net(nn.Module):
        features: int = 16

        def setup(self):
            self.dense = nn.Dense(self.features)

        def __call__(self, x):
            return self.dense(x)

        def twice(self, x):
            return self(x) * 2

    x = jax.random.normal(jax.random.key(3), (4, 32))
    qmodel = qflax.quantize_model(Net(), qflax.PtqProvider(W8A8), methods=["__call__", "twice"])
    variables = qmodel.init(jax.random.key(0), x)
    y = qmodel.apply(variables, x)
    np.testing.assert_array_equal(qmodel.apply(variables, x, method="twice"), 2 * y)
    np.testing.assert_array_equal(qmodel.apply(variables, x, method=Net.twice), 2 * y)
    np.testing.assert_array_equal(qmodel.apply(variables, x, method=lambda m, x: m(x)), y)
    np.testing.assert_array_equal(qmodel.bind(variables)(x), y)
    float_y = Net().apply(Net().init(jax.random.key(0), x), x)
    assert 0 < _rel(y, float_y) < 0.05


def test_nested_quantized_methods_share_one_call_context():
    class Counting(qflax.PtqProvider):
        contexts = 0

        def handler(self, ctx):
            Counting.contexts += 1
            return super().handler(ctx)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(x)

        def twice(self, x):
            return self(x) + self(x)

    x = jnp.ones((2, 8))
    qmodel = qflax.quantize_model(Net(), Counting(W8), methods=["__call__", "twice"])
    variables = qmodel.init(jax.random.key(0), x, method="twice")
    Counting.contexts = 0
    qmodel.apply(variables, x, method="twice")
    assert Counting.contexts == 1


def test_a_method_not_quantized_is_refused_at_apply():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x)

        def features(self, x):
            return self(x)

    x = jnp.ones((2, 8))
    qmodel = qflax.quantize_model(Net(), qflax.PtqProvider(W8))
    variables = qmodel.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"method='features'.*methods=\('__call__',\).*"):
        qmodel.apply(variables, x, method="features")


def test_nn_jit_submodules_are_quantized():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.jit(nn.Dense)(8, name="inner")(x)

    x = jax.random.normal(jax.random.key(4), (4, 16))
    qmodel = qflax.quantize_model(Net(), qflax.PtqProvider(W8A8))
    variables = qmodel.init(jax.random.key(0), x)
    assert isinstance(variables["params"]["inner"]["kernel"], qflax.QuantizedParam)
    want = Net().apply(Net().init(jax.random.key(0), x), x)
    assert 0 < _rel(qmodel.apply(variables, x), want) < 0.05


def test_qat_one_optimizer_step():
    rules = [Rule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
    qmodel = qflax.quantize_model(TinyLM(CFG), qflax.QtProvider(rules))
    variables = qmodel.init(jax.random.key(0), IDS)
    params, quant_stats = variables["params"], variables["quant_stats"]

    def loss(params, quant_stats):
        logits, mutated = qmodel.apply(
            {"params": params, "quant_stats": quant_stats}, IDS[:, :-1], mutable=["quant_stats"]
        )
        labels = jax.nn.one_hot(IDS[:, 1:], CFG.vocab)
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1)), mutated

    (before, mutated), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, quant_stats)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    after, _ = loss(new, mutated["quant_stats"])
    assert float(after) < float(before)
    counts = [
        int(s["count"])
        for s in jax.tree.leaves(mutated["quant_stats"], is_leaf=lambda s: "count" in s)
    ]
    assert counts and all(c == 1 for c in counts)


def test_a_field_named_like_an_alias_keeps_its_meaning_and_bound_modules_are_refused():
    class Wrapper(nn.Module):
        model: int = 3

        @nn.compact
        def __call__(self, x):
            return nn.Dense(self.model)(x)

    provider = qflax.PtqProvider(W8)
    qmodel = qflax.quantize_model(Wrapper(), provider)
    assert qmodel.model == 3 and qmodel.provider is provider
    x = jnp.ones((2, 8))
    assert qmodel.apply(qmodel.init(jax.random.key(0), x), x).shape == (2, 3)
    again = qflax.quantize_model(qmodel, qflax.PtqProvider(W8A8))  # re-quantizing
    assert type(again) is type(qmodel) and again.model == 3
    bound = Wrapper().bind(Wrapper().init(jax.random.key(0), x))
    with pytest.raises(ValueError, match="model=Wrapper is bound to variables"):
        qflax.quantize_model(bound, provider)

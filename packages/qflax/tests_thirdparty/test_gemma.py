"""The ``gemma`` package's ``gm.nn.Transformer`` quantized at a tiny size (``nox -s models``).

Random weights, no checkpoint or tokenizer: a guard that qflax handles real-world
model code (Linen, ``nn.jit``-wrapped methods, a KV cache updated by the model).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemma import gm
from gemma.gm.nn import _modules

import qflax
from qflax import QuantizationRule as Rule

CONFIG = gm.nn.config.TransformerConfig(
    num_embed=256,
    embed_dim=64,
    hidden_dim=128,
    num_heads=4,
    head_dim=16,
    num_kv_heads=1,
    final_logit_softcap=None,
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    use_qk_norm=True,
    attention_types=(_modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL),
    sliding_window_size=8,
    transpose_gating_einsum=True,
    vision_encoder=None,
)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 256, (2, 12)), jnp.int32)
KEY = jax.random.key(0)
# Relative (Frobenius) error of the logits against the float model's; measured
# 0.01 (w8a8), 0.006 (int8), 0.15 (int4, nf4) in float32, bf16 adds ~0.01.
SCHEMES = {
    "w8a8": ([Rule(weight_qtype="int8", act_qtype="int8")], 0.05),
    "w8": ([Rule(weight_qtype="int8")], 0.05),
    "int4": ([Rule(weight_qtype="int4", tile_size=32)], 0.35),
    "nf4": ([Rule(weight_qtype="nf4", tile_size=32)], 0.35),
}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _quantized(tree):
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, qflax.QuantizedParam))
    return [x for x in leaves if isinstance(x, qflax.QuantizedParam)]


@pytest.fixture(scope="module", params=list(DTYPES))
def dtype(request):
    return DTYPES[request.param]


@pytest.fixture(scope="module")
def float_model(dtype):
    model = gm.nn.Transformer(config=CONFIG, dtype=dtype)
    params = jax.jit(model.init)(KEY, TOKENS)["params"]
    return model, params, jax.jit(model.apply)({"params": params}, TOKENS).logits


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_ptq_is_close_to_the_float_model_and_quantize_params_is_in_model(float_model, scheme):
    model, params, want = float_model
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(SCHEMES[scheme][0]))
    qparams = jax.jit(qmodel.init)(KEY, TOKENS)["params"]
    assert len(_quantized(qparams)) > 4
    abstract = jax.eval_shape(qmodel.init, KEY, TOKENS)["params"]
    jax.tree.map(np.testing.assert_array_equal, qflax.quantize_params(params, abstract), qparams)
    got = jax.jit(qmodel.apply)({"params": qparams}, TOKENS).logits
    assert got.dtype == want.dtype  # the model's dtype is kept
    assert 0 < _rel(got, want) < SCHEMES[scheme][1]


def test_the_quantized_model_stands_in_for_the_transformer(float_model):
    model, _, _ = float_model
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(SCHEMES["w8"][0]))
    assert isinstance(qmodel, gm.nn.Transformer) and isinstance(qmodel, qflax.QuantizedLinen)
    assert qmodel.config is CONFIG and qmodel.dtype == model.dtype
    cache = qmodel.init_cache(batch_size=2, dtype=model.dtype, cache_length=16)
    want = model.init_cache(batch_size=2, dtype=model.dtype, cache_length=16)
    jax.tree.map(np.testing.assert_array_equal, cache, want)


def _decode(model, params, first, steps, forced=None, cache_length=16):
    """Greedy decode one token per call through the model's KV cache, as gemma's sampler."""
    cache = model.init_cache(batch_size=first.shape[0], dtype=model.dtype, cache_length=16)

    @jax.jit
    def step(params, cache, token, t):
        mask = jnp.broadcast_to(jnp.arange(cache_length) <= t, (first.shape[0], 1, cache_length))
        positions = jnp.full((first.shape[0], 1), t, jnp.int32)
        out = model.apply(
            {"params": params},
            token[:, None],
            cache=cache,
            positions=positions,
            attention_mask=mask,
        )
        return out.logits[:, 0], out.cache

    token, tokens, logits = first, [], []
    for t in range(steps):
        out, cache = step(params, cache, token, jnp.int32(t))
        logits.append(out)
        tokens.append(jnp.argmax(out, axis=-1).astype(jnp.int32))
        token = tokens[-1] if forced is None else forced[:, t]
    return jnp.stack(tokens, 1), jnp.stack(logits, 1)


@pytest.mark.parametrize("scheme", ["w8", "w8a8"])
def test_cached_decode_picks_the_float_models_tokens(float_model, scheme):
    model, params, _ = float_model
    steps = 12
    want, float_logits = _decode(model, params, TOKENS[:, 0], steps)
    # The cache decode is the full causal pass of the float model.
    full = model.apply({"params": params}, jnp.concatenate([TOKENS[:, :1], want[:, :-1]], 1))
    assert _rel(float_logits, full.logits) < 0.02
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(SCHEMES[scheme][0]))
    qparams = jax.jit(qmodel.init)(KEY, TOKENS)["params"]
    forced, _ = _decode(qmodel, qparams, TOKENS[:, 0], steps, forced=want)
    assert float(jnp.mean(forced == want)) >= 0.95
    free, _ = _decode(qmodel, qparams, TOKENS[:, 0], steps)
    assert float(jnp.mean(free == want)) >= 0.95

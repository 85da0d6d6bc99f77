"""A small Gemma-like decoder (NNX and a Linen twin): RMSNorm, rotary embeddings,
grouped-query attention with einsums, a gated MLP, tied embeddings, a KV cache."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS = 64, 32, 4, 2, 8, 64, 2


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return normed * (1 + scale)[None, None, :]


def rope(x, positions):
    """Rotates the two halves of ``x``'s head axis by position-dependent angles."""
    half = x.shape[-1] // 2
    freq = 10_000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * freq[None, None, :]  # (b, t, half)
    sin, cos = jnp.sin(angle)[..., None, :], jnp.cos(angle)[..., None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def attend(q, k, v, q_pos, k_pos):
    """Grouped-query causal attention: ``HEADS // KV_HEADS`` query heads per kv head."""
    b, t, _, d = q.shape
    q = q.reshape(b, t, KV_HEADS, HEADS // KV_HEADS, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k) * d**-0.5
    causal = q_pos[:, None, None, :, None] >= k_pos[:, None, None, None, :]
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    out = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(logits, axis=-1), v)
    return out.reshape(b, t, HEADS, d)


def gated_mlp(x, gate, up, down):
    return jnp.einsum("btf,fd->btd", nn.gelu(x @ gate) * (x @ up), down)


class NnxLayer(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.normal(DIM**-0.5)
        self.norm1 = nnx.Param(jnp.zeros(DIM))
        self.q = nnx.Param(init(rngs.params(), (DIM, HEADS, HEAD_DIM)))
        self.kv = nnx.Param(init(rngs.params(), (2, DIM, KV_HEADS, HEAD_DIM)))
        self.o = nnx.Param(init(rngs.params(), (HEADS, HEAD_DIM, DIM)))
        self.norm2 = nnx.Param(jnp.zeros(DIM))
        self.gate = nnx.Param(init(rngs.params(), (DIM, HIDDEN)))
        self.up = nnx.Param(init(rngs.params(), (DIM, HIDDEN)))
        self.down = nnx.Param(init(rngs.params(), (HIDDEN, DIM)))

    def __call__(self, x, positions, cache):
        h = rms_norm(x, self.norm1[...])
        q = rope(jnp.einsum("btd,dhe->bthe", h, self.q[...]), positions)
        k, v = jnp.einsum("btd,cdke->cbtke", h, self.kv[...])
        k = rope(k, positions)
        if cache is not None:  # (k, v, positions) of earlier steps
            k = jnp.concatenate([cache[0], k], axis=1)
            v = jnp.concatenate([cache[1], v], axis=1)
            k_pos = jnp.concatenate([cache[2], positions], axis=1)
        else:
            k_pos = positions
        att = attend(q, k, v, positions, k_pos)
        x = x + jnp.einsum("bthe,hed->btd", att, self.o[...])
        h = rms_norm(x, self.norm2[...])
        x = x + gated_mlp(h, self.gate[...], self.up[...], self.down[...])
        return x, (k, v, k_pos)


class NnxGemma(nnx.Module):
    """``__call__(tokens, positions, caches=None) -> (logits, caches)``."""

    def __init__(self, rngs):
        self.embed = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (VOCAB, DIM)))
        self.layers = nnx.List([NnxLayer(rngs) for _ in range(LAYERS)])
        self.final_norm = nnx.Param(jnp.zeros(DIM))

    def __call__(self, tokens, positions, caches=None):
        table = self.embed[...]
        x = jnp.take(table, tokens, axis=0) * jnp.sqrt(jnp.float32(DIM))
        new = []
        for i, layer in enumerate(self.layers):
            x, c = layer(x, positions, None if caches is None else caches[i])
            new.append(c)
        x = rms_norm(x, self.final_norm[...])
        return jnp.einsum("btd,vd->btv", x, table), new  # tied embeddings


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, x, positions, cache):
        init = nn.initializers.normal(DIM**-0.5)
        norm1 = self.param("norm1", nn.initializers.zeros, (DIM,))
        wq = self.param("q", init, (DIM, HEADS, HEAD_DIM))
        wkv = self.param("kv", init, (2, DIM, KV_HEADS, HEAD_DIM))
        wo = self.param("o", init, (HEADS, HEAD_DIM, DIM))
        norm2 = self.param("norm2", nn.initializers.zeros, (DIM,))
        gate = self.param("gate", init, (DIM, HIDDEN))
        up = self.param("up", init, (DIM, HIDDEN))
        down = self.param("down", init, (HIDDEN, DIM))
        h = rms_norm(x, norm1)
        q = rope(jnp.einsum("btd,dhe->bthe", h, wq), positions)
        k, v = jnp.einsum("btd,cdke->cbtke", h, wkv)
        k = rope(k, positions)
        if cache is not None:
            k = jnp.concatenate([cache[0], k], axis=1)
            v = jnp.concatenate([cache[1], v], axis=1)
            k_pos = jnp.concatenate([cache[2], positions], axis=1)
        else:
            k_pos = positions
        x = x + jnp.einsum("bthe,hed->btd", attend(q, k, v, positions, k_pos), wo)
        x = x + gated_mlp(rms_norm(x, norm2), gate, up, down)
        return x, (k, v, k_pos)


class LinenGemma(nn.Module):
    """The Linen twin of :class:`NnxGemma`."""

    @nn.compact
    def __call__(self, tokens, positions, caches=None):
        table = self.param("embed", nn.initializers.normal(1.0), (VOCAB, DIM))
        x = jnp.take(table, tokens, axis=0) * jnp.sqrt(jnp.float32(DIM))
        new = []
        for i in range(LAYERS):
            x, c = LinenLayer(name=f"layer{i}")(x, positions, None if caches is None else caches[i])
            new.append(c)
        x = rms_norm(x, self.param("final_norm", nn.initializers.zeros, (DIM,)))
        return jnp.einsum("btd,vd->btv", x, table), new

"""A small Gemma-like decoder (NNX and a Linen twin): RMSNorm, rotary embeddings,
grouped-query attention with einsums, a gated MLP, tied embeddings, a KV cache."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes; the defaults are the tests' tiny model (``Config(512, layers=4)`` for benchmarks)."""

    d_model: int = 32
    layers: int = 2
    vocab: int = 64
    heads: int = 4
    kv_heads: int = 2
    hidden_mult: int = 2

    @property
    def head_dim(self):
        return self.d_model // self.heads

    @property
    def hidden(self):
        return self.hidden_mult * self.d_model


TINY = Config()
VOCAB = TINY.vocab


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
    """Grouped-query causal attention: ``heads // kv_heads`` query heads per kv head."""
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, heads // kv_heads, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k) * d**-0.5
    causal = q_pos[:, None, None, :, None] >= k_pos[:, None, None, None, :]
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    out = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(logits, axis=-1), v)
    return out.reshape(b, t, heads, d)


def gated_mlp(x, gate, up, down):
    return jnp.einsum("btf,fd->btd", nn.gelu(x @ gate) * (x @ up), down)


class NnxLayer(nnx.Module):
    def __init__(self, cfg, rngs):
        dim, heads, kv_heads, head_dim, hidden = (
            cfg.d_model,
            cfg.heads,
            cfg.kv_heads,
            cfg.head_dim,
            cfg.hidden,
        )
        init = nnx.initializers.normal(dim**-0.5)
        self.norm1 = nnx.Param(jnp.zeros(dim))
        self.q = nnx.Param(init(rngs.params(), (dim, heads, head_dim)))
        self.kv = nnx.Param(init(rngs.params(), (2, dim, kv_heads, head_dim)))
        self.o = nnx.Param(init(rngs.params(), (heads, head_dim, dim)))
        self.norm2 = nnx.Param(jnp.zeros(dim))
        self.gate = nnx.Param(init(rngs.params(), (dim, hidden)))
        self.up = nnx.Param(init(rngs.params(), (dim, hidden)))
        self.down = nnx.Param(init(rngs.params(), (hidden, dim)))

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

    def __init__(self, rngs, cfg=TINY):
        init = nnx.initializers.normal(1.0)
        self.embed = nnx.Param(init(rngs.params(), (cfg.vocab, cfg.d_model)))
        self.layers = nnx.List([NnxLayer(cfg, rngs) for _ in range(cfg.layers)])
        self.final_norm = nnx.Param(jnp.zeros(cfg.d_model))

    def __call__(self, tokens, positions, caches=None):
        table = self.embed[...]
        x = jnp.take(table, tokens, axis=0) * jnp.sqrt(jnp.float32(table.shape[1]))
        new = []
        for i, layer in enumerate(self.layers):
            x, c = layer(x, positions, None if caches is None else caches[i])
            new.append(c)
        x = rms_norm(x, self.final_norm[...])
        return jnp.einsum("btd,vd->btv", x, table), new  # tied embeddings


class LinenLayer(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x, positions, cache):
        cfg = self.cfg
        dim, heads, kv_heads, head_dim, hidden = (
            cfg.d_model,
            cfg.heads,
            cfg.kv_heads,
            cfg.head_dim,
            cfg.hidden,
        )
        init = nn.initializers.normal(dim**-0.5)
        norm1 = self.param("norm1", nn.initializers.zeros, (dim,))
        wq = self.param("q", init, (dim, heads, head_dim))
        wkv = self.param("kv", init, (2, dim, kv_heads, head_dim))
        wo = self.param("o", init, (heads, head_dim, dim))
        norm2 = self.param("norm2", nn.initializers.zeros, (dim,))
        gate = self.param("gate", init, (dim, hidden))
        up = self.param("up", init, (dim, hidden))
        down = self.param("down", init, (hidden, dim))
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

    cfg: Config = TINY

    @nn.compact
    def __call__(self, tokens, positions, caches=None):
        cfg = self.cfg
        table = self.param("embed", nn.initializers.normal(1.0), (cfg.vocab, cfg.d_model))
        x = jnp.take(table, tokens, axis=0) * jnp.sqrt(jnp.float32(cfg.d_model))
        new = []
        for i in range(cfg.layers):
            layer = LinenLayer(cfg, name=f"layer{i}")
            x, c = layer(x, positions, None if caches is None else caches[i])
            new.append(c)
        x = rms_norm(x, self.param("final_norm", nn.initializers.zeros, (cfg.d_model,)))
        return jnp.einsum("btd,vd->btv", x, table), new

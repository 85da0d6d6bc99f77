"""Small models written like the ones people export: a BERT-style encoder, an MLP, a CNN."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class Encoder(nn.Module):
    """A BERT-style encoder: embeddings, Flax's own attention module, GELU MLP, mean pool."""

    vocab: int = 100
    hidden: int = 32
    heads: int = 4
    layers: int = 2

    @nn.compact
    def __call__(self, ids: jax.Array, mask: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.hidden, name="word")(ids)
        x = x + nn.Embed(64, self.hidden, name="position")(jnp.arange(ids.shape[1])[None])
        x = nn.LayerNorm(name="embed_norm")(x)
        attn_mask = nn.make_attention_mask(mask, mask)
        for i in range(self.layers):
            a = nn.MultiHeadDotProductAttention(self.heads, name=f"attention_{i}")(
                x, mask=attn_mask
            )
            x = nn.LayerNorm(name=f"norm_a{i}")(x + a)
            h = nn.gelu(nn.Dense(4 * self.hidden, name=f"up_{i}")(x), approximate=False)
            x = nn.LayerNorm(name=f"norm_m{i}")(x + nn.Dense(self.hidden, name=f"down_{i}")(h))
        m = mask[..., None].astype(x.dtype)
        return jnp.sum(x * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1e-9)


class Mlp(nn.Module):
    """Dense layers with GELU between them."""

    widths: tuple[int, ...] = (64, 64, 10)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, w in enumerate(self.widths):
            x = nn.Dense(w, name=f"dense_{i}")(x)
            if i < len(self.widths) - 1:
                x = nn.gelu(x)
        return x


class Cnn(nn.Module):
    """A digits-style CNN: two convolutions, pooling, a Dense head."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(16, (3, 3), name="conv_0")(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(32, (3, 3), name="conv_1")(x))
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(10, name="head")(x)


def token_batch(batch: int = 3, tokens: int = 16, vocab: int = 100) -> tuple[jax.Array, jax.Array]:
    """Token ids and a padding mask (each sequence of its own length)."""
    ids = jax.random.randint(jax.random.key(7), (batch, tokens), 1, vocab, dtype=jnp.int32)
    lengths = jnp.array([tokens, tokens // 2, 3][:batch] + [tokens] * max(batch - 3, 0))
    mask = (jnp.arange(tokens)[None, :] < lengths[:, None]).astype(jnp.int32)
    return ids, mask

"""A Linen decoder LM: tied embeddings, ``nn.scan`` over ``nn.remat`` blocks of
``nn.MultiHeadDotProductAttention`` with Flax's ``decode=True`` cache."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes; the defaults are the tests' tiny model."""

    d_model: int = 64
    layers: int = 2
    vocab: int = 64
    heads: int = 4
    max_len: int = 16


class Block(nn.Module):
    """Pre-norm block: causal self-attention (cached when decoding), then a GELU MLP."""

    config: Config
    decode: bool

    @nn.compact
    def __call__(self, x, mask):
        d = self.config.d_model
        attn = nn.MultiHeadDotProductAttention(self.config.heads, decode=self.decode, name="attn")
        x = x + attn(nn.LayerNorm(name="ln1")(x), mask=mask)
        h = nn.gelu(nn.Dense(4 * d, name="mlp_in")(nn.LayerNorm(name="ln2")(x)))
        return x + nn.Dense(d, name="mlp_out")(h), None


class DecoderLM(nn.Module):
    """``__call__(ids) -> logits``; ``decode=True`` takes one token per call."""

    config: Config = Config()
    decode: bool = False

    @nn.compact
    def __call__(self, ids):
        cfg = self.config
        embed = nn.Embed(cfg.vocab, cfg.d_model, embedding_init=nn.initializers.normal(1.0))
        positions = self.param("positions", nn.initializers.normal(0.5), (cfg.max_len, cfg.d_model))
        x = embed(ids) + self._position(positions, ids.shape[1])
        mask = None if self.decode else nn.make_causal_mask(ids)
        stack = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0, "cache": 0, "quant_stats": 0},
            split_rngs={"params": True},
            in_axes=nn.broadcast,
            length=cfg.layers,
        )
        x, _ = stack(cfg, self.decode, name="blocks")(x, mask)
        return embed.attend(nn.LayerNorm(name="ln_f")(x))  # tied output layer

    def _position(self, table, length):
        """The positions' rows: all of them, or the decode step's one (a cache index)."""
        if not self.decode:
            return table[None, :length]
        index = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
        row = jax.lax.dynamic_slice_in_dim(table, index.value, 1)[None]
        if not self.is_initializing():
            index.value = index.value + 1
        return row

    @nn.nowrap
    def init_cache(self, batch):
        """The empty decode cache's shapes, from an init with a full-length input."""
        ids = jnp.zeros((batch, self.config.max_len), jnp.int32)
        decoder = self.clone(decode=True)
        return jax.eval_shape(decoder.init, jax.random.key(0), ids)["cache"]

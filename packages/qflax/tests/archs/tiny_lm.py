"""A one-block causal decoder with Flax's ``decode=True`` attention cache and tied logits."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 64
    dim: int = 64
    heads: int = 4
    max_len: int = 24


class TinyLM(nn.Module):
    """A causal decoder with a Flax ``decode=True`` attention cache and tied logits."""

    config: LMConfig
    decode: bool = False

    def setup(self):
        cfg = self.config
        self.embed = nn.Embed(cfg.vocab, cfg.dim, embedding_init=nn.initializers.normal(1.0))
        self.attn = nn.MultiHeadDotProductAttention(cfg.heads, decode=self.decode)
        self.mlp = nn.Dense(cfg.dim)

    def __call__(self, ids):
        x = self.embed(ids)
        mask = None if self.decode else nn.make_causal_mask(ids)
        x = x + self.attn(x, mask=mask)
        x = x + nn.gelu(self.mlp(x))
        return self.embed.attend(x)  # tied: the embedding table is also the output layer

    @nn.nowrap
    def init_cache(self, batch):
        """The empty decode cache, from an init with a full-length input."""
        ids = jnp.zeros((batch, self.config.max_len), jnp.int32)
        decoder = self.clone(decode=True)
        return jax.eval_shape(decoder.init, jax.random.key(0), ids)["cache"]


def greedy_decode(model, params, first, steps, forced=None):
    """A sampler written for TinyLM: ``model.config``, ``model.init_cache``, ``clone``.

    Feeds its own greedy tokens, or ``forced`` ones when given; returns the
    tokens and the logits of every step.
    """
    assert steps <= model.config.max_len
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), model.init_cache(first.shape[0]))
    decoder = model.clone(decode=True)
    tok, tokens, logits = first, [], []
    for t in range(steps):
        out, mutated = decoder.apply(
            {"params": params, "cache": cache}, tok[:, None], mutable=["cache"]
        )
        cache = mutated["cache"]
        logits.append(out[:, 0])
        tokens.append(jnp.argmax(out[:, 0], axis=-1).astype(jnp.int32))
        tok = tokens[-1] if forced is None else forced[:, t]
    return jnp.stack(tokens, 1), jnp.stack(logits, 1)

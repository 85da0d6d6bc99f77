"""A mixture-of-experts layer on ``jax.lax.ragged_dot``: a router picks each token's
top-k experts, the token copies are grouped by expert and each group meets its
expert's weights in one ragged product."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 32
    layers: int = 1
    experts: int = 4
    hidden: int = 64
    top_k: int = 2
    classes: int = 10


class MoELayer(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        tokens = x.reshape(-1, x.shape[-1])
        logits = nn.Dense(cfg.experts, use_bias=False, name="router")(tokens)
        weights, experts = lax.top_k(logits, cfg.top_k)  # (tokens, k)
        weights = jax.nn.softmax(weights, axis=-1).reshape(-1)
        order = jnp.argsort(experts.reshape(-1), stable=True)  # copies grouped by expert
        source = order // cfg.top_k  # the token each copy comes from
        sizes = jnp.bincount(experts.reshape(-1), length=cfg.experts).astype(jnp.int32)
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        w_in = self.param("w_in", init, (cfg.experts, cfg.d_model, cfg.hidden))
        w_out = self.param("w_out", init, (cfg.experts, cfg.hidden, cfg.d_model))
        h = nn.gelu(lax.ragged_dot(tokens[source], w_in, sizes))
        y = lax.ragged_dot(h, w_out, sizes) * weights[order][:, None]
        combined = jnp.zeros_like(tokens).at[source].add(y)
        return x + combined.reshape(x.shape)


class MoEClassifier(nn.Module):
    """``__call__(x: (batch, seq, d_model)) -> logits``: ``layers`` MoE layers, mean pool."""

    config: Config = Config()

    @nn.compact
    def __call__(self, x):
        for i in range(self.config.layers):
            x = MoELayer(self.config, name=f"moe{i}")(nn.LayerNorm()(x))
        return nn.Dense(self.config.classes, name="head")(jnp.mean(x, axis=1))

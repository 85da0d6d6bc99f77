"""A small big_vision-style ViT: patch conv, ``nn.scan`` over ``nn.remat`` blocks, MAP head."""

import flax.linen as nn
import jax.numpy as jnp


class EncoderBlock(nn.Module):
    """Pre-norm block: LayerNorm, multi-head self-attention, LayerNorm, GELU MLP."""

    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x, _):
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(nn.LayerNorm()(x))
        x = x + y
        y = nn.Dense(self.mlp_dim, name="mlp_in")(nn.LayerNorm()(x))
        x = x + nn.Dense(x.shape[-1], name="mlp_out")(nn.gelu(y))
        return x, None


class AttentionPool(nn.Module):
    """Multi-head attention pooling: a learned probe attends over the tokens."""

    heads: int

    @nn.compact
    def __call__(self, x):
        probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, x.shape[-1]))
        probe = jnp.broadcast_to(probe, (x.shape[0], 1, x.shape[-1]))
        x = nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(probe, x)
        y = nn.Dense(2 * x.shape[-1], name="mlp_in")(nn.LayerNorm()(x))
        x = x + nn.Dense(x.shape[-1], name="mlp_out")(nn.gelu(y))
        return x[:, 0]


class ViT(nn.Module):
    """Patches of ``patch``² pixels, ``depth`` scanned (and by default rematerialised) blocks."""

    classes: int = 10
    dim: int = 32
    depth: int = 2
    heads: int = 4
    patch: int = 4
    remat: bool = True

    @nn.compact
    def __call__(self, images):
        p = self.patch
        x = nn.Conv(self.dim, (p, p), strides=(p, p), padding="VALID", name="embedding")(images)
        x = x.reshape(x.shape[0], -1, self.dim)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, *x.shape[1:]))
        x = x + pos
        block = nn.remat(EncoderBlock) if self.remat else EncoderBlock
        stack = nn.scan(
            block,
            variable_axes={"params": 0, "quant_stats": 0},
            split_rngs={"params": True},
            length=self.depth,
        )
        x, _ = stack(self.heads, 2 * self.dim, name="encoder")(x, None)
        x = AttentionPool(self.heads, name="head_pool")(nn.LayerNorm()(x))
        return nn.Dense(self.classes, name="head")(x)

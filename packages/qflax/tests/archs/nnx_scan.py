"""An NNX layer stack over ``nnx.scan``: blocks created by ``nnx.vmap`` (their params
stacked along a leading layer axis) and applied one after another by ``nnx.scan``."""

import dataclasses

import jax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 32
    layers: int = 3
    classes: int = 10


class Block(nnx.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, d_model, rngs):
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 2 * d_model, rngs=rngs)
        self.down = nnx.Linear(2 * d_model, d_model, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class ScanStack(nnx.Module):
    """``__call__(x: (batch, seq, d_model)) -> logits``: scanned blocks, mean pool, head."""

    def __init__(self, rngs, cfg=Config()):
        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(cfg.d_model, rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, block):
            return block(h)

        return self.head(run(x, self.blocks).mean(axis=1))

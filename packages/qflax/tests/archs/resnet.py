"""A small ResNet: BatchNorm, residual blocks with projection shortcuts, strided convs."""

import dataclasses
import functools

import flax.linen as nn
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Config:
    """``d_model`` is the first stage's width; each of ``layers`` stages doubles it."""

    d_model: int = 32
    layers: int = 2
    classes: int = 10


class ResidualBlock(nn.Module):
    features: int
    strides: int

    @nn.compact
    def __call__(self, x, train):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        s = (self.strides, self.strides)
        y = nn.relu(norm()(nn.Conv(self.features, (3, 3), s, use_bias=False)(x)))
        y = norm()(nn.Conv(self.features, (3, 3), use_bias=False)(y))
        if x.shape != y.shape:
            x = norm()(nn.Conv(self.features, (1, 1), s, use_bias=False, name="shortcut")(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """``__call__(images, train=False) -> logits``; ``train`` updates ``batch_stats``."""

    config: Config = Config()

    @nn.compact
    def __call__(self, images, train=False):
        cfg = self.config
        x = nn.Conv(cfg.d_model, (3, 3), use_bias=False, name="stem")(images)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        for i in range(cfg.layers):
            x = ResidualBlock(cfg.d_model * 2**i, 1 if i == 0 else 2)(x, train)
        return nn.Dense(cfg.classes, name="head")(jnp.mean(x, axis=(1, 2)))

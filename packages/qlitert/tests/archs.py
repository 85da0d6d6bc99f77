"""Real architectures for qlitert's tests, at sizes CI can afford (model code written here).

MobileNetV2-style CNN: a strided 3x3 stem, inverted residual blocks (1x1 expansion,
3x3 depthwise, 1x1 linear projection, each with inference batch norm; ReLU6 after
the first two; a residual add where the block keeps its shape), a 1x1 head, global
average pooling and a dense classifier — the structure of MobileNetV2 (Sandler et
al., 2018) with fewer channels.

Transformer encoder block: pre-norm, Flax's own ``nn.MultiHeadDotProductAttention``
and a GELU MLP, each around a residual add.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def _bn() -> nn.BatchNorm:
    return nn.BatchNorm(use_running_average=True)


class InvertedResidual(nn.Module):
    """Expand (1x1), filter (3x3 depthwise), project (1x1, linear); add when shapes allow."""

    features: int
    expansion: int
    stride: int

    @nn.compact
    def __call__(self, x):
        channels = x.shape[-1]
        h = x
        if self.expansion != 1:
            h = nn.Conv(channels * self.expansion, (1, 1), use_bias=False)(h)
            h = nn.relu6(_bn()(h))
        width = h.shape[-1]
        h = nn.Conv(width, (3, 3), self.stride, feature_group_count=width, use_bias=False)(h)
        h = nn.relu6(_bn()(h))
        h = _bn()(nn.Conv(self.features, (1, 1), use_bias=False)(h))
        return x + h if self.stride == 1 and channels == self.features else h


class ResNetBlock(nn.Module):
    """A ResNet basic block as Flax's ImageNet example writes it: conv-BN-ReLU, conv-BN,
    a projected shortcut when the shape changes, ``relu(residual + y)``."""

    features: int
    stride: int = 1

    @nn.compact
    def __call__(self, x):
        y = nn.relu(_bn()(nn.Conv(self.features, (3, 3), self.stride, use_bias=False)(x)))
        y = _bn()(nn.Conv(self.features, (3, 3), use_bias=False)(y))
        residual = x
        if residual.shape != y.shape:
            residual = nn.Conv(self.features, (1, 1), self.stride, use_bias=False)(residual)
            residual = _bn()(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    """A small ResNet: stem, basic blocks (``(features, stride)`` each), mean pool, dense."""

    blocks: tuple = ((8, 1), (16, 2), (16, 1))
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(_bn()(nn.Conv(8, (3, 3), use_bias=False)(x)))
        for features, stride in self.blocks:
            x = ResNetBlock(features, stride)(x)
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


# (expansion, features, blocks, first stride) per stage, as MobileNetV2's table.
MOBILENET_STAGES = ((1, 8, 1, 1), (4, 12, 2, 2), (4, 16, 3, 2), (4, 24, 4, 2), (4, 32, 3, 1))
# 16 blocks: 49 convolutions and the classifier, 50 layers with weights.
MOBILENET_50 = (*MOBILENET_STAGES, (4, 40, 3, 2))


class MobileNetV2(nn.Module):
    """A MobileNetV2-style classifier for NHWC images."""

    stages: tuple = MOBILENET_STAGES
    classes: int = 10
    stem: int = 8
    head: int = 64

    @nn.compact
    def __call__(self, x):
        x = nn.relu6(_bn()(nn.Conv(self.stem, (3, 3), 2, use_bias=False)(x)))
        for expansion, features, blocks, stride in self.stages:
            for i in range(blocks):
                x = InvertedResidual(features, expansion, stride if i == 0 else 1)(x)
        x = nn.relu6(_bn()(nn.Conv(self.head, (1, 1), use_bias=False)(x)))
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


def trained_batch_norms(variables, seed=0):
    """``variables`` with batch-norm statistics and affine terms a trained model might have.

    At init they are the identity (mean 0, variance 1, scale 1, bias 0), which folds
    into nothing and tests nothing.
    """
    rng = np.random.default_rng(seed)
    draw = {
        "mean": lambda shape: rng.normal(0.0, 0.1, shape),
        "var": lambda shape: rng.uniform(0.5, 1.5, shape),
        "scale": lambda shape: rng.uniform(0.5, 1.5, shape),
        "bias": lambda shape: rng.normal(0.0, 0.1, shape),
    }

    def visit(path, v):
        names = [str(getattr(p, "key", "")) for p in path]
        in_bn = any(n.startswith("BatchNorm") for n in names)
        if in_bn and names[-1] in draw:
            return jnp.asarray(draw[names[-1]](v.shape), v.dtype)
        return v

    return jax.tree_util.tree_map_with_path(visit, variables)


def mobilenet(stages=MOBILENET_STAGES, size=32, seed=0):
    """A MobileNetV2-style model with batch norms set, closed over: ``(fn, example)``."""
    model = MobileNetV2(stages)
    x = np.random.default_rng(seed).normal(size=(1, size, size, 3)).astype(np.float32)
    variables = trained_batch_norms(model.init(jax.random.key(seed), x), seed)
    return (lambda x: model.apply(variables, x)), x


class EncoderBlock(nn.Module):
    """A pre-norm transformer block around Flax's attention module (4 heads, MLP of 128)."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h)
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(128)(nn.LayerNorm()(x))))


def between_dense_layers(activation, x):
    """``activation`` as module ``act`` between ``Dense(8)`` ``a`` and ``Dense(4)`` ``b``,
    initialized on ``x``, closed over: the function of its input."""

    class Act(nn.Module):
        def __call__(self, h):
            return activation(h)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, v):
            return nn.Dense(4, name="b")(Act(name="act")(nn.Dense(8, name="a")(v)))

    params = Net().init(jax.random.key(0), x)
    return lambda v: Net().apply(params, v)

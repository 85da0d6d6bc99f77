"""Small Linen and NNX models covering the ways Flax code calls the quantized ops."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax


class LinenMLP(nn.Module):
    """Dense 128 -> 256 -> 64 with relu (the reference's accuracy model)."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(64)(nn.relu(nn.Dense(256)(x)))


class NnxMLP(nnx.Module):
    """The NNX twin of :class:`LinenMLP`."""

    def __init__(self, rngs):
        self.fc1 = nnx.Linear(128, 256, rngs=rngs)
        self.fc2 = nnx.Linear(256, 64, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.relu(self.fc1(x)))


def _styles(x, w1, w2, w3, w4, w5):
    y = x @ w1
    y = jnp.matmul(y, w2)
    y = jnp.einsum("bi,ij->bj", y, w3)
    y = jnp.dot(y, w4)
    return lax.dot_general(y, w5, (((1,), (0,)), ((), ())))


class LinenStyles(nn.Module):
    """Calls ``@``, ``jnp.matmul``, ``jnp.einsum``, ``jnp.dot``, ``lax.dot_general`` on params."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        ws = [self.param(f"w{i}", init, (32, 32)) for i in range(1, 6)]
        return _styles(x, *ws)


class NnxStyles(nnx.Module):
    """The NNX twin of :class:`LinenStyles`."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        for i in range(1, 6):
            setattr(self, f"w{i}", nnx.Param(init(rngs.params(), (32, 32))))

    def __call__(self, x):
        return _styles(x, *(getattr(self, f"w{i}")[...] for i in range(1, 6)))


class LinenCNN(nn.Module):
    """Conv + BatchNorm + relu, twice, then a Dense head."""

    @nn.compact
    def __call__(self, x, train=False):
        for features in (8, 16):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.relu(x)
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class NnxCNN(nnx.Module):
    """The NNX twin of :class:`LinenCNN` (8x8x1 inputs)."""

    def __init__(self, rngs):
        self.conv1 = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, use_running_average=True, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, use_running_average=True, rngs=rngs)
        self.head = nnx.Linear(8 * 8 * 16, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.relu(self.bn2(self.conv2(x)))
        return self.head(x.reshape(x.shape[0], -1))


class LinenAttention(nn.Module):
    """A transformer block: einsum projections, einsum attention, Dense MLP."""

    heads: int = 4
    dim: int = 32

    @nn.compact
    def __call__(self, x):
        d = self.dim // self.heads
        init = nn.initializers.lecun_normal()
        wq, wk, wv = (self.param(n, init, (self.dim, self.heads, d)) for n in ("wq", "wk", "wv"))
        wo = self.param("wo", init, (self.heads, d, self.dim))
        q, k, v = (jnp.einsum("btd,dhe->bthe", x, w) for w in (wq, wk, wv))
        logits = jnp.einsum("bqhe,bkhe->bhqk", q, k) / jnp.sqrt(jnp.float32(d))
        att = jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(logits), v)
        x = x + jnp.einsum("bqhe,hed->bqd", att, wo)
        h = nn.gelu(nn.Dense(2 * self.dim)(nn.LayerNorm()(x)))
        return x + nn.Dense(self.dim)(h)


class LinenBlock(nn.Module):
    """One layer of a scanned stack."""

    @nn.compact
    def __call__(self, x, _):
        return nn.tanh(nn.Dense(32)(x)), None


class LinenScan(nn.Module):
    """Four stacked layers run by ``nn.scan`` (params stacked along axis 0)."""

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            LinenBlock,
            variable_axes={"params": 0, "quant_stats": 0},
            split_rngs={"params": True},
            length=4,
        )
        x, _ = stack(name="layers")(x, None)
        return x


class NnxBlock(nnx.Module):
    """One layer of :class:`NnxScan`."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        return nnx.tanh(self.linear(x))


class NnxScan(nnx.Module):
    """Four layers made by ``nnx.vmap`` and run by ``nnx.scan``."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NnxBlock(rngs)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x, layer):
            return layer(x)

        return step(x, self.layers)


class LinenReshaped(nn.Module):
    """Stores its kernel as (4, 8, 16) and reshapes it to (32, 16) before the matmul."""

    @nn.compact
    def __call__(self, x):
        k = self.param("kernel", nn.initializers.lecun_normal(), (4, 8, 16))
        return x @ k.reshape(32, 16)


class NnxReshaped(nnx.Module):
    """The NNX twin of :class:`LinenReshaped`, with a transpose as well."""

    def __init__(self, rngs):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (16, 4, 8)))

    def __call__(self, x):
        return x @ self.kernel[...].reshape(16, 32).T


class LinenTwice(nn.Module):
    """Calls one Dense submodule twice."""

    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(32, name="shared")
        return shared(nn.relu(shared(x)))


class NnxTwice(nnx.Module):
    """The NNX twin of :class:`LinenTwice`."""

    def __init__(self, rngs):
        self.shared = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        return self.shared(nnx.relu(self.shared(x)))


class LinenMoE(nn.Module):
    """A mixture-of-experts layer on ``lax.ragged_dot`` (rows grouped by expert)."""

    experts: int = 4

    @nn.compact
    def __call__(self, x):
        w = self.param("experts", nn.initializers.lecun_normal(), (self.experts, 32, 16))
        sizes = jnp.full((self.experts,), x.shape[0] // self.experts, jnp.int32)
        return lax.ragged_dot(x, w, sizes)


class LinenSeq(nn.Module):
    """A (B, T, D) model: Dense over the last axis (for static ranges across T)."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.relu(nn.Dense(32)(x)))


class Normed(nn.Module):
    """A per-channel scale ``g`` (like a norm's) before a Dense: AWQ/SmoothQuant fold target."""

    features: int = 16

    @nn.compact
    def __call__(self, x):
        g = self.param("g", nn.initializers.ones, (x.shape[-1],))
        return nn.Dense(self.features, name="dense")(x * g[None])


def outlier_inputs(key, scales, batches=4, rows=64, k=32):
    """Normal activations whose channels 1, 7 and 20 are multiplied by ``scales``."""
    channels = jnp.ones(k).at[jnp.array([1, 7, 20])].set(jnp.array(scales, jnp.float32))
    return [z * channels[None] for z in jax.random.normal(key, (batches, rows, k))]

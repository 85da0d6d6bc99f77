"""The calling module's path, for Linen and NNX models."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from qflax._engine import interception, module_path


def _paths_seen(run, resolver):
    seen = []

    def handler(name, original, args, kwargs):
        seen.append((name, module_path.calling_module_path(resolver)))
        return original(*args, **kwargs)

    with interception.intercept(handler):
        run()
    return seen


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="mlp")(x)
        return jnp.einsum("bi,ij->bj", x, self.param("proj", nn.initializers.ones, (8, 8)))


class LinenNet(nn.Module):
    def setup(self):
        self.layers = [Block() for _ in range(2)]
        self.head = nn.Dense(3)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        x = self.head(x)
        return self.head(jnp.ones((1, 3)) @ jnp.ones((3, 8))) + x  # head called twice


def test_linen_paths_of_nested_listed_and_reused_modules():
    model, x = LinenNet(), jnp.ones((1, 8))
    params = model.init(jax.random.key(0), x)
    seen = _paths_seen(lambda: jax.jit(model.apply)(params, x), module_path.linen_path)
    assert seen == [
        ("dot_general", "layers_0/mlp"),
        ("einsum", "layers_0"),
        ("dot_general", "layers_1/mlp"),
        ("einsum", "layers_1"),
        ("dot_general", "head"),
        ("matmul", ""),
        ("dot_general", "head"),
    ]


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([NnxBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_nnx_paths_include_list_indices_and_survive_nnx_jit():
    model = NnxNet(nnx.Rngs(0))
    module_path.label_nnx(model)
    expected = [
        ("dot_general", "layers/0/linear"),
        ("dot_general", "layers/1/linear"),
        ("dot_general", "head"),
    ]
    assert _paths_seen(lambda: model(jnp.ones((1, 8))), module_path.nnx_path) == expected
    # nnx.jit rebuilds the module objects inside its trace; the labels travel along.
    seen = _paths_seen(
        lambda: nnx.jit(lambda m, x: m(x))(model, jnp.ones((1, 8))), module_path.nnx_path
    )
    assert seen == expected


def test_ops_outside_any_module_have_no_path():
    seen = _paths_seen(lambda: jnp.ones((1, 2)) @ jnp.ones((2, 1)), module_path.linen_path)
    assert seen == [("matmul", None)]


def test_nnx_labels_refuse_non_modules():
    with pytest.raises(ValueError, match="model=dict is not an nnx.Module"):
        module_path.label_nnx({})  # type: ignore[arg-type]

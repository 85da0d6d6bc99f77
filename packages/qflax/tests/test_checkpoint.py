"""Quantized checkpoints: bit-exact round trips, abstract loading, rules, crash safety."""

import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from flax import nnx

import qflax
from qflax import QuantizationRule as Rule
from qflax import checkpoint

X = jax.random.normal(jax.random.key(1), (8, 128))
RULES = [
    Rule(module_path="Dense_0", weight_qtype="nf4", tile_size=32, act_qtype="int8"),
    Rule(weight_qtype="int4", tile_size={0: 64}, weight_calibration_method="mse"),
]
NNX_RULES = [Rule(module_path="fc1", weight_qtype="float8_e4m3fn"), Rule(weight_qtype="mxfp4")]


@pytest.fixture(scope="module")
def linen():
    qmodel = qflax.quantize_model(zoo.LinenMLP(), qflax.PtqProvider(RULES))
    params = qmodel.init(jax.random.key(0), X)["params"]
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), X)["params"]
    return qmodel, params, abstract


def assert_identical(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_orbax_round_trip_is_bit_exact_and_restores_rules(linen, tmp_path):
    qmodel, params, abstract = linen
    checkpoint.save(tmp_path / "ckpt", params, rules=RULES)
    restored = checkpoint.load(tmp_path / "ckpt", abstract)
    assert_identical(restored, params)
    assert checkpoint.load_rules(tmp_path / "ckpt") == RULES
    np.testing.assert_array_equal(
        qmodel.apply({"params": restored}, X), qmodel.apply({"params": params}, X)
    )


def test_safetensors_round_trip_is_bit_exact_with_entries_named_by_path(linen, tmp_path):
    _, params, abstract = linen
    file = checkpoint.export_safetensors(tmp_path / "q.safetensors", params, rules=RULES)
    from safetensors import safe_open

    with safe_open(str(file), framework="numpy") as f:
        keys = set(f.keys())
    assert {"Dense_0/kernel.qvalue", "Dense_0/kernel.scale", "Dense_0/bias"} <= keys
    assert_identical(checkpoint.import_safetensors(file, abstract), params)
    assert checkpoint.load_safetensors_rules(file) == RULES


def test_safetensors_entry_mismatch_names_the_entry(linen, tmp_path):
    _, params, abstract = linen
    small = qflax.quantize_model(zoo.LinenMLP(), qflax.PtqProvider([Rule(weight_qtype="int8")]))
    file = checkpoint.export_safetensors(tmp_path / "q.safetensors", params)
    other = jax.eval_shape(small.init, jax.random.key(0), X)["params"]
    with pytest.raises(ValueError, match=r"entry 'Dense_\d/kernel.qvalue' is"):
        checkpoint.import_safetensors(file, other)


def test_awq_params_with_carried_input_scales_round_trip(tmp_path):
    from qflax.awq import awq

    rules = [Rule(weight_qtype="int4", tile_size=32)]
    model = zoo.LinenMLP()
    fparams = model.init(jax.random.key(0), X)["params"]
    xs = [jax.random.normal(jax.random.key(i), (16, 128)) for i in range(2)]
    params = awq(model, fparams, rules, xs, progress=False)
    abstract = jax.eval_shape(lambda: params)
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    checkpoint.save(tmp_path / "awq", params, rules=rules)
    file = checkpoint.export_safetensors(tmp_path / "awq.safetensors", params)
    from safetensors import safe_open

    with safe_open(str(file), framework="numpy") as f:
        assert "Dense_0/kernel.input_scale" in set(f.keys())
    for loaded in (
        checkpoint.load(tmp_path / "awq", abstract),
        checkpoint.import_safetensors(file, abstract),
    ):
        assert_identical(loaded, params)
        np.testing.assert_array_equal(
            qmodel.apply({"params": loaded}, X), qmodel.apply({"params": params}, X)
        )


def test_nnx_prequantized_checkpoint_loads_into_an_abstract_model(tmp_path):
    def build():
        return qflax.quantize_model(zoo.NnxMLP(nnx.Rngs(0)), qflax.PtqProvider(NNX_RULES), X)

    model = build()
    checkpoint.save(tmp_path / "nnx", model, rules=NNX_RULES)
    checkpoint.export_safetensors(tmp_path / "nnx.safetensors", model)
    for loaded in (
        checkpoint.load(tmp_path / "nnx", nnx.eval_shape(build)),
        checkpoint.import_safetensors(tmp_path / "nnx.safetensors", nnx.eval_shape(build)),
    ):
        assert_identical(nnx.to_pure_dict(nnx.state(loaded)), nnx.to_pure_dict(nnx.state(model)))
        np.testing.assert_array_equal(loaded(X), model(X))
    assert checkpoint.load_rules(tmp_path / "nnx") == NNX_RULES


def test_a_failed_save_leaves_the_previous_checkpoint(linen, tmp_path, monkeypatch):
    _, params, abstract = linen
    checkpoint.save(tmp_path / "ckpt", params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    import orbax.checkpoint as ocp

    def broken_wait(self):
        raise OSError("disk full")

    monkeypatch.setattr(ocp.StandardCheckpointer, "wait_until_finished", broken_wait)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path / "ckpt", zeros)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no leftovers
    monkeypatch.undo()
    assert_identical(checkpoint.load(tmp_path / "ckpt", abstract), params)


CRASH = """
import os, jax, jax.numpy as jnp, flax.linen as nn
import orbax.checkpoint as ocp
import qflax
from qflax import checkpoint

x = jnp.ones((2, 16))
rules = [qflax.QuantizationRule(weight_qtype="int8")]
qmodel = qflax.quantize_model(nn.Dense(8), qflax.PtqProvider(rules))
params = qmodel.init(jax.random.key(0), x)["params"]
checkpoint.save("{dir}", params)
original = ocp.StandardCheckpointer.wait_until_finished

def die(self):
    original(self)  # the new checkpoint's arrays are half-way to disk...
    os._exit(3)     # ...when the process is killed

ocp.StandardCheckpointer.wait_until_finished = die
checkpoint.save("{dir}", jax.tree.map(jnp.zeros_like, params))
"""


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(linen, tmp_path):
    target = tmp_path / "ckpt"
    script = textwrap.dedent(CRASH).format(dir=target)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 3, out.stderr[-2000:]
    qmodel = qflax.quantize_model(nn.Dense(8), qflax.PtqProvider([Rule(weight_qtype="int8")]))
    x = jnp.ones((2, 16))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
    restored = checkpoint.load(target, abstract)
    assert_identical(restored, qmodel.init(jax.random.key(0), x)["params"])


def test_missing_checkpoint_and_unsavable_rules_raise(tmp_path, linen):
    _, params, abstract = linen
    with pytest.raises(FileNotFoundError, match="holds no qflax checkpoint"):
        checkpoint.load(tmp_path / "nothing", abstract)
    with pytest.raises(ValueError, match="callable"):
        checkpoint.save(tmp_path / "c", params, rules=[Rule(module_path=lambda p: True)])
    assert not (tmp_path / "c").exists()


def test_rules_json_keeps_every_field_that_changes_numerics():
    rules = [
        Rule(weight_qtype="int4", act_qtype="int8", rotation="hadamard", rotation_seed=3),
        Rule(act_qtype="int8", act_batch_axes=(0,), tile_size={0: 16}),
        Rule(weight_qtype="nf4"),  # act_batch_axes=None: one scale per row
    ]
    assert checkpoint.rules_from_json(checkpoint.rules_to_json(rules)) == rules

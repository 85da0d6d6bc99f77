"""The module system: registration, traversal, hooks, modes and all-or-nothing state loading."""

import jax.numpy as jnp
import numpy as np
import pytest

import qtorchlike
import qtorchlike.nn as qnn
from qtorchlike.nn import Module, Parameter
from qtorchlike.quant import Int8ActPerTensorFloat, Int8WeightPerChannelFloatLSQ


class Block(Module):
    def __init__(self):
        super().__init__()
        self.lin = qnn.QuantLinear(3, 2, weight_quant=None)
        self.scale = Parameter(jnp.ones(2))
        self.frozen = Parameter(jnp.zeros(2), requires_grad=False)
        self.register_buffer("steps", jnp.zeros((), jnp.int32))
        self.register_buffer("cache", jnp.zeros(2), persistent=False)

    def forward(self, x):
        self.steps = self.steps + 1
        return self.lin(x) * self.scale[None] + self.frozen[None]


def test_registration_and_traversal():
    b = Block()
    assert [n for n, _ in b.named_parameters()] == [
        "scale",
        "frozen",
        "lin.weight",
        "lin.bias",
    ]
    assert [n for n, _ in b.named_buffers()] == ["steps", "cache"]
    assert list(b.state_dict()) == ["scale", "frozen", "lin.weight", "lin.bias", "steps"]
    assert b.trainable_names() == ["scale", "lin.weight", "lin.bias"]
    # A layer without quantizers holds disabled proxies (Brevitas' layout), with no state.
    assert [n for n, _ in b.named_modules()] == [
        "",
        "lin",
        "lin.weight_quant",
        "lin.bias_quant",
        "lin.input_quant",
        "lin.output_quant",
    ]
    # Assigning an array to a registered name replaces the parameter's value.
    b.scale = jnp.full(2, 3.0)
    np.testing.assert_array_equal(b.state_dict()["scale"], [3.0, 3.0])
    # Re-registering a name as a plain attribute keeps registries consistent.
    b.register_parameter("frozen", None)
    assert b.frozen is None and "frozen" not in b.state_dict()


def test_setattr_before_init_is_a_clear_error():
    class Bad(Module):
        def __init__(self):
            self.w = Parameter(jnp.ones(1))

    with pytest.raises(AttributeError, match="super\\(\\).__init__"):
        Bad()


def test_shared_submodule_appears_once():
    lin = qnn.QuantLinear(2, 2, weight_quant=None)
    seq = qnn.Sequential(lin, lin)
    assert [n for n, _ in seq.named_parameters()] == ["0.weight", "0.bias"]


def test_hooks_and_removal():
    b = Block()
    seen = []
    pre = b.register_forward_pre_hook(lambda m, args: (args[0] * 0,))
    post = b.register_forward_hook(lambda m, args, out: seen.append(out.shape) or out + 1)
    out = b(jnp.ones((4, 3)))
    np.testing.assert_allclose(out, np.broadcast_to(np.asarray(b.lin.bias) + 1, (4, 2)), rtol=1e-6)
    assert seen == [(4, 2)]
    pre.remove()
    post.remove()
    out = b(jnp.zeros((4, 3)))
    np.testing.assert_allclose(out, np.broadcast_to(np.asarray(b.lin.bias), (4, 2)), rtol=1e-6)


def test_train_eval_propagate():
    seq = qnn.Sequential(qnn.QuantIdentity(), qnn.QuantLinear(2, 2))
    assert all(m.training for m in seq.modules())
    seq.eval()
    assert not any(m.training for m in seq.modules())
    seq.train()
    assert all(m.training for m in seq.modules())


def test_state_dict_round_trip_into_a_fresh_model():
    qtorchlike.manual_seed(1)
    a = Block()
    a(jnp.ones((1, 3)))
    qtorchlike.manual_seed(2)
    b = Block()
    result = b.load_state_dict({k: np.asarray(v) for k, v in a.state_dict().items()})
    assert result.missing_keys == [] and result.unexpected_keys == []
    for k, v in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[k], v)
        assert b.state_dict()[k].dtype == v.dtype


def _snapshot(m):
    return {k: np.asarray(v) for k, v in m.state_dict().items()}


def test_failed_load_leaves_the_model_unchanged():
    b = Block()
    before = _snapshot(b)
    good = {k: np.asarray(v) + 1 for k, v in b.state_dict().items()}
    bad_shape = dict(good, **{"lin.weight": np.ones((3, 3))})
    with pytest.raises(ValueError, match="'lin.weight' has shape \\(3, 3\\).*nothing was loaded"):
        b.load_state_dict(bad_shape)
    missing = {k: v for k, v in good.items() if k != "lin.bias"}
    with pytest.raises(KeyError, match="Missing keys: \\['lin.bias'\\]"):
        b.load_state_dict(missing)
    typo = dict(good, **{"lin.wieght": good["lin.weight"]})
    del typo["lin.weight"]
    with pytest.raises(KeyError, match="did you mean \\['lin.weight'\\]"):
        b.load_state_dict(typo)
    for k, v in _snapshot(b).items():
        np.testing.assert_array_equal(v, before[k])
    # strict=False loads what matches and reports the rest.
    result = b.load_state_dict(missing, strict=False)
    assert result.missing_keys == ["lin.bias"]
    np.testing.assert_array_equal(b.state_dict()["scale"], good["scale"])


def test_ignore_missing_keys_tolerates_only_quantizer_state(monkeypatch):
    layer = qnn.QuantLinear(
        4, 3, weight_quant=Int8WeightPerChannelFloatLSQ, input_quant=Int8ActPerTensorFloat
    )
    float_ckpt = {"weight": np.ones((3, 4), np.float32), "bias": np.zeros(3, np.float32)}
    with pytest.raises(KeyError, match="weight_quant.value"):
        layer.load_state_dict(float_ckpt)
    monkeypatch.setattr(qtorchlike.config, "IGNORE_MISSING_KEYS", True)
    result = layer.load_state_dict(float_ckpt)
    assert result.missing_keys == []  # tolerated keys are not reported, as in Brevitas
    with pytest.raises(KeyError, match="Missing keys: \\['bias'\\]"):
        layer.load_state_dict({"weight": float_ckpt["weight"]})


def test_config_flags_parse_the_environment(monkeypatch):
    monkeypatch.setenv("QTORCHLIKE_IGNORE_MISSING_KEYS", "yes")
    assert qtorchlike.config._flag("QTORCHLIKE_IGNORE_MISSING_KEYS", False) is True
    monkeypatch.setenv("QTORCHLIKE_IGNORE_MISSING_KEYS", "maybe")
    with pytest.raises(ValueError, match="QTORCHLIKE_IGNORE_MISSING_KEYS='maybe'"):
        qtorchlike.config._flag("QTORCHLIKE_IGNORE_MISSING_KEYS", False)

"""The op registry: an op added by one ``register_op`` call is intercepted and quantized."""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qflax
from qflax._engine import interception


def project(x, w):
    """A model's own contraction, unknown to qflax until registered."""
    return jnp.einsum("bk,kn->bn", x, w)


def _bind(a):
    return qflax.OpCall.from_einsum("project", "bk,kn->bn", a["x"], a["w"])


@pytest.fixture
def toy_op():
    op = qflax.register_op(qflax.OpDef(name="project", targets=lambda: (project,), bind=_bind))
    yield op
    qflax.unregister_op("project")


class Calling(nn.Module):
    """A Linen layer whose weight ``w`` (shape (8, 5)) goes through ``op(x, w)``."""

    op: Callable = project

    @nn.compact
    def __call__(self, x):
        return self.op(x, self.param("w", nn.initializers.normal(1.0), (8, 5)))


Linen = Calling


class Nnx(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 5)))

    def __call__(self, x):
        return project(x, self.w[...])


def _check_quantized(y, x, w, qp):
    """``y`` is ``x @`` the stored int8 weight, and that weight is ``w`` to within half a step.

    float64 reference: qcore's symmetric int8 maps max |w| of each output channel to
    127.5 steps, so the scale is ``max |w| / 127.5``.
    """
    w = np.asarray(w, np.float64)
    codes = np.asarray(qp.qarray.qvalue, np.float64)
    scale = np.asarray(qp.qarray.scale, np.float64)
    np.testing.assert_allclose(scale, np.abs(w).max(axis=0, keepdims=True) / 127.5, rtol=1e-6)
    assert np.all(np.abs(codes * scale - w) <= scale * (0.5 + 1e-4))  # float32 scale
    np.testing.assert_allclose(y, np.asarray(x, np.float64) @ (codes * scale), rtol=1e-5, atol=1e-5)


def _rules():
    return [qflax.QuantizationRule(op_names=("project",), weight_qtype="int8")]


def test_rule_naming_an_unregistered_op_is_refused():
    with pytest.raises(ValueError, match=r"\['project'\] are not ops qflax intercepts"):
        qflax.QuantizationRule(op_names=("project",), weight_qtype="int8")


def test_a_registered_op_is_quantized_in_a_linen_model(toy_op):
    x = jax.random.normal(jax.random.key(1), (3, 8))
    qmodel = qflax.quantize_model(Linen(), qflax.PtqProvider(_rules()))
    params = qmodel.init(jax.random.key(0), x)["params"]
    assert isinstance(params["w"], qflax.QuantizedParam)
    float_w = Linen().init(jax.random.key(0), x)["params"]["w"]
    y = qmodel.apply({"params": params}, x)
    _check_quantized(y, x, float_w, params["w"])
    # The float model differs: the quantization really happened.
    assert np.abs(np.asarray(y) - np.asarray(x @ float_w)).max() > 1e-4


def test_a_registered_op_is_quantized_in_an_nnx_model(toy_op):
    x = jax.random.normal(jax.random.key(1), (3, 8))
    model = Nnx(nnx.Rngs(0))
    float_w = model.w[...]
    qflax.quantize_model(model, qflax.PtqProvider(_rules()), x)
    qp = model.w.get_raw_value()
    assert isinstance(qp, qflax.QuantizedParam)
    _check_quantized(model(x), x, float_w, qp)


def test_a_registered_op_trains_with_qat(toy_op):
    x = jax.random.normal(jax.random.key(1), (3, 8))
    qmodel = qflax.quantize_model(Linen(), qflax.QtProvider(_rules()))
    params = qmodel.init(jax.random.key(0), x)["params"]
    y = qmodel.apply({"params": params}, x)
    ptq = qflax.quantize_model(Linen(), qflax.PtqProvider(_rules()))
    ptq_params = ptq.apply({"params": params}, x, mutable=["params"])[1]["params"]
    _check_quantized(y, x, params["w"], ptq_params["w"])  # the PTQ forward
    g = jax.grad(lambda p: qmodel.apply({"params": p}, x).sum())(params)["w"]
    # Straight-through: the gradient of sum(x @ w) with respect to w.
    np.testing.assert_allclose(g, np.broadcast_to(np.asarray(x).sum(0)[:, None], (8, 5)), 1e-5)


def test_capabilities_gate_lora_and_calibration(toy_op):
    with pytest.raises(ValueError, match="LoRA adapters are not available for project"):
        qflax.LoraRule(rank=1, op_names=("project",))
    x = jnp.ones((2, 8))
    params = Linen().init(jax.random.key(0), x)["params"]
    with pytest.raises(ValueError, match="selects project, which calibration-based PTQ"):
        qflax.layer_stats.collect(
            qflax.CalibrationData(Linen(), params, [x]), _rules(), progress=False
        )


def test_register_refuses_duplicates_and_builtins(toy_op):
    with pytest.raises(ValueError, match="'project' is registered already"):
        qflax.register_op(toy_op)
    with pytest.raises(ValueError, match="not built in"):
        qflax.unregister_op("einsum")
    with pytest.raises(ValueError, match="name='no such' is not allowed"):
        qflax.OpDef(name="no such", targets=lambda: (), bind=_bind)


def test_register_is_refused_while_interception_is_installed():
    def run(name, f, args, kwargs):
        return f(*args, **kwargs)

    with interception.intercept(run), pytest.raises(RuntimeError, match="quantized call runs"):
        qflax.register_op(qflax.OpDef(name="late", targets=lambda: (), bind=_bind))
    assert "late" not in qflax.op_names()


def _closure():
    k = 2

    def scaled(x, w):
        return jnp.einsum("bk,kn->bn", x, w) * k

    return scaled


def _keywords(x, **w):
    return x


@pytest.mark.parametrize(
    ("targets", "fragment"),
    [
        (lambda: (np.matmul,), "not a Python function"),
        (lambda: project, "must return a tuple of functions"),
        (lambda: (_closure(),), "a closure"),
        (lambda: (_keywords,), "takes **w"),
        (lambda: (jnp.einsum,), "op 'einsum' intercepts it already"),
        (lambda: (project, project), "named twice"),
    ],
)
def test_register_checks_targets_at_once(targets, fragment):
    with pytest.raises(ValueError, match="targets of op 'bad'") as err:
        qflax.register_op(qflax.OpDef(name="bad", targets=targets, bind=_bind))
    assert fragment in str(err.value)
    assert "bad" not in qflax.op_names()


def test_a_lookup_op_has_no_lora_or_calibration():
    with pytest.raises(ValueError, match="lookup=True ops take no lora or calibration"):
        qflax.OpDef(name="bad", targets=lambda: (project,), bind=_bind, lookup=True, lora=True)


def test_lambda_and_star_args_targets_are_intercepted():
    lam = lambda x, w: jnp.einsum("bk,kn->bn", x, w)  # noqa: E731 - the case under test

    def star(*operands):
        return jnp.einsum("bk,kn->bn", *operands)

    ops = [
        qflax.OpDef(
            name="lam", targets=lambda: (lam,), bind=lambda a: _einsum("lam", a["x"], a["w"])
        ),
        qflax.OpDef(
            name="star", targets=lambda: (star,), bind=lambda a: _einsum("star", *a["operands"])
        ),
    ]
    for op, f in zip(ops, (lam, star), strict=True):
        qflax.register_op(op)
        try:
            M = functools.partial(Calling, op=f)
            rules = [qflax.QuantizationRule(op_names=(op.name,), weight_qtype="int8")]
            x = jax.random.normal(jax.random.key(1), (3, 8))
            qmodel = qflax.quantize_model(M(), qflax.PtqProvider(rules))
            params = qmodel.init(jax.random.key(0), x)["params"]
            float_w = M().init(jax.random.key(0), x)["params"]["w"]
            _check_quantized(qmodel.apply({"params": params}, x), x, float_w, params["w"])
        finally:
            qflax.unregister_op(op.name)
        assert not f.__code__.co_filename.startswith("<qflax")


def _einsum(name, x, w):
    return qflax.OpCall.from_einsum(name, "bk,kn->bn", x, w)


@pytest.mark.parametrize(
    ("bind", "error", "fragment"),
    [
        (lambda a: a["oops"], ValueError, "bind of op 'broken' raised KeyError('oops')"),
        (lambda a: 42, TypeError, "bind of op 'broken' returned 42; allowed"),
        (lambda a: _einsum("other", a["x"], a["w"]), ValueError, "name='other'"),
    ],
)
def test_binder_errors_name_the_op(bind, error, fragment):
    def broken(x, w):
        return jnp.einsum("bk,kn->bn", x, w)

    qflax.register_op(qflax.OpDef(name="broken", targets=lambda: (broken,), bind=bind))
    try:
        M = functools.partial(Calling, op=broken)
        rules = [qflax.QuantizationRule(op_names=("broken",), weight_qtype="int8")]
        with pytest.raises(error) as err:
            qflax.quantize_model(M(), qflax.PtqProvider(rules)).init(
                jax.random.key(0), jnp.ones((2, 8))
            )
        assert fragment in str(err.value)
    finally:
        qflax.unregister_op("broken")


def test_an_nnx_variable_passed_to_a_registered_op_is_a_weight(toy_op):
    class Direct(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 5)))

        def __call__(self, x):
            return project(x, self.w)  # the Variable itself, not its value

    x = jax.random.normal(jax.random.key(1), (3, 8))
    model = Direct(nnx.Rngs(0))
    float_w = model.w[...]
    qflax.quantize_model(model, qflax.PtqProvider(_rules()), x)
    qp = model.w.get_raw_value()
    assert isinstance(qp, qflax.QuantizedParam)
    _check_quantized(model(x), x, float_w, qp)


@pytest.mark.parametrize("op", ["take", "ragged_dot"])
def test_lora_rules_refuse_ops_without_the_capability(op):
    # "take" reached the LoRA handler and failed with a bare KeyError('take').
    with pytest.raises(ValueError, match=f"LoRA adapters are not available for {op} "):
        qflax.LoraRule(rank=1, op_names=(op,))

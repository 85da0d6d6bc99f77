"""Loops, branches and rematerialization: unrolled, selected or inlined."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_to

import qflax
import qort

X = jax.random.normal(jax.random.key(0), (4, 16))


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, jax.Array]:
        y = nn.gelu(nn.Dense(16)(x))
        return y, jnp.sum(y, axis=-1)


class ScanStack(nn.Module):
    """Three Dense layers as one ``nn.scan`` over stacked params."""

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        layers = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return layers()(x, None)


@pytest.mark.parametrize(
    "rule",
    [None, {"weight_qtype": "int8", "act_qtype": "int8"}, {"weight_qtype": "int8"}],
    ids=["float", "w8a8", "int8_weights"],
)
def test_nn_scan_over_layers_is_unrolled(rule: dict | None) -> None:
    """It failed with "Too few leaves for PyTreeDef" (a dead site Flax leaves outside)."""
    model: nn.Module = ScanStack()
    if rule is not None:
        model = qflax.quantize_model(model, qflax.PtqProvider([qflax.QuantizationRule(**rule)]))
    variables = model.init(jax.random.key(1), X)
    exported = qort.export(model, variables, X)
    report = exported.report
    assert report is not None and report.ok, str(report)
    assert "Loop" not in {n.op_type for n in exported.model.graph.node}
    if rule is not None and "act_qtype" in rule:
        assert report.integer_sites == 3 and report.integer_kernels == 3
    got, want = qort.Session(exported)(X), model.apply(variables, X)
    for g, w in zip(got, want, strict=True):
        assert_close_to(g, w, 1e-2 if rule else 1e-5)


CONTROL = {
    "fori_loop": lambda x: jax.lax.fori_loop(0, 4, lambda i, c: jnp.tanh(c * 1.5 + i), x),
    "scan_reverse": lambda x: jax.lax.scan(
        lambda c, row: (c + row, c * row), jnp.zeros(16), x, reverse=True
    ),
    "while_fixed_trips": lambda x: jax.lax.while_loop(
        lambda s: s[0] < 3, lambda s: (s[0] + 1, jnp.sin(s[1])), (0, x)
    )[1],
    "cond_on_input": lambda x: jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x),
    "switch_on_input": lambda x: jax.lax.switch(
        jnp.argmax(x[0, :3]), [jnp.sin, jnp.cos, lambda v: v * 2], x
    ),
    "cond_on_constant": lambda x: jax.lax.cond(True, jnp.sin, jnp.cos, x),
    # qcore isolates quantized products this way: a predicate XLA cannot fold, and
    # the operands behind a barrier of several values.
    "cond_behind_barriers": lambda x: jax.lax.cond(
        jax.lax.optimization_barrier(jnp.int32(1)) != 0,
        lambda a, b: jnp.multiply(*jax.lax.optimization_barrier((a, b))),
        lambda a, b: a - b,
        x,
        jnp.sin(x),
    ),
    "remat": lambda x: jax.checkpoint(lambda v: jnp.tanh(v) @ v.T)(x),
}


@pytest.mark.parametrize("name", sorted(CONTROL))
def test_control_flow_matches_jax(name: str) -> None:
    fn = CONTROL[name]
    for x in (X, -X):
        exported = qort.export_function(fn, x)
        assert exported.report is not None and exported.report.ok, str(exported.report)
        ops = {n.op_type for n in exported.model.graph.node}
        assert not ops & {"Loop", "If", "Scan"}
        for g, w in zip(
            jax.tree.leaves(qort.Session(exported)(x)), jax.tree.leaves(fn(x)), strict=True
        ):
            assert_close_to(g, w, 1e-5)


def test_while_loop_on_inputs_is_refused() -> None:
    fn = lambda x: jax.lax.while_loop(lambda v: v.sum() < 100, lambda v: v * 2, x)  # noqa: E731
    with pytest.raises(
        qort.ExportError, match="while_loop whose condition depends on the inputs .* allowed"
    ):
        qort.export_function(fn, jnp.abs(X) + 1)


def test_export_checks_the_loop_body_once_per_step() -> None:
    exported = qort.export_function(CONTROL["fori_loop"], X)
    assert exported.report is not None
    assert sum(u.label == "tanh" for u in exported.report.units) == 4
    np.testing.assert_allclose(exported.report.end_to_end, 0, atol=1e-5)


def test_scan_without_steps() -> None:
    fn = lambda x: jax.lax.scan(lambda c, r: (c + r, c * r), x[0], x[:0])  # noqa: E731
    got = qort.Session(qort.export_function(fn, X))(X)
    assert jax.tree.map(np.shape, got) == ((16,), (0, 16))
    np.testing.assert_array_equal(got[0], np.asarray(X[0]))

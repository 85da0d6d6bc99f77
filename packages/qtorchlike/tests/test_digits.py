"""Real data: QAT of examples/qtorchlike_digits.py's CNN on scikit-learn's digits.

The test runs the example's own ``train()`` (loaded from the repository's
examples/ directory), so the example cannot drift from what is tested.
"""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtorchlike.nn as qnn
from qtorchlike import QuantTensor
from qtorchlike.func import functional_call

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "qtorchlike_digits.py"


@pytest.fixture(scope="module")
def example():
    assert EXAMPLE.is_file(), f"{EXAMPLE} is missing (the test runs the example's train())"
    spec = importlib.util.spec_from_file_location("qtorchlike_digits", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def eval_outputs(model, layers, x):
    """The outputs of ``layers`` in one jitted forward pass (eagerly, every op compiles alone)."""

    def run(state, x):
        seen = []
        handles = [m.register_forward_hook(lambda m, args, out: seen.append(out)) for m in layers]
        try:
            functional_call(model, state, x)
        finally:
            for handle in handles:
                handle.remove()
        return seen

    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return jax.jit(run)(state, x)


def check_quantized_in_eval(example, model, weight_bits):
    """Weights are integer codes within range; activations left their statistics phase."""
    assert not any(m.training for m in model.modules())
    layers = [m for m in model.modules() if isinstance(m, qnn.QuantConv2d | qnn.QuantLinear)]
    assert len(layers) == 3
    limit = 2 ** (weight_bits - 1) - 1  # narrow range: [-limit, limit]
    for w in jax.jit(lambda: [m.quant_weight() for m in layers])():
        assert isinstance(w, QuantTensor) and w.is_valid
        assert float(w.bit_width) == weight_bits
        codes = np.asarray(w.int(), np.int32)
        assert np.abs(codes).max() == limit  # each channel's max|w| maps to the top code
        # The fake-quantized weight is exactly codes x scale.
        np.testing.assert_allclose(np.asarray(w.value), codes * np.asarray(w.scale), rtol=1e-6)

    acts = [m for m in model.modules() if isinstance(m, qnn.QuantIdentity | qnn.QuantReLU)]
    assert len(acts) == 3
    for layer in acts:
        proxy = layer.act_quant
        steps = proxy.spec.collect_stats_steps
        assert steps == example.COLLECT_STATS_STEPS
        assert int(proxy.counter) >= steps  # statistics phase over: eval uses the learned scale
        # The learned threshold took over the running statistic and then was trained.
        assert float(proxy.value) > 0 and float(proxy.value) != float(proxy.running)

    # In eval every activation is a valid 8-bit QuantTensor (uint8 after ReLU).
    _, _, x_test, _ = example.load_data()
    outs = eval_outputs(model, acts, jnp.asarray(x_test[:32]))
    assert [o.signed for o in outs] == [True, False, False]
    for out in outs:
        assert isinstance(out, QuantTensor) and out.is_valid
        assert float(out.bit_width) == 8


@pytest.mark.parametrize(("weight_bits", "required"), [(8, 0.95), (4, 0.93)])
def test_qat_digits_reaches_the_required_accuracy(example, weight_bits, required):
    model, acc = example.train(weight_bit_width=weight_bits)
    assert acc >= required, f"{weight_bits}-bit weights: test accuracy {acc:.2%}"
    check_quantized_in_eval(example, model, weight_bits)

"""The public API is pinned, and importing qtorchlike pulls in no Flax, TensorFlow or LiteRT."""

import subprocess
import sys

import qtorchlike
import qtorchlike.nn


def test_public_api():
    assert set(qtorchlike.__all__) >= {
        "QuantTensor",
        "config",
        "core",
        "func",
        "functional",
        "inject",
        "manual_seed",
        "nn",
        "optim",
        "quant",
        "random",
        "solver",
    }
    for name in qtorchlike.__all__:
        assert hasattr(qtorchlike, name), name
    assert {"Module", "Parameter", "QuantLinear", "QuantConv2d", "QuantReLU", "Sequential"} <= set(
        qtorchlike.nn.__all__
    )


def test_import_pulls_no_flax_tensorflow_or_litert():
    code = (
        "import sys, qtorchlike, qtorchlike.nn, qtorchlike.quant; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('flax', 'tensorflow', 'ai_edge_litert', 'litert_converter', 'qflax', 'qlitert', "
        "'torch')); "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""The public API is pinned, and importing qcore pulls in no heavy frameworks."""

import subprocess
import sys

import qcore

PUBLIC = {
    "BackwardQuant",
    "Calibrator",
    "HowToQuantize",
    "Packing",
    "QArray",
    "QType",
    "TrainingQuant",
    "__version__",
    "calibrate",
    "calibration",
    "conv_general_dilated",
    "dequantize",
    "dot",
    "dot_general",
    "einsum",
    "fake_quant",
    "fake_quant_with_scale",
    "fakequant",
    "matmul",
    "mean_relative_error",
    "metrics",
    "numerics",
    "ops",
    "pack",
    "packing",
    "qarray",
    "qtypes",
    "quantize",
    "quantize_with_scale_zero_point",
    "ragged_dot",
    "requantize",
    "sqnr_db",
    "take",
    "train_conv_general_dilated",
    "train_dot_general",
    "train_einsum",
    "train_ragged_dot",
    "unpack",
}


def test_public_api_is_pinned():
    assert set(qcore.__all__) == PUBLIC
    for name in PUBLIC:
        assert hasattr(qcore, name), name


def test_import_does_not_pull_in_frameworks():
    code = (
        "import sys, qcore; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'flax', 'tensorflow', 'tf_keras', 'torch', 'litert', 'ai_edge_litert', "
        "'litert_converter', 'optax', 'qflax', 'qlitert', 'qtorchlike'}); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""

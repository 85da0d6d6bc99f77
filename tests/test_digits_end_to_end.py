"""The end-to-end digits demo (examples/digits_end_to_end.py) in --quick mode."""

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "digits_end_to_end.py"
ONNX = "qort w8a8 .onnx (ONNX Runtime)"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout, json.loads((out / "results.json").read_text())


def test_the_table_and_every_file_appear(demo):
    out, stdout, results = demo
    assert str(out.resolve()) in stdout
    names = [r["model"] for r in results["rows"]]
    assert names == [
        "float32",
        "qflax w8a8 static",
        "qflax int4 weights",
        "qflax nf4 weights",
        "qflax QAT int8",
        "qlitert int8 .tflite",
        "qort w8a8 .onnx (ONNX Runtime)",
        "qtorchlike QAT int8 .tflite",
    ]
    for name in names:
        assert name in stdout
    png = (out / "accuracy_vs_size.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    for file in ("flax_int8.tflite", "qtorchlike_int8.tflite"):
        data = (out / file).read_bytes()
        assert data[4:8] == b"TFL3"  # the FlatBuffer identifier of a LiteRT model
    assert onnx.load(out / "flax_w8a8.onnx").producer_name == "qort"
    rows = {r["model"]: r for r in results["rows"]}
    assert rows["qlitert int8 .tflite"]["bytes"] == (out / "flax_int8.tflite").stat().st_size
    assert rows[ONNX]["bytes"] == (out / "flax_w8a8.onnx").stat().st_size


def test_int8_models_stay_within_one_point_of_float(demo):
    rows = {r["model"]: r for r in demo[2]["rows"]}
    float_acc = rows["float32"]["accuracy"]
    assert float_acc > 0.95
    int8 = ("qflax w8a8 static", "qflax QAT int8", "qlitert int8 .tflite", ONNX)
    for name in int8:
        assert rows[name]["accuracy"] >= float_acc - 0.01, (name, rows[name], float_acc)
    # 4-bit weights: within three points here.
    for name in ("qflax int4 weights", "qflax nf4 weights"):
        assert rows[name]["accuracy"] >= float_acc - 0.03, (name, rows[name], float_acc)
    # PTQ keeps the logits close to float; QAT moves the weights on purpose.
    assert rows["qflax w8a8 static"]["logit_error"] < 0.05
    assert rows["qlitert int8 .tflite"]["logit_error"] < 0.05
    # The .onnx is the qflax w8a8 static model, run in ONNX Runtime: its logits stay as
    # close to float (an activation code may differ by one step, so not exactly equal),
    # and its three quantized layers run on integer kernels there.
    static, exported = rows["qflax w8a8 static"], rows[ONNX]
    assert abs(exported["accuracy"] - static["accuracy"]) <= 0.005, (exported, static)
    assert exported["logit_error"] < 0.05
    assert exported["integer_kernels"] >= 3
    # The eager qtorchlike model (3 epochs in --quick) and its .tflite agree.
    qt = rows["qtorchlike QAT int8 .tflite"]
    assert qt["accuracy"] > 0.85
    assert abs(qt["accuracy"] - qt["eager_qat_accuracy"]) <= 0.01


def test_sizes_shrink_as_the_formats_say(demo):
    rows = {r["model"]: r for r in demo[2]["rows"]}
    base = rows["float32"]["bytes"]
    assert rows["qflax w8a8 static"]["bytes"] < 0.3 * base  # a byte per weight + scales
    assert rows["qflax int4 weights"]["bytes"] < 0.2 * base  # half a byte per weight
    assert rows["qlitert int8 .tflite"]["bytes"] < 0.5 * base
    # int8 codes and scales, plus the graph (and constants repeated along the batch
    # stored once: before that fix, 2 MB at this batch of 450).
    assert rows["qort w8a8 .onnx (ONNX Runtime)"]["bytes"] < 0.5 * base
    assert all(r["ms_per_batch"] > 0 for r in rows.values())

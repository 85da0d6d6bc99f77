"""qtorchlike -> LiteRT: a digits CNN calibrated with calibration_mode, exported full-integer."""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qlitert
import qtorchlike
import qtorchlike.nn as qnn
from qcore.testing import assert_rejects
from qtorchlike import optim
from qtorchlike.func import train_step
from qtorchlike.quant import Int8ActPerTensorFloat, Int8WeightPerChannelFloat, Int32Bias

BATCH = 397  # the test split, exported at this static shape
INT8_KERNELS = {"CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED"}
ALLOWED_OPS = INT8_KERNELS | {"QUANTIZE", "DEQUANTIZE", "MAX_POOL_2D", "RESHAPE", "TRANSPOSE"}


def switches(model):
    out = {}
    for name, m in model.named_modules():
        out[name, "training"] = m.training
        for attr in ("enabled", "calibrating", "return_quant_tensor"):
            if attr in m.__dict__:
                out[name, attr] = m.__dict__[attr]
    return out


def state(model):
    return {k: np.asarray(v) for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def calibrated(digits):
    """conv(int8 per channel) -> relu(uint8) -> max pool -> flatten -> linear(int8)."""
    (x, y), _ = digits
    qtorchlike.manual_seed(0)
    model = qnn.Sequential(
        qnn.QuantConv2d(1, 8, 3, weight_quant=Int8WeightPerChannelFloat),
        qnn.QuantReLU(),
        qnn.MaxPool2d(2),
        qnn.Flatten(),
        qnn.QuantLinear(8 * 3 * 3, 10),
    )

    def loss(m, x, y):
        logits = m(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    with qtorchlike.disable_quant(model):  # brief float training, then PTQ
        step = train_step(model, loss, optim.Adam(model, lr=2e-2))
        for _ in range(100):
            step(x, y)
    with qtorchlike.calibration_mode(model) as forward:
        for i in range(0, 1400, 350):
            forward(x[i : i + 350])
    return model.eval()


@pytest.fixture(scope="module")
def exported(calibrated, digits):
    _, (x_test, _) = digits
    return qtorchlike.export_tflite(calibrated, x_test)


def test_exported_digits_cnn_is_int8_and_agrees_with_the_qtorchlike_model(
    calibrated, exported, digits
):
    _, (x_test, y_test) = digits
    assert x_test.shape == (BATCH, 1, 8, 8)
    report = qlitert.inspect(exported)
    names = report.op_names()
    assert set(names) <= ALLOWED_OPS, names
    assert names[0] == "QUANTIZE" and names[-1] == "DEQUANTIZE"
    kernels = [op for op in report.ops if op.name in INT8_KERNELS]
    assert len(kernels) == 2
    for op in kernels:
        ins, outs = report.op_types(op)
        assert ins == ["INT8", "INT8", "INT32"] and outs == ["INT8"], (op.name, ins, outs)
    for op in report.ops:
        if op.name not in ("QUANTIZE", "DEQUANTIZE"):
            ins, outs = report.op_types(op)
            assert set(ins + outs) <= {"INT8", "INT32"}, (op.name, ins, outs)

    # The ReLU quantizer's scale is the scale of the int8 tensor after the convolution.
    relu = calibrated[1].act_quant
    sd = qtorchlike.integer_state_dict(calibrated)
    scale = float(sd["1"]["act_scale"])
    conv = kernels[0]
    out = report.tensors[conv.outputs[0]]
    assert out.zero_point == (-128,)
    np.testing.assert_allclose(out.scale[0], scale, rtol=1e-6)
    assert relu.enabled

    ref = np.asarray(calibrated(x_test))
    got = qlitert.LiteRTModel(exported)(x_test)
    agree = np.mean(got.argmax(-1) == ref.argmax(-1))
    assert agree >= 0.95, agree
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < 0.03, rel
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    acc_q = np.mean(ref.argmax(-1) == y_test)
    acc_tfl = np.mean(got.argmax(-1) == y_test)
    assert acc_q > 0.85 and abs(acc_tfl - acc_q) <= 0.02, (acc_q, acc_tfl)


def test_export_restores_the_mode_and_saves_atomically(calibrated, digits, tmp_path):
    _, (x_test, _) = digits
    model = calibrated.train()
    try:
        before, values = switches(model), state(model)
        path = tmp_path / "digits.tflite"
        tflite = qtorchlike.export_tflite(model, x_test[:8], path=path, validate=False)
        assert path.read_bytes() == tflite
        assert switches(model) == before and model.training
        after = state(model)
        for k in values:
            np.testing.assert_array_equal(after[k], values[k], err_msg=k)
        assert qlitert.LiteRTModel(tflite)(x_test[:8]).shape == (8, 10)
    finally:
        model.eval()


class WithSine(qnn.Module):
    """A model with an op qlitert cannot quantize (jnp.sin)."""

    def __init__(self):
        super().__init__()
        self.fc = qnn.QuantLinear(4, 3)
        self.act = qnn.QuantIdentity()

    def forward(self, x):
        return self.act(jnp.sin(self.fc(x)))


def test_a_failed_export_leaves_the_model_and_the_file_untouched(tmp_path):
    model = WithSine()
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    with qtorchlike.calibration_mode(model):
        model(x)
    before, values = switches(model), state(model)
    path = tmp_path / "model.tflite"
    previous = b"\x1c\0\0\0TFL3 a previous model"  # replaceable, with overwrite=True
    path.write_bytes(previous)
    with pytest.raises(qlitert.UnsupportedOpError, match="sin"):
        qtorchlike.export_tflite(model, x, path=path, overwrite=True)
    assert path.read_bytes() == previous
    assert switches(model) == before
    after = state(model)
    for k in values:
        np.testing.assert_array_equal(after[k], values[k], err_msg=k)
    assert not model.act.act_quant._forward_hooks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.tflite"]


PATHS = {
    "a missing directory": (
        lambda d: d / "missing" / "m.tflite",
        False,
        FileNotFoundError,
        ["does not exist"],
    ),
    "a directory": (lambda d: d / "sub", False, FileExistsError, ["is a directory"]),
    "another file, even with overwrite": (
        lambda d: d / "notes.txt",
        True,
        FileExistsError,
        ["not a LiteRT model", "never"],
    ),
    "a model, without overwrite": (
        lambda d: d / "old.tflite",
        False,
        FileExistsError,
        ["already holds", "overwrite=True"],
    ),
    "not a path": (lambda d: 5, False, TypeError, ["path=5", "str or os.PathLike"]),
}


@pytest.mark.parametrize("case", list(PATHS), ids=list(PATHS))
def test_a_path_export_may_not_write_fails_before_converting(
    case, calibrated, digits, tmp_path, monkeypatch
):
    make, overwrite, error, fragments = PATHS[case]
    (tmp_path / "sub").mkdir()
    (tmp_path / "notes.txt").write_text("my notes")
    qlitert.save(tmp_path / "old.tflite", qtorchlike.export_tflite(calibrated, digits[1][0][:4]))

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted before checking the path")

    monkeypatch.setattr(qlitert, "export", no_conversion)
    _, (x_test, _) = digits
    assert_rejects(
        lambda: qtorchlike.export_tflite(
            calibrated, x_test, path=make(tmp_path), overwrite=overwrite
        ),
        error,
        *fragments,
        unchanged=(tmp_path,),
    )


def test_export_rejects_an_example_that_is_not_an_array(calibrated):
    with pytest.raises(TypeError, match=r"example_input=str .*give one input batch"):
        qtorchlike.export_tflite(calibrated, "digits.png")


def test_export_without_qlitert_names_the_extra(calibrated, digits, monkeypatch):
    _, (x_test, _) = digits
    monkeypatch.setitem(sys.modules, "qlitert", None)
    with pytest.raises(ImportError, match=r"pip install 'jaxquant-qtorchlike\[litert\]'"):
        qtorchlike.export_tflite(calibrated, x_test)


class Residual(qnn.Module):
    """Input quantizer, conv + relu, a conv with input/output quantizers, a quantized add."""

    def __init__(self):
        super().__init__()
        self.inp = qnn.QuantIdentity(return_quant_tensor=True)
        self.c1 = qnn.QuantConv2d(
            3,
            8,
            3,
            padding=1,
            weight_quant=Int8WeightPerChannelFloat,
            bias_quant=Int32Bias,
            return_quant_tensor=True,
        )
        self.r1 = qnn.QuantReLU(return_quant_tensor=True)
        self.c2 = qnn.QuantConv2d(
            8,
            8,
            3,
            padding=1,
            input_quant=Int8ActPerTensorFloat,
            output_quant=Int8ActPerTensorFloat,
            return_quant_tensor=True,
        )
        self.add = qnn.QuantEltwiseAdd(output_quant=Int8ActPerTensorFloat)
        self.fc = qnn.QuantLinear(8 * 8 * 8, 5, input_quant=Int8ActPerTensorFloat)

    def forward(self, x):
        h = self.r1(self.c1(self.inp(x)))
        return self.fc(qtorchlike.functional.flatten(self.add(h, self.c2(h)), 1))


def test_chained_quantizers_and_a_residual_add_export_to_int8():
    qtorchlike.manual_seed(0)
    model = Residual()
    x = np.random.default_rng(0).normal(size=(32, 3, 8, 8)).astype(np.float32)
    with qtorchlike.calibration_mode(model):
        model(x[:16])
        model(x[16:])
    model.eval()
    tflite = qtorchlike.export_tflite(model, x)  # validated by qlitert
    report = qlitert.inspect(tflite)
    assert set(report.op_names()) <= ALLOWED_OPS | {"ADD"}, report.op_names()
    assert report.op_names().count("QUANTIZE") == 1
    sd = qtorchlike.integer_state_dict(model, example_input=x)
    # The input is quantized once, with the QuantIdentity's (signed int8) scale.
    first = report.tensors[report.ops[0].outputs[0]]
    assert first.zero_point == (0,)
    np.testing.assert_allclose(first.scale[0], float(sd["inp"]["act_scale"]), rtol=1e-6)
    # The add's output has the add's output quantizer's scale.
    add = next(op for op in report.ops if op.name == "ADD")
    out = report.tensors[add.outputs[0]]
    np.testing.assert_allclose(out.scale[0], float(sd["add"]["output_scale"]), rtol=1e-6)
    ref = np.asarray(model(x))
    got = qlitert.LiteRTModel(tflite)(x)
    # The requantizations LiteRT cannot express (c2's and the add's input
    # quantizers after the ReLU's) are left out: a few percent of difference.
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.08


def test_the_digits_example_exports_its_4_bit_qat_model(tmp_path):
    """examples/qtorchlike_digits.py --tflite: Int32Bias, 4-bit weights, learned act scales."""
    path = Path(__file__).resolve().parents[1] / "examples" / "qtorchlike_digits.py"
    spec = importlib.util.spec_from_file_location("qtorchlike_digits", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, acc = example.train(weight_bit_width=4, epochs=3)
    out = tmp_path / "digits.tflite"
    litert_acc = example.export(model, str(out))
    tflite = out.read_bytes()
    report = qlitert.inspect(tflite)
    assert set(report.op_names()) <= ALLOWED_OPS, report.op_names()
    sd = qtorchlike.integer_state_dict(model, example_input=example.load_data()[2])
    codes = sd["1"]["weight_int"]
    assert codes.min() >= -7 and codes.max() <= 7  # 4-bit, narrow range
    assert acc > 0.85, acc
    assert abs(litert_acc - acc) <= 0.01, (acc, litert_acc)

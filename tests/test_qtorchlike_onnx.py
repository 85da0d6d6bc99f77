"""qtorchlike -> ONNX (QDQ format): a Brevitas-tutorial-style CNN and an MLP on digits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qort
import qtorchlike
import qtorchlike.nn as qnn
from qtorchlike import optim
from qtorchlike.func import train_step
from qtorchlike.quant import (
    Fp8e4m3WeightPerTensorFloat,
    Int4WeightPerChannelFloat,
    Int8ActPerTensorFloat,
    Int8WeightPerChannelFloat,
    Int8WeightPerTensorFloat,
    Int32Bias,
)

BATCH = 397  # the test split, exported at this static shape
FLOAT_ARITHMETIC = {"Round", "Floor", "Ceil", "Div", "Clip", "Min", "Max"}


def calibrated(model, x):
    with qtorchlike.calibration_mode(model) as forward:
        for i in range(0, 1400, 350):
            forward(x[i : i + 350])
    return model.eval()


def trained(model, x, y, steps=60):
    """Brief float training, then post-training calibration (Brevitas' PTQ flow)."""

    def loss(m, x, y):
        logits = m(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    with qtorchlike.disable_quant(model):
        step = train_step(model, loss, optim.Adam(model, lr=2e-2))
        for _ in range(steps):
            step(x, y)
    return calibrated(model, x)


@pytest.fixture(scope="module")
def cnn(digits):
    """QuantIdentity -> conv(int8 per channel, int32 bias) -> QuantReLU -> pool -> conv ->
    QuantReLU -> flatten -> linear (int8 per tensor, int32 bias), as in Brevitas' tutorials."""
    (x, y), _ = digits
    qtorchlike.manual_seed(0)
    model = qnn.Sequential(
        qnn.QuantIdentity(act_quant=Int8ActPerTensorFloat, return_quant_tensor=True),
        qnn.QuantConv2d(
            1, 8, 3, padding=1, weight_quant=Int8WeightPerChannelFloat, bias_quant=Int32Bias
        ),
        qnn.QuantReLU(return_quant_tensor=True),
        qnn.MaxPool2d(2),
        qnn.QuantConv2d(8, 16, 3, weight_quant=Int8WeightPerChannelFloat, bias_quant=Int32Bias),
        qnn.QuantReLU(return_quant_tensor=True),
        qnn.Flatten(),
        qnn.QuantLinear(
            16 * 2 * 2, 10, weight_quant=Int8WeightPerTensorFloat, bias_quant=Int32Bias
        ),
    )
    return trained(model, x, y)


@pytest.fixture(scope="module")
def mlp4(digits):
    """4-bit weights per channel and a 4-bit QuantReLU between two QuantLinears
    (PyTorch's initial weights, calibrated on digits: this test is about the export)."""
    (x, _), _ = digits
    qtorchlike.manual_seed(1)
    model = qnn.Sequential(
        qnn.Flatten(),
        qnn.QuantIdentity(act_quant=Int8ActPerTensorFloat, return_quant_tensor=True),
        qnn.QuantLinear(64, 32, weight_quant=Int4WeightPerChannelFloat, bias_quant=Int32Bias),
        qnn.QuantReLU(bit_width=4, return_quant_tensor=True),
        qnn.QuantLinear(32, 10, weight_quant=Int4WeightPerChannelFloat, bias_quant=Int32Bias),
    )
    return calibrated(model, x)


def op_types(exported):
    return [n.op_type for n in exported.model.graph.node]


def check_against_eager(model, exported, x):
    """ONNX Runtime's logits against qtorchlike's eval forward on the same batch.

    Images are independent rows: only a row with a code one step away at a rounding
    tie (counted by validation) may differ by more than float rounding.
    """
    want = np.asarray(model(jnp.asarray(x)))
    got = qort.Session(exported)(x)
    assert got.shape == want.shape
    rows_off = np.max(np.abs(got - want), axis=1) > 1e-5 * float(np.max(np.abs(want)))
    assert int(np.sum(rows_off)) <= exported.report.qdq_steps
    return got, want


def state(model):
    return {k: np.asarray(v) for k, v in model.state_dict().items()}


def test_cnn_exports_qdq_with_integer_kernels(cnn, digits):
    _, (x, y) = digits
    before = state(cnn)
    exported = qtorchlike.export_onnx(cnn, x)
    after = state(cnn)  # the export leaves the model as it was
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before) and not cnn.training
    report = exported.report
    assert report is not None and report.ok, str(report)
    ops = op_types(exported)
    # Three activation quantizers: QuantIdentity and two QuantReLUs; no float rounding.
    assert ops.count("QuantizeLinear") == 3
    assert not FLOAT_ARITHMETIC & set(ops), ops
    # The file holds integer weights and biases, no float copy of them.
    init = exported.model.graph.initializer
    assert not [t.name for t in init if t.data_type == 1 and np.prod(t.dims) > 16]
    assert report.qdq_units == 3
    assert report.qdq_products == 3 and report.unfused_products == (), str(report)
    got, _ = check_against_eager(cnn, exported, x)
    assert np.mean(np.argmax(got, 1) == y) > 0.8


def test_mlp_with_4_bit_codes(mlp4, digits):
    _, (x, _) = digits
    exported = qtorchlike.export_onnx(mlp4, x)
    report = exported.report
    assert report is not None and report.ok, str(report)
    ops = op_types(exported)
    assert ops.count("Clip") == 1  # the 4-bit QuantReLU's codes; weights are DQ of 4-bit codes
    assert report.qdq_products == 2 and report.unfused_products == (), str(report)
    check_against_eager(mlp4, exported, x)


def test_training_mode_model_is_refused(digits):
    _, (x, _) = digits
    model = qnn.Sequential(qnn.QuantLinear(64, 10))
    with pytest.raises(ValueError, match=r"export_onnx.*training mode.*model\.eval\(\)"):
        qtorchlike.export_onnx(model.train(), x.reshape(-1, 64))


def test_unsupported_quantizer_is_refused(digits):
    _, (x, _) = digits
    model = qnn.Sequential(qnn.QuantLinear(64, 10, weight_quant=Fp8e4m3WeightPerTensorFloat))
    with pytest.raises(
        ValueError, match=r"export_onnx: layer '0'.*Fp8e4m3WeightPerTensorFloat.*allowed"
    ):
        qtorchlike.export_onnx(model.eval(), x.reshape(-1, 64))


def test_uncalibrated_activation_quantizer_is_refused(digits):
    _, (x, _) = digits
    model = qnn.Sequential(qnn.QuantIdentity(act_quant=Int8ActPerTensorFloat)).eval()
    with pytest.raises(
        ValueError, match=r"layer '0'.*Int8ActPerTensorFloat.*no statistics.*calibration_mode"
    ):
        qtorchlike.export_onnx(model, x)


def test_bad_example_input_is_refused():
    model = qnn.Sequential(qnn.QuantLinear(4, 2)).eval()
    with pytest.raises(TypeError, match=r"export_onnx\(example_input=.*allowed|one input batch"):
        qtorchlike.export_onnx(model, "x")


@pytest.mark.parametrize("bits", [3, 8])
def test_truncating_average_pool_is_refused_and_exact_one_exports(bits):
    """TruncAvgPool2d's truncation has no QDQ form: it was exported as a plain average."""
    model = qnn.Sequential(
        qnn.QuantReLU(bit_width=4, return_quant_tensor=True),
        qnn.TruncAvgPool2d(2, bit_width=bits, return_quant_tensor=True),
    )
    x = np.random.default_rng(0).uniform(0, 1, (1, 1, 4, 4)).astype(np.float32)
    with qtorchlike.calibration_mode(model) as forward:
        forward(x)
    model.eval()
    if bits == 3:  # 4-bit codes summed over 2 x 2 need 6 bits
        with pytest.raises(ValueError, match=r"layer '1' \(TruncAvgPool2d\) truncates"):
            qtorchlike.export_onnx(model, x)
    else:
        exported = qtorchlike.export_onnx(model, x)
        want = np.asarray(model(x).value)
        np.testing.assert_allclose(qort.Session(exported)(x), want, atol=1e-6)


def test_directory_path_is_named_as_one(tmp_path):
    model = qnn.Sequential(qnn.QuantLinear(4, 2)).eval()
    (tmp_path / "keep.txt").write_text("kept")
    with pytest.raises(ValueError, match="is a directory"):
        qtorchlike.export_onnx(model, np.ones((1, 4), np.float32), path=tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "kept"

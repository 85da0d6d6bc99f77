"""qort.qdq: fake quantizations and dequantized constants marked in a JAX function."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.datasets import load_digits

import qort
from qort import qdq


def op_types(exported: qort.Exported) -> list[str]:
    return [n.op_type for n in exported.model.graph.node if n.op_type != "Identity"]


def digits_rows() -> np.ndarray:
    return (load_digits().data[:64] / 16.0).astype(np.float32)  # (64, 64), real data


def test_quantize_dequantize_becomes_q_dq_pair() -> None:
    x = digits_rows()
    exported = qort.export_function(
        lambda x: qdq.quantize_dequantize(x, np.float32(1 / 255), qmin=0, qmax=255), x
    )
    assert op_types(exported) == ["QuantizeLinear", "DequantizeLinear"]
    report = exported.report
    assert report is not None and report.ok, str(report)
    assert report.qdq_units == 1
    y = qort.Session(exported)(x)
    # QuantizeLinear divides by the float32 scale: 0.5 / fl(1/255) = 127.49999... -> 127.
    s = np.float64(np.float32(1 / 255))
    want = np.clip(np.round(x.astype(np.float64) / s), 0, 255) * s
    np.testing.assert_allclose(y, want, rtol=1e-6)


def test_narrow_bit_width_clips_the_codes() -> None:
    """4-bit signed codes live in int8 containers, clipped: QuantizeLinear, Clip, Dequantize."""
    x = digits_rows() - 0.5
    exported = qort.export_function(
        lambda x: qdq.quantize_dequantize(x, np.float32(0.0625), qmin=-8, qmax=7), x
    )
    assert op_types(exported) == ["QuantizeLinear", "Clip", "DequantizeLinear"]
    y = qort.Session(exported)(x)
    assert float(np.min(y)) == -0.5 and float(np.max(y)) == 7 * 0.0625


def test_dequantize_of_codes_feeds_the_product() -> None:
    x = digits_rows()
    codes = np.asarray(np.random.default_rng(0).integers(-127, 128, (64, 10)), np.int8)
    scale = np.linspace(0.01, 0.02, 10, dtype=np.float32)

    def f(x):
        xq = qdq.quantize_dequantize(x, np.float32(1 / 255), qmin=0, qmax=255)
        return xq @ qdq.dequantize(codes, scale, axis=1)

    exported = qort.export_function(f, x)
    ops = op_types(exported)
    assert ops.count("DequantizeLinear") == 2 and "MatMul" in ops
    init = {t.name: t for t in exported.model.graph.initializer}
    dq_w = [n for n in exported.model.graph.node if n.op_type == "DequantizeLinear"][1]
    # The file holds the codes: int8 ones as uint8 code + 128, zero point 128 (exact on
    # ONNX Runtime's x86 uint8 x uint8 kernels, where uint8 x int8 saturates).
    assert init[dq_w.input[0]].data_type == 2  # UINT8
    report = exported.report
    assert report is not None and report.ok, str(report)
    assert report.qdq_products == 1 and not report.unfused_products, str(report)


def test_reference_arithmetic_is_what_the_function_returns() -> None:
    """``reference`` computes the value in JAX; validation compares ONNX's codes to it."""
    x = digits_rows()
    # Rounding half away from zero: at exact ties ONNX (half to even) is one step away.
    away = lambda x, s, z: jnp.clip(jnp.sign(x / s) * jnp.floor(jnp.abs(x / s) + 0.5), 0, 15) * s  # noqa: E731
    f = lambda x: qdq.quantize_dequantize(x, np.float32(1 / 15), qmin=0, qmax=15, reference=away)  # noqa: E731
    np.testing.assert_array_equal(jax.jit(f)(x), away(x, np.float32(1 / 15), 0))
    report = qort.export_function(f, x).report
    assert report is not None and report.ok, str(report)


def test_bad_arguments_name_what_is_allowed() -> None:
    x = jnp.ones((2, 3))
    with pytest.raises(qort.ExportError, match=r"qmin=-200, qmax=100.*allowed"):
        qdq.quantize_dequantize(x, np.float32(1), qmin=-200, qmax=100)
    with pytest.raises(qort.ExportError, match=r"scale.*allowed: .*concrete"):
        jax.jit(lambda x, s: qdq.quantize_dequantize(x, s, qmin=0, qmax=255))(x, 1.0)
    with pytest.raises(qort.ExportError, match=r"scale of shape \(2, 3\).*allowed"):
        qdq.quantize_dequantize(x, np.ones((2, 3), np.float32), qmin=0, qmax=255)
    with pytest.raises(qort.ExportError, match=r"codes of dtype float32.*allowed"):
        qdq.dequantize(np.ones((2, 3), np.float32), np.float32(1))


def test_conv_bias_and_relu_take_the_forms_onnx_runtime_fuses() -> None:
    """A layer's bias ``add`` moves into Conv / Gemm, ``max(x, 0)`` becomes Relu: all
    three products then run on integer kernels (QLinearConv, QGemm)."""
    x = load_digits().images[:16, None].astype(np.float32) / 16.0  # (16, 1, 8, 8)
    rng = np.random.default_rng(1)
    w1 = np.asarray(rng.integers(-127, 128, (4, 1, 3, 3)), np.int8)
    w2 = np.asarray(rng.integers(-127, 128, (10, 4 * 6 * 6)), np.int8)
    b1, b2 = (np.asarray(rng.integers(-500, 500, n), np.int32) for n in (4, 10))
    s1, s2 = np.float32(0.01), np.linspace(0.001, 0.002, 10, dtype=np.float32)

    def f(x):
        xq = qdq.quantize_dequantize(x, np.float32(1 / 127), qmin=-127, qmax=127)
        w = qdq.dequantize(w1, s1)
        y = jax.lax.conv_general_dilated(xq, w, (1, 1), "VALID")
        y = y + qdq.dequantize(b1, s1 / 127).reshape(1, 4, 1, 1)
        y = qdq.quantize_dequantize(jnp.maximum(y, 0.0), np.float32(0.05), qmin=0, qmax=255)
        y = y.reshape(16, -1) @ qdq.dequantize(w2, s2.reshape(10, 1)).T
        return y + qdq.dequantize(b2, s2 * 0.05)

    exported = qort.export_function(f, x)
    ops = op_types(exported)
    assert {"Relu", "Gemm"} <= set(ops) and not {"Add", "Max", "MatMul"} & set(ops), ops
    conv = [n for n in exported.model.graph.node if n.op_type == "Conv"]
    assert len(conv) == 1 and len(conv[0].input) == 3  # the bias is the Conv's input
    report = exported.report
    assert report is not None and report.ok, str(report)
    assert report.qdq_products == 2 and report.unfused_products == (), str(report)
    np.testing.assert_allclose(qort.Session(exported)(x), jax.jit(f)(x), rtol=0, atol=1e-4)


def test_a_product_left_in_float_is_reported() -> None:
    """A float bias keeps ONNX Runtime's Conv in float: not an error, but named."""
    x = load_digits().images[:16, None].astype(np.float32) / 16.0
    w = np.asarray(np.random.default_rng(2).integers(-127, 128, (4, 1, 3, 3)), np.int8)

    def f(x):
        xq = qdq.quantize_dequantize(x, np.float32(1 / 255), qmin=0, qmax=255)
        with jax.named_scope("conv1"):
            y = jax.lax.conv_general_dilated(
                xq, qdq.dequantize(w, np.float32(0.01)), (1, 1), "VALID"
            )
            y = y + jnp.arange(4.0).reshape(1, 4, 1, 1)  # a float bias
        return qdq.quantize_dequantize(jnp.maximum(y, 0.0), np.float32(0.05), qmin=0, qmax=255)

    report = qort.export_function(f, x).report
    assert report is not None and report.ok, str(report)
    assert report.qdq_products == 1
    assert report.unfused_products == ("conv_general_dilated in conv1",), str(report)
    assert "not fused by ONNX Runtime: conv_general_dilated in conv1" in str(report)

"""Export of annotated JAX functions: integer kernels, agreement with JAX, safe files, errors."""

import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcore
import qlitert
from qlitert import converter, qdq

RNG = np.random.default_rng(0)
W1 = RNG.normal(size=(64, 32)).astype(np.float32) * 0.2
B1 = RNG.normal(size=(32,)).astype(np.float32) * 0.1
W2 = RNG.normal(size=(32, 10)).astype(np.float32) * 0.2
X = RNG.normal(size=(4, 64)).astype(np.float32)
IN = qdq.activation_params(X.min(), X.max())


def weight(w):
    """A (K, N) weight as TFLite stores it: (N, K), int8 per output channel."""
    wt = jnp.asarray(w.T)
    return qdq.fake_quant(wt, qdq.weight_scales(w.T, 0), narrow_range=True, axis=0).T


def ranges():
    """Calibrated (float) ranges of the hidden and output activations on X."""
    h = np.maximum(X @ W1 + B1, 0)
    y = h @ W2
    return qdq.activation_params(h.min(), h.max()), qdq.activation_params(y.min(), y.max())


def mlp_body(x):
    (hs, hz), (ys, yz) = ranges()
    h = qdq.fake_quant(jnp.maximum(x @ weight(W1) + B1[None, :], 0), hs, hz)
    return qdq.fake_quant(h @ weight(W2), ys, yz)


def mlp(x):
    return mlp_body(qdq.fake_quant(x, *IN))


def test_annotated_mlp_becomes_int8_kernels_that_agree_with_jax():
    tfl = qlitert.export(mlp, X)
    report = qlitert.inspect(tfl)
    assert report.op_names() == ["QUANTIZE", "FULLY_CONNECTED", "FULLY_CONNECTED", "DEQUANTIZE"]
    first = report.ops[1]
    ins, outs = report.op_types(first)
    assert ins == ["INT8", "INT8", "INT32"] and outs == ["INT8"]  # activation, weight, bias
    w = report.tensors[first.inputs[1]]
    assert w.shape == (32, 64) and len(w.scale) == 32 and set(w.zero_point) == {0}
    np.testing.assert_allclose(w.scale, np.abs(W1).max(0) / 127, rtol=1e-6)
    # int8 weights: the file holds a byte per weight, not four.
    assert report.constant_bytes()["INT8"] == W1.size + W2.size
    # Independent check of the interpreter against the JAX decomposition.
    got = qlitert.LiteRTModel(tfl)(X)
    step = ranges()[1][0][0]
    diff = np.abs(got - np.asarray(jax.jit(mlp)(X))) / step
    assert np.mean(diff <= 1) >= 0.95 and diff.max() <= 2
    # ... and both against the float model: quantization error only.
    ref = np.maximum(X @ W1 + B1, 0) @ W2
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05


def test_int8_io_has_no_quantize_or_dequantize_ops():
    (_, _), (ys, yz) = ranges()

    def int8_io(xq):
        return qdq.quantize(mlp_body(qdq.dequantize(xq, *IN)), ys, yz)

    xq = np.asarray(qdq.quantize(jnp.asarray(X), *IN))
    assert xq.dtype == np.int8
    tfl = qlitert.export(int8_io, xq)
    assert qlitert.inspect(tfl).op_names() == ["FULLY_CONNECTED", "FULLY_CONNECTED"]
    codes = qlitert.LiteRTModel(tfl, quantize_io=False)(xq)
    assert codes.dtype == np.int8
    floats = qlitert.LiteRTModel(tfl)(X)  # quantizes X and dequantizes the output for you
    np.testing.assert_allclose(floats, (codes.astype(np.float32) - yz[0]) * ys[0], atol=1e-6)


def test_float_compute_is_reported_by_op():
    def unannotated_constant(x):
        return qdq.fake_quant(qdq.fake_quant(x, *IN) * 3.0, *IN)

    with pytest.raises(qlitert.ExportError, match=r"MUL computes in \['FLOAT32'\]"):
        qlitert.export(unannotated_constant, X)


def test_symbolic_shapes_point_to_static_export():
    (b,) = jax.export.symbolic_shape("b")
    with pytest.raises(qlitert.ExportError, match=r"static shape .*jax-ml/jax#40486"):
        qlitert.export(mlp, jax.ShapeDtypeStruct((b, 64), jnp.float32), validate=False)


def test_an_unverified_converter_version_is_refused(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: "0.9.0" if name == "litert-converter" else real(name),
    )
    with pytest.raises(converter.ConverterError, match=r"litert-converter 0.9.0 .* 0.5.x"):
        converter.check_version()


def test_inspect_rejects_other_bytes_and_models_check_their_inputs():
    with pytest.raises(ValueError, match="not a valid LiteRT model"):
        qlitert.inspect(b"\x00" * 64)
    model = qlitert.LiteRTModel(qlitert.export(mlp, X))
    with pytest.raises(ValueError, match=r"shape \(4, 64\)"):
        model(X[:1])
    with pytest.raises(ValueError, match="takes 1 inputs"):
        model(X, X)


def test_qdq_arguments_are_checked():
    with pytest.raises(ValueError, match="dtype='u8'"):
        qdq.fake_quant(jnp.ones(3), 0.1, dtype="u8")
    with pytest.raises(ValueError, match="need axis="):
        qdq.fake_quant(jnp.ones((2, 3)), [0.1, 0.2])
    with pytest.raises(ValueError, match="finite and > 0"):
        qdq.fake_quant(jnp.ones(3), 0.0)


def test_a_function_with_qcore_products_at_batch_1_exports():
    """qcore's weight-only products at batch 1 export, also after the function ran jitted.

    On the CPU qcore runs each such product as the branch of a conditional (so that
    XLA:CPU does not fuse it with its neighbours); the converter made that an ``IF``
    op, which validation refused, and a function traced before export kept it (and,
    with qkernels installed, its native calls, which ``jax.export`` refused).
    """
    w = qcore.quantize(jnp.asarray(W1), qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,)))

    def f(x):
        return qcore.dot_general(x, w, (((1,), (0,)), ((), ())))

    x = X[:1]
    jitted = jax.jit(f)
    want = np.asarray(jitted(x))  # traced and cached before the export
    tfl = qlitert.export(jitted, x, compute_types=["FLOAT32", "INT32", "INT8"])
    assert "IF" not in qlitert.inspect(tfl).op_names()
    got = qlitert.LiteRTModel(tfl)(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))

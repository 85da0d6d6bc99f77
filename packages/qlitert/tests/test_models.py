"""End-to-end: Linen and NNX models become validated full-int8 .tflite models.

Four architectures (MLP; CNN; depthwise-separable CNN with a residual ADD and a
CONCAT; a transformer block with layer norm, softmax attention and gelu), each in
Linen and NNX, are calibrated, annotated and exported. The tests check the
kernels (int8 activations, int8 per-channel weights, int32 biases), re-check the
agreement with the JAX annotated model on fresh inputs (within one output step on
at least 95% of the values, two everywhere) and the closeness to the float model.
"""

import archs
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qlitert

SHAPES = {"mlp": (8, 16), "cnn": (4, 8, 8, 3), "dsconv": (2, 8, 8, 3), "transformer": (1, 8, 16)}
KERNELS = {
    "mlp": {"FULLY_CONNECTED"},
    "cnn": {"CONV_2D", "AVERAGE_POOL_2D", "RESHAPE", "FULLY_CONNECTED"},
    "dsconv": {
        "CONV_2D", "DEPTHWISE_CONV_2D", "ADD", "CONCATENATION", "AVERAGE_POOL_2D",
        "FULLY_CONNECTED",
    },
    "transformer": {
        "MEAN", "SUB", "MUL", "RSQRT", "FULLY_CONNECTED", "BATCH_MATMUL", "SOFTMAX", "GELU",
        "ADD",
    },
}  # fmt: skip
# Relative L2 error of the int8 model against the float model. Measured (Linen, NNX):
# mlp 0.070, 0.043; cnn 0.020, 0.051; dsconv 0.059 (Linen); transformer 0.111, 0.092
# (seed 0; with seeds 1-3 the NNX mlp reached 0.163 and the transformers 0.118).
REL_ERR = {"mlp": 0.2, "cnn": 0.15, "dsconv": 0.15, "transformer": 0.2}
WEIGHTED = ("FULLY_CONNECTED", "CONV_2D", "DEPTHWISE_CONV_2D")


def avg_pool(x):
    """2x2 average pooling, stride 2 ('VALID'): AVERAGE_POOL_2D (no int count division)."""
    return jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0


def attend(q, k, v):
    att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) * 0.25)
    return jnp.einsum("bts,bsd->btd", att, v)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(nn.relu(nn.Dense(32)(x))))
        return nn.Dense(10)(x)


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = avg_pool(nn.relu(nn.Conv(8, (3, 3))(x)))
        x = avg_pool(nn.relu(nn.Conv(16, (3, 3))(x)))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class LinenDSConv(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = x + nn.Conv(8, (1, 1))(nn.relu(nn.Conv(8, (3, 3), feature_group_count=8)(x)))
        x = avg_pool(jnp.concatenate([x, nn.relu(nn.Conv(8, (1, 1))(x))], axis=-1))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.Dense(16)(attend(nn.Dense(16)(h), nn.Dense(16)(h), nn.Dense(16)(h)))
        return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 32, rngs=rngs)
        self.c = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.c(nnx.relu(self.b(nnx.relu(self.a(x)))))


class NnxCNN(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b = nnx.Conv(3, 8, (3, 3), rngs=rngs), nnx.Conv(8, 16, (3, 3), rngs=rngs)
        self.head = nnx.Linear(2 * 2 * 16, 10, rngs=rngs)

    def __call__(self, x):
        x = avg_pool(nnx.relu(self.b(avg_pool(nnx.relu(self.a(x))))))
        return self.head(x.reshape(x.shape[0], -1))


class NnxDSConv(nnx.Module):
    def __init__(self, rngs):
        self.stem = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.dw = nnx.Conv(8, 8, (3, 3), feature_group_count=8, rngs=rngs)
        self.pw, self.branch = nnx.Conv(8, 8, (1, 1), rngs=rngs), nnx.Conv(8, 8, (1, 1), rngs=rngs)
        self.head = nnx.Linear(4 * 4 * 16, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.stem(x))
        x = x + self.pw(nnx.relu(self.dw(x)))
        x = avg_pool(jnp.concatenate([x, nnx.relu(self.branch(x))], axis=-1))
        return self.head(x.reshape(x.shape[0], -1))


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(16, rngs=rngs), nnx.LayerNorm(16, rngs=rngs)
        self.q, self.k, self.v, self.o = (nnx.Linear(16, 16, rngs=rngs) for _ in range(4))
        self.up, self.down = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        h = self.ln1(x)
        x = x + self.o(attend(self.q(h), self.k(h), self.v(h)))
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


LINEN = {"mlp": LinenMLP, "cnn": LinenCNN, "dsconv": LinenDSConv, "transformer": LinenBlock}
NNX = {"mlp": NnxMLP, "cnn": NnxCNN, "dsconv": NnxDSConv, "transformer": NnxBlock}


def build(api, arch, x):
    """The float model as a function of its input, parameters closed over."""
    if api == "nnx":
        model = NNX[arch](nnx.Rngs(0))
        return lambda x: model(x)
    model = LINEN[arch]()
    params = model.init(jax.random.key(0), x)
    return lambda x: model.apply(params, x)


def assert_int8_kernels(report):
    """Float only at the input QUANTIZE and the output DEQUANTIZE; int8 kernels between.

    Other QUANTIZE ops may only requantize int8 to int8 (the converter adds them where
    a CONCATENATION input has another scale than its output, or for a shared constant).
    """
    names = report.op_names()
    assert names[0] == "QUANTIZE" and names[-1] == "DEQUANTIZE", names
    assert names.count("DEQUANTIZE") == 1, names
    assert report.op_types(report.ops[0]) == (["FLOAT32"], ["INT8"])
    assert report.ops[0].inputs == report.inputs and report.ops[-1].outputs == report.outputs
    for op in report.ops[1:-1]:  # (int8 -> int8 for any QUANTIZE among them)
        ins, outs = report.op_types(op)
        assert set(ins + outs) <= {"INT8", "INT32"}, (op.name, ins, outs)
        if op.name in WEIGHTED:
            weight = report.tensors[op.inputs[1]]
            assert weight.dtype == "INT8" and set(weight.zero_point) == {0}, (op.name, weight)
            n_out = weight.shape[weight.quantized_dimension]
            assert len(weight.scale) == n_out > 1, (op.name, weight)  # per output channel
            if len(op.inputs) > 2:
                assert report.tensors[op.inputs[2]].dtype == "INT32", op.name  # bias


@pytest.mark.parametrize("arch", list(SHAPES))
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_model_converts_to_int8_kernels_close_to_jax(api, arch):
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=SHAPES[arch]).astype(np.float32) for _ in range(5)]
    fn = build(api, arch, batches[0])
    annotated = qlitert.annotate(fn, qlitert.calibrate(fn, batches))
    tfl = qlitert.export(annotated, batches[0])  # validated: raises ExportError otherwise
    report = qlitert.inspect(tfl)
    assert KERNELS[arch] <= set(report.op_names()), report.op_names()
    assert_int8_kernels(report)

    # Re-check the agreement with JAX's model of the integer kernels on fresh inputs.
    step = report.tensors[report.ops[-1].inputs[0]].scale[0]
    tflite_model, jax_model = qlitert.LiteRTModel(tfl), jax.jit(annotated)
    fresh = [rng.normal(size=SHAPES[arch]).astype(np.float32) for _ in range(3)]
    got = np.stack([tflite_model(x) for x in fresh])
    want = np.stack([np.asarray(jax_model(x)) for x in fresh])
    steps = np.abs(got.astype(np.float64) - want) / step
    within_one, worst = float(np.mean(steps <= 1 + 1e-3)), float(np.max(steps))
    assert within_one >= 0.95 and worst <= 2 + 1e-3, (within_one, worst)

    # ... and its (loose) closeness to the float model.
    ref = np.stack([np.asarray(fn(x)) for x in fresh])
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel < REL_ERR[arch], rel


class LinenEncoder(nn.Module):
    """An encoder block around Flax's own attention module, used as written."""

    @nn.compact
    def __call__(self, x, ids=None):
        # ids: int32 tokens, 0 for padding; the mask is made from them in the model.
        mask = None if ids is None else nn.make_attention_mask(ids > 0, ids > 0)
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(h, mask=mask)
        return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))


class NnxEncoder(nnx.Module):
    def __init__(self, rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(16, rngs=rngs), nnx.LayerNorm(16, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x, ids=None):
        mask = None if ids is None else nnx.make_attention_mask(ids > 0, ids > 0)
        x = x + self.attention(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


def padded_ids(rng, shape):
    ids = rng.integers(1, 9, size=shape).astype(np.int32)
    ids[:, -2:] = 0  # the last two positions are padding
    return ids


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_flax_attention_modules_become_int8_kernels(api, masked):
    # Issue 21: Flax's attention divides the query by sqrt(head size) after a
    # DenseGeneral with two output axes (strict calibrate refused the div; non-strict
    # left it in float), and a mask becomes jnp.where(mask, scores, big negative).
    rng = np.random.default_rng(0)
    shape = (2, 6, 16)
    xs = [rng.normal(size=shape).astype(np.float32) for _ in range(6)]
    ids = [padded_ids(rng, shape[:2]) for _ in range(6)]
    if api == "nnx":
        module = NnxEncoder(nnx.Rngs(0))

        def fn(x, i=None):
            return module(x, i)
    else:
        params = LinenEncoder().init(jax.random.key(0), xs[0], ids[0])

        def fn(x, i=None):
            return LinenEncoder().apply(params, x, i)

    batches = list(zip(xs[:5], ids[:5], strict=True)) if masked else xs[:5]
    inputs = (xs[5], ids[5]) if masked else (xs[5],)
    cal = qlitert.calibrate(fn, batches, strict=True)
    tfl = qlitert.export(qlitert.annotate(fn, cal), *inputs)  # validated
    report = qlitert.inspect(tfl)
    names = report.op_names()
    kernels = {"FULLY_CONNECTED", "BATCH_MATMUL", "SOFTMAX", "GELU", "MUL", "ADD", "MEAN"}
    assert kernels <= set(names), names
    assert "DIV" not in names, names
    assert not qlitert.check_kernels(report), qlitert.check_kernels(report)
    if masked:
        assert "SELECT_V2" in names, names
    for op in report.ops:
        ins, outs = report.op_types(op)
        assert "FLOAT32" not in ins + outs or op.name in ("QUANTIZE", "DEQUANTIZE"), op.name
    got = qlitert.LiteRTModel(tfl)(*inputs)
    ref = np.asarray(fn(*inputs), np.float64)
    # Relative L2 error against the float model, measured (unmasked, masked): Linen
    # 0.160, 0.169; NNX 0.126, 0.121.
    assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) < 0.25


class BiasedAttention(nn.Module):
    """Attention with an additive bias made from an integer mask (no jnp.where)."""

    @nn.compact
    def __call__(self, x, ids):
        q, k, v = (nn.DenseGeneral((2, 8))(x) for _ in range(3))
        # 0 where attended, -30 at padding: a moderate value keeps the scores' int8
        # range fine (a -1e9 bias would take all of it).
        bias = (ids.astype(jnp.float32) - 1.0)[:, None, None, :] * 30.0
        h = nn.dot_product_attention(q, k, v, bias=bias)
        return nn.DenseGeneral(16, axis=(-2, -1))(h)


def test_an_integer_mask_as_an_additive_attention_bias_is_int8():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(2, 6, 16)).astype(np.float32) for _ in range(6)]
    ids = [(padded_ids(rng, (2, 6)) > 0).astype(np.int32) for _ in range(6)]
    params = BiasedAttention().init(jax.random.key(0), xs[0], ids[0])

    def fn(x, i):
        return BiasedAttention().apply(params, x, i)

    cal = qlitert.calibrate(fn, list(zip(xs[:5], ids[:5], strict=True)), strict=True)
    tfl = qlitert.export(qlitert.annotate(fn, cal), xs[5], ids[5])  # validated
    report = qlitert.inspect(tfl)
    names = report.op_names()
    assert {"CAST", "BATCH_MATMUL", "SOFTMAX", "ADD"} <= set(names), names
    assert not qlitert.check_kernels(report), qlitert.check_kernels(report)
    got = qlitert.LiteRTModel(tfl)(xs[5], ids[5])
    ref = np.asarray(fn(xs[5], ids[5]), np.float64)
    # Measured: 0.178 relative L2 error against the float model.
    assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) < 0.25


def test_a_resnet_with_relu_after_its_residual_adds_exports():
    """Flax's ImageNet ResNet ends each block with ``relu(residual + y)``: the ReLU is
    the int8 ADD's fused activation. Before, every such model failed validation (no
    tensor had the add's own parameters: the converter gives the ADD the ReLU's)."""
    model = archs.ResNet()
    x = np.random.default_rng(0).normal(size=(6, 16, 16, 3)).astype(np.float32)
    variables = archs.trained_batch_norms(model.init(jax.random.key(0), x[:1]))

    def fn(v):
        return model.apply(variables, v)

    cal = qlitert.calibrate(fn, [x[:2], x[2:4]])
    report = qlitert.inspect(qlitert.export(qlitert.annotate(fn, cal), x[:1]))  # validated
    assert_int8_kernels(report)
    names = report.op_names()
    assert names.count("ADD") == 3 and "MAXIMUM" not in names and "RELU" not in names
    got = qlitert.LiteRTModel(qlitert.export(qlitert.annotate(fn, cal), x[4:5]))(x[4:5])
    want = np.asarray(fn(x[4:5]))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.1

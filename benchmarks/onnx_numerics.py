"""The measurements behind qort's numerics decisions (docs/design.md, "Decisions in qort").

1. ONNX Runtime's ``MatMulInteger`` on random int8 codes, (4096, 384) x (384, 1536),
   for each operand type pair: the largest difference from the exact int32 product
   (uint8 x int8 saturates 16-bit pair sums on x86 CPUs without VNNI) and the
   median time of 7 calls.
2. qcore's per-row int8 scale of random (4096, 384) activations against a true
   division ``bound / 127.5`` and against ``bound * fl(1 / 127.5)``: rows whose scale
   differs.
3. The activation codes of four ONNX formulations against qcore's on the same
   activations: a blocked ``QuantizeLinear`` dividing by the scale, the same after
   ``x * (1 / scale)``, and qort's (with its tie-rule step), counting codes that differ.

Writes ``results/onnx_numerics.json`` and prints it. Run: ``python
benchmarks/onnx_numerics.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from ops import publish, run_info

import qcore
import qort

HERE = Path(__file__).resolve().parent
M, K, N = 4096, 384, 1536


def _session(nodes: list, inputs: list, outputs: list, inits: list) -> Any:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    options = qort.session.session_options(2)
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def matmul_integer(rng: np.random.Generator) -> list[dict[str, Any]]:
    a = rng.integers(-128, 128, (M, K))
    b = rng.integers(-128, 128, (K, N))
    exact = a @ b
    rows = []
    for a_type, b_type in [
        ("int8", "int8"),
        ("int8", "uint8"),
        ("uint8", "int8"),
        ("uint8", "uint8"),
    ]:
        shift_a, shift_b = (128 if t == "uint8" else 0 for t in (a_type, b_type))
        inits = [numpy_helper.from_array((b + shift_b).astype(b_type), "B")]
        ins = ["A", "B", "", ""]
        if shift_a:
            inits.append(numpy_helper.from_array(np.array(128, np.uint8), "za"))
            ins[2] = "za"
        if shift_b:
            inits.append(numpy_helper.from_array(np.array(128, np.uint8), "zb"))
            ins[3] = "zb"
        while ins[-1] == "":
            ins.pop()
        kind = TensorProto.UINT8 if shift_a else TensorProto.INT8
        session = _session(
            [helper.make_node("MatMulInteger", ins, ["Y"])],
            [helper.make_tensor_value_info("A", kind, [M, K])],
            [helper.make_tensor_value_info("Y", TensorProto.INT32, [M, N])],
            inits,
        )
        feed = {"A": (a + shift_a).astype(a_type)}
        got = session.run(None, feed)[0]
        times = []
        for _ in range(7):
            start = time.perf_counter()
            session.run(None, feed)
            times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times)
        rows.append(
            {
                "a": a_type,
                "b": b_type,
                "max_abs_error": int(np.max(np.abs(got.astype(np.int64) - exact))),
                "ms": ms,
                "gop_per_s": 2 * M * K * N / ms / 1e6,
            }
        )
    return rows


def scales_and_codes(rng: np.random.Generator) -> dict[str, Any]:
    x = (rng.standard_normal((M, K)) * rng.uniform(0.1, 3, (M, 1))).astype(np.float32)
    q = qcore.quantize(jnp.asarray(x), qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,)))
    scale = np.asarray(q.scale)[:, 0]
    bound = np.abs(x).max(1)
    codes = np.asarray(q.qvalue).astype(np.int32) + 128
    c = {
        "one": np.float32(1),
        "zp": np.uint8(128),
        "zp_rows": np.full((M, 1), 128, np.uint8),
        "axis": np.array([1], np.int64),
        "recip": np.float32(1 / 127.5),
        "d": np.float32(127.5),
    }
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in c.items()]
    io = (
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
        [helper.make_tensor_value_info("q", TensorProto.UINT8, [M, K])],
    )
    bound_nodes = [
        helper.make_node("Abs", ["x"], ["a"]),
        helper.make_node("ReduceMax", ["a", "axis"], ["b"], keepdims=1),
    ]
    variants = {
        "QuantizeLinear blocked, scale = bound / 127.5": [
            *bound_nodes,
            helper.make_node("Div", ["b", "d"], ["s"]),
            helper.make_node("QuantizeLinear", ["x", "s", "zp_rows"], ["q"], axis=1, block_size=K),
        ],
        "QuantizeLinear blocked, scale = bound * fl(1/127.5)": [
            *bound_nodes,
            helper.make_node("Mul", ["b", "recip"], ["s"]),
            helper.make_node("QuantizeLinear", ["x", "s", "zp_rows"], ["q"], axis=1, block_size=K),
        ],
        "x * fl(1/scale), then QuantizeLinear (no tie-rule step)": [
            *bound_nodes,
            helper.make_node("Mul", ["b", "recip"], ["s"]),
            helper.make_node("Reciprocal", ["s"], ["r"]),
            helper.make_node("Mul", ["x", "r"], ["v"]),
            helper.make_node("QuantizeLinear", ["v", "one", "zp"], ["q"]),
        ],
    }
    result: dict[str, Any] = {
        "rows": M,
        "scale_differs_from_true_division": int(np.sum(scale != bound / np.float32(127.5))),
        "scale_differs_from_reciprocal_product": int(
            np.sum(scale != bound * np.float32(1 / 127.5))
        ),
        "codes": M * K,
    }
    for label, nodes in variants.items():
        got = _session(nodes, *io, inits).run(None, {"x": x})[0].astype(np.int32)
        result[label] = int(np.sum(got != codes))
    result["qort's export (with the tie-rule step)"] = qort_codes_differ(x, codes)
    return result


def qort_codes_differ(x: np.ndarray, codes: np.ndarray) -> int:
    """qort's exported w8a8 codes (the integer product's operand) that differ from qcore's."""
    import flax.linen as nn  # noqa: PLC0415
    import jax  # noqa: PLC0415

    import qflax  # noqa: PLC0415

    rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
    model = qflax.quantize_model(nn.Dense(8), qflax.PtqProvider(rules))
    variables = model.init(jax.random.key(0), x)
    exported = qort.export(model, variables, x, input_names=["x"])
    # The codes are the first operand of the one integer product.
    (product,) = [n for n in exported.model.graph.node if n.op_type == "MatMulIntegerToFloat"]
    graph = helper.make_graph(
        list(exported.model.graph.node),
        "g",
        list(exported.model.graph.input),
        [helper.make_tensor_value_info(product.input[0], TensorProto.UINT8, [M, K])],
        list(exported.model.graph.initializer),
    )
    model_proto = helper.make_model(graph, opset_imports=exported.model.opset_import)
    model_proto.ir_version = exported.model.ir_version
    options = qort.session.session_options(2)
    session = ort.InferenceSession(
        model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    got = session.run(None, {"x": x})[0].astype(np.int32)
    return int(np.sum(got != codes))


def main() -> int:
    """Runs the three measurements and writes the JSON."""
    info = run_info(7, onnxruntime=ort.__version__)
    rng = np.random.default_rng(0)
    data = {
        "machine": info,
        "matmul_integer": matmul_integer(rng),
        "quantize": scales_and_codes(rng),
    }
    print(json.dumps({k: v for k, v in data.items() if k != "machine"}, indent=1))
    publish("onnx_numerics", data, HERE / "results" / "onnx_numerics.json", readme=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

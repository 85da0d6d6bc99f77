"""The measurements behind qort's QDQ-format choices (docs/design.md, "Decisions in qort").

Small hand-built ONNX graphs in the QDQ format, each run by ONNX Runtime with all
graph optimizations (what it fuses the product into) and without any (the float
reference of the same graph):

1. Saturation: ``Conv`` (1, 8, 10, 10) x (16, 8, 3, 3) and ``MatMul`` (32, 64) x
   (64, 16) fed uint8 activations all 255, with int8 weights stored as int8 or as
   uint8 ``code + 128`` (zero point 128), per tensor and per channel, with and
   without a ``QuantizeLinear`` after the product: the fused op and its largest
   difference from the unoptimized graph.
2. Fusion forms: a ``Conv`` / 2-D ``MatMul`` with an int32 bias added by an ``Add``
   or given as the op's input, ``Max(x, 0)`` or ``Relu`` before the output's
   ``QuantizeLinear``, and a narrow int8 input with a ``Clip`` of its codes stored as
   int8 or as uint8: whether ONNX Runtime fuses the product.
3. XLA's ``x / scale``: how many of 10^6 random float32 quotients ``jax.jit``
   rounds to another integer than a true division, and than ``x * fl(1/scale)``.

Writes ``results/qdq_fusion.json`` and prints it. Run: ``python
benchmarks/qdq_fusion.py`` (seconds).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from ops import publish, run_info

HERE = Path(__file__).resolve().parent
PRODUCTS = {"Conv", "MatMul", "Gemm"}


def _model(nodes: list, x_shape: tuple, inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> tuple[list[str], float]:
    """(ops of ONNX Runtime's optimized graph but Q/DQ, max |optimized - unoptimized|)."""
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = os.path.join(tmp, "opt.onnx")
        fused = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        ops = [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]
    plain = ort.SessionOptions()
    plain.log_severity_level = 3
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(model.SerializeToString(), plain, providers=["CPUExecutionProvider"])
    err = float(np.max(np.abs(fused.run(None, {"x": x})[0] - ref.run(None, {"x": x})[0])))
    return [o for o in ops if o not in ("QuantizeLinear", "DequantizeLinear")], err


def _layer(
    rng: np.random.Generator,
    op: str,
    *,
    weights: str = "uint8",
    per_channel: bool = True,
    act: str = "uint8",
    act_clip: bool = False,
    bias: str = "none",
    relu: str = "",
    out_q: bool = True,
) -> tuple[onnx.ModelProto, tuple]:
    """One quantized layer in the QDQ format (see the module docstring)."""
    if op == "Conv":
        w = rng.integers(-127, 128, (16, 8, 3, 3)).astype(np.int8)
        w[:, :, 0, :2] = 127  # adjacent large products: the worst case for 16-bit sums
        x_shape, axis, bshape = (1, 8, 10, 10), 0, [1, 16, 1, 1]
    else:
        w = rng.integers(-127, 128, (64, 16)).astype(np.int8)
        w[0::2] = 127
        x_shape, axis, bshape = (32, 64), 1, [1, 16]
    sw = np.linspace(0.01, 0.02, 16).astype(np.float32) if per_channel else np.float32(0.01)
    if weights == "uint8":
        wc, zw = (w.astype(np.int16) + 128).astype(np.uint8), np.full(np.shape(sw), 128, np.uint8)
    else:
        wc, zw = w, np.zeros(np.shape(sw), np.int8)
    sx = np.float32(1 / 255 if act == "uint8" else 1 / 127)
    # int8 codes as they are, or stored as uint8 code + 128 (zero point 128).
    zx = {"uint8": np.uint8(0), "int8": np.int8(0), "int8_as_uint8": np.uint8(128)}[act]
    lo, hi = (
        (np.uint8(1), np.uint8(255)) if act == "int8_as_uint8" else (np.int8(-127), np.int8(127))
    )
    inits: dict[str, Any] = {"wc": wc, "sw": sw, "zw": zw, "sx": sx, "zx": zx}
    inits |= {"sy": np.float32(0.05), "zy": np.uint8(0)}
    inits |= {"lo": lo, "hi": hi, "bshape": np.array(bshape, np.int64)}
    inits |= {"b": rng.integers(-1000, 1000, 16).astype(np.int32), "zb": np.zeros(16, np.int32)}
    inits["sb"] = (sx * np.broadcast_to(sw, (16,))).astype(np.float32)
    dq_axis = {"axis": axis} if per_channel else {}
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"])]
    if act_clip:
        nodes.append(helper.make_node("Clip", ["xq", "lo", "hi"], ["xc"]))
    nodes += [
        helper.make_node("DequantizeLinear", ["xc" if act_clip else "xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wc", "sw", "zw"], ["wd"], **dq_axis),
        helper.make_node("DequantizeLinear", ["b", "sb", "zb"], ["bd"], axis=0),
    ]
    if bias == "input":
        nodes.append(
            helper.make_node("Conv" if op == "Conv" else "Gemm", ["xd", "wd", "bd"], ["y0"])
        )
    else:
        nodes.append(helper.make_node(op, ["xd", "wd"], ["p" if bias == "add" else "y0"]))
        if bias == "add":
            nodes.append(helper.make_node("Reshape", ["bd", "bshape"], ["br"]))
            nodes.append(helper.make_node("Add", ["p", "br"], ["y0"]))
    last = "y0"
    if relu == "Relu":
        nodes.append(helper.make_node("Relu", ["y0"], ["y1"]))
        last = "y1"
    elif relu == "Max":
        inits["zero"] = np.float32(0)
        nodes.append(helper.make_node("Max", ["y0", "zero"], ["y1"]))
        last = "y1"
    if out_q:
        nodes.append(helper.make_node("QuantizeLinear", [last, "sy", "zy"], ["yq"]))
        nodes.append(helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    return _model(nodes, x_shape, inits), x_shape


def saturation(rng: np.random.Generator) -> list[dict[str, Any]]:
    rows = []
    for op in ("Conv", "MatMul"):
        for weights in ("int8", "uint8"):
            for per_channel in (False, True):
                for out_q in (True, False):
                    model, shape = _layer(
                        rng, op, weights=weights, per_channel=per_channel, out_q=out_q
                    )
                    ops, err = _run(model, np.ones(shape, np.float32))  # codes 255
                    rows.append(
                        {"op": op, "weights": weights, "per_channel": per_channel,
                         "output": "quantized" if out_q else "float", "fused_ops": ops,
                         "max_error": err}
                    )  # fmt: skip
    return rows


def forms(rng: np.random.Generator) -> list[dict[str, Any]]:
    cases = [
        {"bias": "add", "relu": "Relu"},
        {"bias": "input", "relu": "Relu"},
        {"bias": "input", "relu": "Max"},
        {"bias": "input", "relu": "Relu", "act": "int8", "act_clip": True},
        {"bias": "input", "relu": "Relu", "act": "int8_as_uint8", "act_clip": True},
    ]
    rows = []
    for op in ("Conv", "MatMul"):
        for case in cases:
            model, shape = _layer(rng, op, **case)  # type: ignore[arg-type]
            ops, err = _run(model, rng.uniform(-1, 1, shape).astype(np.float32))
            fused = not PRODUCTS & set(ops)
            rows.append({"op": op, **case, "fused_ops": ops, "fused": fused, "max_error": err})
    return rows


def xla_division() -> dict[str, int]:
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 10, 10**6).astype(np.float32)
    s = np.float32(0.0371)
    true = np.round(x / s)
    recip = np.round(x * (np.float32(1) / s))
    jitted = np.asarray(jax.jit(lambda x: jnp.round(x / s))(x))
    return {
        "values": int(x.size),
        "jit_vs_true_division": int(np.sum(jitted != true)),
        "jit_vs_reciprocal_product": int(np.sum(jitted != recip)),
    }


def main() -> int:
    """Runs the measurements and writes the JSON."""
    info = run_info(1, onnxruntime=ort.__version__)
    rng = np.random.default_rng(0)
    data = {
        "machine": info,
        "saturation": saturation(rng),
        "fusion_forms": forms(rng),
        "xla_division": xla_division(),
    }
    print(json.dumps({k: v for k, v in data.items() if k != "machine"}, indent=1))
    publish("qdq_fusion", data, HERE / "results" / "qdq_fusion.json", readme=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

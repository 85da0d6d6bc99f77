"""Where ONNX Runtime spends a MiniLM batch: kernel time per operator type.

``onnx_export.py`` times whole batches; this script says what the time is made of,
from ONNX Runtime's own profiler (``SessionOptions.enable_profiling``), for:

* **ORT float**: the float model exported by ``qort.export``;
* **qort w8a8** and **qort w8a8 SmoothQuant** (alpha 0.5, scales carried): the
  rules and calibration of ``onnx_export.py``;
* with ``--peer DIR``, ONNX Runtime's fused BERT files made by ``onnx_peer.py``
  (torch export, ``onnxruntime.transformers.optimizer``, and its per-channel int8).

Each file runs ``--reps`` times on one batch of 32 x 128 tokens (2 intra-op threads)
after warm-up, in interleaved rounds that call every file once. A row is an operator
type, a column a file, and a cell the median over the calls of that type's summed
kernel time per call (ms).
``kernels`` is the sum of every type, ``wall`` the median time of ``run()`` itself,
as the profiler records it (the difference is ONNX Runtime's scheduling and copies).
Types under 1 ms in every file are summed into ``other``.

Run: ``python benchmarks/onnx_profile.py [--peer DIR] [--readme]`` (``nox -s bench``
runs it after ``onnx_export.py``).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from minilm_model import MiniLM
from onnx_export import (
    BATCH,
    PEER_FILES,
    THREADS,
    W8A8,
    check_peer,
    minilm_inputs,
    qflax_params,
    rules,
)
from ops import measured_on, publish, replace_section, run_info

import qflax
import qort
from qflax.smoothquant import smoothquant

HERE = Path(__file__).resolve().parent
MIN_MS = 1.0


def profile(
    paths: dict[str, Path], feeds: dict[str, np.ndarray], reps: int, warmup: int
) -> dict[str, dict[str, Any]]:
    """Per file: median kernel ms per operator type, and the median wall ms, of ``reps``
    calls made in interleaved rounds (each round calls every file once)."""
    import onnxruntime as ort  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        sessions, inputs = {}, {}
        for k, (name, path) in enumerate(paths.items()):
            options = ort.SessionOptions()
            options.intra_op_num_threads = THREADS
            options.inter_op_num_threads = 1
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(tmp) / f"profile{k}")
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            types = [i.type for i in session.get_inputs()]
            inputs[name] = {
                i.name: v.astype(np.int64 if t == "tensor(int64)" else np.int32)
                for i, t, v in zip(session.get_inputs(), types, feeds.values(), strict=True)
            }
            sessions[name] = session
        for _ in range(warmup + reps):
            for name, session in sessions.items():
                session.run(None, inputs[name])
        events = {
            name: json.loads(Path(s.end_profiling()).read_text()) for name, s in sessions.items()
        }
    return {name: kernel_times(e, warmup) for name, e in events.items()}


def kernel_times(events: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Medians over the profiled calls after ``warmup``: per operator type, all, wall."""
    runs = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "Session" and e.get("name") == "model_run"
    )[warmup:]
    per_call: list[collections.Counter] = [collections.Counter() for _ in runs]
    starts = [r[0] for r in runs]
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        i = int(np.searchsorted(starts, e["ts"], side="right")) - 1
        if i >= 0 and e["ts"] <= runs[i][1]:
            per_call[i][e["args"]["op_name"]] += e["dur"] / 1e3
    op_types = sorted({op for c in per_call for op in c})
    return {
        "ops": {op: statistics.median(c[op] for c in per_call) for op in op_types},
        "kernels": statistics.median(sum(c.values()) for c in per_call),
        "wall": statistics.median((b - a) / 1e3 for a, b in runs),
    }


def main(argv: list[str] | None = None) -> int:
    """Exports, profiles and prints the table; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="profiled calls per file (>= 21)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peer", type=Path, metavar="DIR", help="add onnx_peer.py's files")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "onnx_profile.json")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    parser.add_argument("--quick", action="store_true", help="3 calls per file, no README")
    args = parser.parse_args(argv)
    if args.peer is not None:
        check_peer(parser, args.peer)
    if args.quick:
        args.reps, args.warmup, args.readme = 3, 1, False
    elif args.reps < 21:
        parser.error(f"--reps must be >= 21, got {args.reps}")
    import onnxruntime  # noqa: PLC0415

    info = run_info(
        args.reps, qort=qort.__version__, onnxruntime=onnxruntime.__version__, threads=THREADS
    )
    # onnx_export.py's default draw: its first batch, calibrated on the same sentences.
    params, ids, mask, calibration = minilm_inputs(512)
    ids, mask = ids[:BATCH], mask[:BATCH]
    example = (jnp.asarray(ids), jnp.asarray(mask))
    qmodel, qp = qflax_params(rules(**W8A8), params, *example)
    data = qflax.CalibrationData(MiniLM(), params, calibration)
    smodel = qflax.quantize_model(MiniLM(), qflax.PtqProvider(rules(**W8A8)))
    sparams = smoothquant(data, rules(**W8A8), alpha=0.5, progress=False)
    models = {
        "ORT float": (MiniLM(), params),
        "qort w8a8": (qmodel, qp),
        "qort w8a8 SmoothQuant": (smodel, sparams),
    }
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for name, (model, p) in models.items():
            exported = qort.export(model, {"params": p}, *example, input_names=["ids", "mask"])
            files[name] = exported.save(Path(tmp) / f"{name.replace(' ', '_')}.onnx")
        if args.peer is not None:
            files |= {name: args.peer / file for name, file in PEER_FILES.items()}
        result = profile(files, {"ids": ids, "mask": mask}, args.reps, args.warmup)
    for name, r in result.items():
        print(name, round(r["wall"], 1), flush=True)
    out = {"machine": info, "files": result}
    publish("onnx_profile", out, args.out, args.readme, update_readme)
    print(report(out))
    return 0


def report(data: dict[str, Any]) -> str:
    """The README section: machine, settings and the table."""
    m, files = data["machine"], data["files"]
    names = list(files)
    ops = sorted(
        {op for f in files.values() for op, ms in f["ops"].items() if ms >= MIN_MS},
        key=lambda op: -max(f["ops"].get(op, 0.0) for f in files.values()),
    )
    lines = [
        measured_on(m, f"qort {m['qort']}, onnxruntime {m['onnxruntime']}")
        + f" ONNX Runtime's profiler, {m['threads']} intra-op threads, one batch of"
        f" {BATCH} × 128 tokens; each cell is the median over {m['reps']} calls of an"
        " operator type's kernel time per call (ms).",
        "",
        "| operator type | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]

    def cell(ms: float | None) -> str:
        return "-" if ms is None else f"{ms:.1f}"

    for op in ops:
        lines.append(f"| {op} | " + " | ".join(cell(files[n]["ops"].get(op)) for n in names) + " |")
    other = [sum(ms for op, ms in files[n]["ops"].items() if op not in ops) for n in names]
    lines.append("| other | " + " | ".join(cell(o) for o in other) + " |")
    lines.append("| **kernels** | " + " | ".join(cell(files[n]["kernels"]) for n in names) + " |")
    lines.append("| **wall** | " + " | ".join(cell(files[n]["wall"]) for n in names) + " |")
    return "\n".join(lines)


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the onnx_profile section of benchmarks/README.md."""
    replace_section(path, "onnx_profile", report(data))


if __name__ == "__main__":
    raise SystemExit(main())

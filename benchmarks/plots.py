"""Charts of the benchmark results, drawn from ``benchmarks/results/<name>.json``.

Each benchmark script calls :func:`save` with its results when run with
``--readme``, so the charts in ``benchmarks/plots/`` always show the same run as
the tables in ``benchmarks/README.md``. ``python benchmarks/plots.py`` redraws every
chart from the JSON files alone.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

from qcore.files import write_atomic  # noqa: E402

HERE = Path(__file__).resolve().parent
PLOTS = HERE / "plots"
OURS, QWIX, FLOAT = "tab:blue", "tab:orange", "tab:gray"


def _color(label: str) -> str:
    low = label.lower()
    if "qwix" in low:
        return QWIX
    if low.startswith(("fp32", "bf16", "float", "read only", "one pass")):
        return FLOAT
    return OURS


def _subtitle(data: dict[str, Any]) -> str:
    m = data["machine"]
    return f"{m['date']}, {m['cpu']} ({m['cores']} cores), jax {m['jax']}"


def _bars(ax: Any, labels: list[str], values: list[float], fmt: str) -> None:
    """Horizontal bars, first label on top, each bar annotated."""
    y = list(range(len(labels)))[::-1]
    ax.barh(y, values, color=[_color(label) for label in labels])
    ax.set_yticks(y, labels)
    for yi, v in zip(y, values, strict=True):
        ax.annotate(
            fmt.format(v),
            (v, yi),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )


def ops(data: dict[str, Any]) -> Any:
    """Speed-up over fp32 of every op configuration, one panel per case."""
    cases = list(dict.fromkeys(r["case"] for r in data["rows"]))
    fig, axes = plt.subplots(len(cases), 1, figsize=(8, 2.2 * len(cases)), squeeze=False)
    for ax, case in zip(axes[:, 0], cases, strict=True):
        rows = [r for r in data["rows"] if r["case"] == case]
        _bars(ax, [r["impl"] for r in rows], [r["speedup_vs_fp32"] for r in rows], "{:.2f}×")
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(case, fontsize=9)
    axes[-1, 0].set_xlabel("speed-up over fp32 (median time; higher is faster)")
    fig.suptitle(f"Quantized ops — {_subtitle(data)}", fontsize=10)
    return fig


def flax_ptq(data: dict[str, Any]) -> Any:
    """Milliseconds per call of the Dense stack per configuration and batch."""
    batches = list(dict.fromkeys(r["batch"] for r in data["rows"]))
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.5), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        rows = [r for r in data["rows"] if r["batch"] == batch]
        _bars(ax, [r["config"] for r in rows], [r["median_ms"] for r in rows], "{:.1f}")
        ax.set_title(f"batch {batch}", fontsize=9)
        ax.set_xlabel("median ms per call (lower is faster)")
    fig.suptitle(f"4 × Dense(4096), qflax vs Qwix — {_subtitle(data)}", fontsize=10)
    return fig


def litert(data: dict[str, Any]) -> Any:
    """File size and interpreter latency (1 and 2 threads) of every ``.tflite`` file."""
    rows = [r for r in data["rows"] if "error" not in r and "latency" in r]
    fig, axes = plt.subplots(1, 3, figsize=(13, 0.32 * len(rows) + 1.4), sharey=True)
    labels = [f"{r['model']}: {r['type']}" for r in rows]
    colors = [
        FLOAT if r["type"] == "float32" else QWIX if "ai-edge" in r["type"] else OURS for r in rows
    ]
    panels = (
        (axes[0], lambda r: r["bytes"] / 1024, "file KiB", "{:,.0f}"),
        (axes[1], lambda r: r["latency"]["1"]["median_ms"], "ms, 1 thread (median)", "{:.3f}"),
        (axes[2], lambda r: r["latency"]["2"]["median_ms"], "ms, 2 threads (median)", "{:.3f}"),
    )
    for ax, value, title, fmt in panels:
        _bars(ax, labels, [value(r) for r in rows], fmt)
        for patch, color in zip(ax.patches, colors, strict=True):
            patch.set_color(color)
        ax.set_xscale("log")
        ax.set_xlabel(title)
    fig.suptitle(
        f"LiteRT float vs quantized (qlitert, ai-edge-quantizer) — {_subtitle(data)}", fontsize=10
    )
    return fig


def minilm(data: dict[str, Any]) -> Any:
    """Embedding quality of every MiniLM configuration, labelled with its total size."""
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.2))
    labels = [
        f"{r['config']} ({'float' if r['library'] == '-' else r['library']}), "
        f"{r['total_bytes'] / 2**20:.1f} MiB"
        for r in rows
    ]
    _bars(ax, labels, [r["mean_cos"] for r in rows], "{:.4f}")
    low = min(r["mean_cos"] for r in rows)
    ax.set_xlim(low - (1 - low) * 0.1, 1 + (1 - low) * 0.15)
    ax.set_xlabel("mean cosine to the float embeddings (total params MiB in the label)")
    fig.suptitle(f"all-MiniLM-L6-v2, qflax vs Qwix — {_subtitle(data)}", fontsize=10)
    return fig


def quantize_params(data: dict[str, Any]) -> Any:
    """GB/s of float input of every quantize_params row, with the issue's target."""
    fig, ax = plt.subplots(figsize=(8, 2.8))
    rows = data["rows"]
    _bars(ax, [r["config"] for r in rows], [r["gb_per_s"] for r in rows], "{:.1f}")
    ax.axvline(data["target_gb_per_s"], color="red", lw=1, ls="--", label="target")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel(f"GB/s of float input ({data['shapes']}, per-channel int8)")
    fig.suptitle(f"quantize_params throughput — {_subtitle(data)}", fontsize=10)
    return fig


def compile_cost(data: dict[str, Any]) -> Any:
    """Compile time and batch-1 step time of every config as a ratio to float."""
    rows = [r for r in data["rows"] if "error" not in r and r["config"] != "float"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.3 * len(rows) + 1.4), sharey=True)
    labels = [f"{r['model']}: {r['config']}" for r in rows]
    for ax, key, title, target in (
        (axes[0], "compile_ratio", "compile time (trace+lower+compile) vs float", 2.0),
        (axes[1], "step_ratio", "batch-1 step time vs float", 1.0),
    ):
        _bars(ax, labels, [r[key]["median"] for r in rows], "{:.2f}×")
        ax.axvline(target, color="red", lw=1, ls="--")
        ax.set_xlabel(title)
    fig.suptitle(f"Cost of quantized models — {_subtitle(data)}", fontsize=10)
    return fig


def onnx(data: dict[str, Any]) -> Any:
    """MiniLM latency on ONNX Runtime of every configuration, labelled with its quality."""
    rows = data["minilm"]
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.2))
    labels = [f"{r['config']} (cos {r['mean_cos']:.4f})" for r in rows]
    _bars(ax, labels, [r["ms"] for r in rows], "{:.0f}")
    ax.set_xlabel("ms per batch of 32 x 128 tokens (median)")
    fig.suptitle(f"all-MiniLM-L6-v2 on ONNX Runtime — {_subtitle(data)}", fontsize=10)
    return fig


CHARTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "compile_cost": compile_cost,
    "ops": ops,
    "flax_ptq": flax_ptq,
    "litert": litert,
    "minilm": minilm,
    "onnx": onnx,
    "quantize_params": quantize_params,
}


def save(name: str, data: dict[str, Any]) -> Path:
    """Draws chart ``name`` from ``data`` into ``benchmarks/plots/<name>.png``."""
    fig = CHARTS[name](data)
    fig.tight_layout()
    PLOTS.mkdir(exist_ok=True)
    path = PLOTS / f"{name}.png"
    write_atomic(path, lambda p: fig.savefig(p, format="png", dpi=110))
    plt.close(fig)
    return path


def main() -> int:
    """Redraws every chart whose results JSON exists."""
    for name in CHARTS:
        results = HERE / "results" / f"{name}.json"
        if results.exists():
            print(save(name, json.loads(results.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

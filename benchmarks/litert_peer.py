"""The peer of qlitert in litert.py: Google's ai-edge-quantizer on the same float ``.tflite``.

Reads ``DIR/manifest.json`` written by ``litert.py --export-for-peer DIR``; for each
model, quantizes its float ``.tflite`` with ai-edge-quantizer's ``static_wi8_ai8``
recipe (int8 weights, one scale per output channel; int8 activations from min/max
calibration), calibrated on the model's calibration inputs (``DIR/<model>.calibration.npz``,
the samples qlitert calibrates on, fed one by one: the files take batch 1), and
writes ``DIR/<model>.peer.tflite``. ``DIR/peer.json`` holds the versions (the
quantizer's, its LiteRT's, Python's), the quantization time of each model and any
error's text.

Runs in its own environment (``nox -s litert_peer``): it needs no JAX and none of
this repository's packages, only ``ai-edge-quantizer`` and what it pulls in.
"""

from __future__ import annotations

import json
import platform
import sys
import time
import traceback
from importlib.metadata import version
from pathlib import Path

import numpy as np
from ai_edge_litert.interpreter import Interpreter
from ai_edge_quantizer import quantizer, recipe

RECIPE = "static_wi8_ai8"


def quantize(float_tflite: bytes, calibration: dict[str, np.ndarray]) -> bytes:
    """The peer's int8 model of ``float_tflite``, calibrated on ``calibration``'s samples."""
    ((key, signature),) = Interpreter(model_content=float_tflite).get_signature_list().items()
    names = signature["inputs"]
    if sorted(names) != sorted(calibration):
        raise ValueError(f"signature inputs {names}, calibration arrays {sorted(calibration)}")
    count = len(calibration[names[0]])
    samples = [{n: calibration[n][i : i + 1] for n in names} for i in range(count)]
    qt = quantizer.Quantizer(float_tflite)
    qt.load_quantization_recipe(getattr(recipe, RECIPE)())
    result = qt.quantize(
        qt.calibrate({key: samples}), enable_progress_bar=False, enable_progress_report=False
    )
    if result.quantized_model is None:
        raise RuntimeError("ai-edge-quantizer returned no model")
    return bytes(result.quantized_model)


def main(argv: list[str]) -> int:
    """Quantizes every model of DIR (argv[0]); returns the exit code."""
    if len(argv) != 1:
        print(f"usage: {Path(sys.argv[0]).name} DIR", file=sys.stderr)
        return 2
    root = Path(argv[0])
    manifest = json.loads((root / "manifest.json").read_text())["models"]
    info: dict = {
        "recipe": RECIPE,
        "versions": {
            "ai-edge-quantizer": version("ai-edge-quantizer"),
            "ai-edge-litert": version("ai-edge-litert"),
            "numpy": version("numpy"),
            "python": platform.python_version(),
        },
        "models": {},
    }
    print(json.dumps(info["versions"]), flush=True)
    for entry in manifest:
        slug = entry["slug"]
        float_tflite = (root / entry["files"]["float32"]).read_bytes()
        with np.load(root / entry["calibration"]) as npz:
            calibration = {k: npz[k] for k in npz.files}
        t0 = time.perf_counter()
        try:
            peer = quantize(float_tflite, calibration)
        except Exception as err:  # noqa: BLE001 - recorded for the table
            traceback.print_exc()
            info["models"][slug] = {"error": f"{type(err).__name__}: {err}"}
            continue
        secs = time.perf_counter() - t0
        (root / f"{slug}.peer.tflite").write_bytes(peer)
        info["models"][slug] = {"file": f"{slug}.peer.tflite", "quantize_s": secs}
        print(f"  {entry['name']}: {len(float_tflite):,} -> {len(peer):,} B, {secs:.2f} s")
    (root / "peer.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

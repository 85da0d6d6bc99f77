"""The peer of qlitert in litert.py: Google's ai-edge-quantizer on the same float ``.tflite``.

Reads ``DIR/manifest.json`` written by ``litert.py --export-for-peer DIR``; for each
model, applies each of its ``peer_recipes`` (names of ai-edge-quantizer's recipe
functions) to its float ``.tflite`` and writes ``DIR/<model>.peer.<recipe>.tflite``:

* ``static_wi8_ai8``: int8 weights, one scale per output channel; int8 activations
  from min/max calibration;
* ``static_wi8_ai16``: the same with int16 activations;
* ``dynamic_wi8_afp32``: int8 weights per channel, float activations quantized when
  the ops run (LiteRT's hybrid kernels); no calibration.

The static recipes are calibrated on the model's calibration inputs
(``DIR/<model>.calibration.npz``: one array per signature input, by name, holding
the samples qlitert calibrates on), fed one by one (the files take batch 1).
``DIR/peer.json`` holds the versions (the quantizer's, its LiteRT's, Python's), and
per model and recipe the file and its quantization time, or the error's text.

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


def quantize(float_tflite: bytes, recipe_name: str, calibration: dict[str, np.ndarray]) -> bytes:
    """The peer's ``recipe_name`` model of ``float_tflite`` (static ones calibrated)."""
    qt = quantizer.Quantizer(float_tflite)
    qt.load_quantization_recipe(getattr(recipe, recipe_name)())
    calibrated = None
    if qt.need_calibration:
        ((key, signature),) = Interpreter(model_content=float_tflite).get_signature_list().items()
        names = signature["inputs"]
        if sorted(names) != sorted(calibration):
            raise ValueError(f"signature inputs {names}, calibration arrays {sorted(calibration)}")
        count = len(calibration[names[0]])
        samples = [{n: calibration[n][i : i + 1] for n in names} for i in range(count)]
        calibrated = qt.calibrate({key: samples})
    result = qt.quantize(calibrated, enable_progress_bar=False, enable_progress_report=False)
    if result.quantized_model is None:
        raise RuntimeError("ai-edge-quantizer returned no model")
    return bytes(result.quantized_model)


def main(argv: list[str]) -> int:
    """Quantizes every model of DIR (argv[0]) with its recipes; returns the exit code."""
    if len(argv) != 1:
        print(f"usage: {Path(sys.argv[0]).name} DIR", file=sys.stderr)
        return 2
    root = Path(argv[0])
    manifest = json.loads((root / "manifest.json").read_text())["models"]
    info: dict = {
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
        done = info["models"][slug] = {}
        for name in entry["peer_recipes"]:
            t0 = time.perf_counter()
            try:
                peer = quantize(float_tflite, name, calibration)
            except Exception as err:  # noqa: BLE001 - recorded for the table
                traceback.print_exc()
                done[name] = {"error": f"{type(err).__name__}: {err}"}
                print(f"  {entry['name']} {name}: failed: {done[name]['error']}", flush=True)
                continue
            secs = time.perf_counter() - t0
            file = f"{slug}.peer.{name}.tflite"
            (root / file).write_bytes(peer)
            done[name] = {"file": file, "quantize_s": secs}
            print(
                f"  {entry['name']} {name}: {len(float_tflite):,} -> {len(peer):,} B, {secs:.2f} s",
                flush=True,
            )
    (root / "peer.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The demo runs end to end in quick mode and its numbers make sense."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_qcore_tour_quick(tmp_path):
    out = tmp_path / "tour"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "qcore_tour.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(out.resolve()) in proc.stdout
    png = (out / "sqnr_vs_bytes.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    results = json.loads((out / "results.json").read_text())
    float_acc = results["float_test_accuracy"]
    assert float_acc > 0.93
    rows = {r["qtype"]: r for r in results["rows"]}
    assert set(rows) == {"int8", "int4", "nf4", "mxfp4"}
    # int8 per-channel weights keep the classifier within one point of float.
    assert rows["int8"]["test_accuracy"] >= float_acc - 0.01
    # Packed int4 codes cost half a byte per weight, plus one scale per column.
    assert rows["int4"]["bytes_per_weight"] < 0.6
    assert rows["int8"]["sqnr_db"] > rows["int4"]["sqnr_db"] > 10


def test_demo_refuses_an_out_path_that_is_a_file(tmp_path):
    target = tmp_path / "file.txt"
    target.write_text("keep me")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "qcore_tour.py"), "--quick", "--out", str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "exists and is not a directory" in proc.stderr
    assert target.read_text() == "keep me"

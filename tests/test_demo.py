"""The qcore tour runs end to end in quick mode; both examples refuse unusable --out paths."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("script", ["qcore_tour.py", "digits_end_to_end.py"])
@pytest.mark.parametrize("below", [False, True])
def test_examples_refuse_an_out_path_they_cannot_use(tmp_path, script, below):
    # --out is an existing file, or a directory that would have to be made under one:
    # exit code 2, a one-line error naming --out, and the file left as it was.
    target = tmp_path / "file.txt"
    target.write_text("keep me")
    out = target / "sub" if below else target
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    message = "cannot create --out" if below else "exists and is not a directory"
    assert f"{script}: error: " in proc.stderr and message in proc.stderr
    assert target.read_text() == "keep me"

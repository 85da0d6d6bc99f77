"""The CPU's multiply-accumulate ceilings: float32 FMAs against exact int8 arithmetic.

What limits w8a8 at batch on a CPU is its multiply-accumulate rate, not memory. This
script measures that rate for the instruction sequences a kernel would use, in
register-only loops (``cpu_peak.c``, compiled here with the system's C compiler):

* ``f32``: ``vfmadd231ps``, 8 float32 multiply-accumulates per instruction (the
  ceiling of any float32 GEMM, XLA's included);
* ``int8``: ``vpsignb`` + ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd``, 32 exact int8 ×
  int8 products added into int32 per four instructions: the inner step of qkernels'
  int8 GEMM (``packages/qkernels/src/qkernels/_int8_gemm.cc``), so its ceiling on a
  CPU without VNNI;
* ``int16``: ``vpmaddwd`` + ``vpaddd``, 16 products per two instructions, with the
  codes already widened to int16 (the alternative ``docs/design.md`` rejected).
* ``w8b1``: ``vpmovsxbd`` + ``vcvtdq2ps`` + ``vfmadd231ps``, 8 int8 codes widened,
  converted to float32 and multiply-added: the arithmetic of qkernels' batch-1
  weight-only int8 product (``_native.cc``), one multiply-accumulate per code;
* ``w4b1``: 7 ``vpslld`` + 8 ``vpsrad`` + 8 ``vcvtdq2ps`` + 8 ``vfmadd231ps`` per 32
  bytes of packed int4 codes (64 codes): the arithmetic of its batch-1 int4 product.

The two weight-only sequences load their codes from a 4 KiB buffer that stays in L1
(as the kernels load codes), so they give the rate of those kernels' arithmetic with
the weight already in cache; a chain of layers whose weights come from memory is
bounded by both that rate and the bandwidth (``decode.py``).

Each sequence runs on one core, and on every core at once (one process per core,
started together; the row gives their sum). Rounds run every sequence in turn;
medians and p10–p90 over ``--reps`` (>= 21) rounds of one call each (about 0.1 s).
The loops read no memory beyond L1, so no bandwidth limit applies; the ratio of the
int8 row to the f32 row bounds what an exact int8 GEMM can gain over a float32 GEMM that
runs as close to its own ceiling.

Run: ``nox -s bench`` (or ``python benchmarks/cpu_peak.py --help``); needs a C
compiler (``$CC``, else ``cc``) and an x86-64 CPU with AVX2 and FMA.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from ops import HERE, measured_on, publish, replace_section, run_info

SEQUENCES = {
    "f32": "vfmadd231ps (8 float32 MACs)",
    "int8": "vpsignb + vpmaddubsw + vpmaddwd + vpaddd (32 exact int8 MACs)",
    "int16": "vpmaddwd + vpaddd (16 int16 MACs)",
    "w8b1": "vpmovsxbd + vcvtdq2ps + vfmadd231ps (8 int8-code MACs)",
    "w4b1": "7 vpslld + 8 vpsrad + 8 vcvtdq2ps + 8 vfmadd231ps (64 int4-code MACs)",
}
ITERATIONS = 30_000_000  # loop trips per call: about 0.1 s for each sequence here


def build(workdir: Path) -> Path:
    """Compiles ``cpu_peak.c`` into ``workdir``; returns the executable.

    Raises:
        SystemExit: If no C compiler is found or the build fails.
    """
    cc = os.environ.get("CC") or shutil.which("cc")
    if not cc:
        raise SystemExit("cpu_peak.py needs a C compiler: set CC or install cc")
    exe = workdir / "cpu_peak"
    cmd = [cc, "-O2", str(HERE / "cpu_peak.c"), "-o", str(exe)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr}")
    return exe


def call(exe: Path, sequence: str, processes: int) -> float:
    """GMAC/s of ``processes`` concurrent runs of ``sequence``, summed."""
    runs = [
        subprocess.Popen([exe, sequence, str(ITERATIONS)], stdout=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    total = 0.0
    for run in runs:
        out, _ = run.communicate()
        if run.returncode:
            raise SystemExit(f"{exe} {sequence} exited with {run.returncode}")
        total += float(out.split()[0])
    return total / 1e9


def run(reps: int) -> list[dict[str, Any]]:
    """Times every sequence on one core and on all; returns the table's rows."""
    cores = os.cpu_count() or 1
    counts = sorted({1, cores})
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        for sequence in SEQUENCES:  # one untimed call each: page in, reach full clock
            call(exe, sequence, 1)
        rates: dict[tuple[str, int], list[float]] = {(s, c): [] for s in SEQUENCES for c in counts}
        for _ in range(reps):
            for sequence, processes in rates:
                rates[sequence, processes].append(call(exe, sequence, processes))
    rows = []
    for (sequence, processes), r in rates.items():
        med = statistics.median(r)
        rows.append(
            {
                "sequence": sequence,
                "instructions": SEQUENCES[sequence],
                "cores": processes,
                "gmac_per_s": med,
                "p10": float(np.percentile(r, 10)),
                "p90": float(np.percentile(r, 90)),
                "vs_f32": med / statistics.median(rates["f32", processes]),
            }
        )
        ratio = rows[-1]["vs_f32"]
        print(f"{sequence:6s} {processes} core(s) {med:7.1f} GMAC/s ({ratio:.2f}× f32)")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the results."""
    lines = [
        "| sequence | instructions | cores | GMAC/s | p10–p90 | vs f32 |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r["cores"], list(SEQUENCES).index(r["sequence"]))):
        lines.append(
            f"| {r['sequence']} | {r['instructions']} | {r['cores']} | {r['gmac_per_s']:.1f} | "
            f"{r['p10']:.1f}–{r['p90']:.1f} | {r['vs_f32']:.2f}× |"
        )
    return "\n".join(lines)


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the cpu-peak table of benchmarks/README.md."""
    m = data["machine"]
    body = "\n".join(
        [
            measured_on(m, f"{m['compiler']}")
            + f" Median of {m['reps']} rounds of one call per sequence and core count"
            f" ({ITERATIONS:,} loop trips per call).",
            "",
            table(data["rows"]),
        ]
    )
    replace_section(path, "cpu-peak", body)


def compiler_version() -> str:
    """The first line of ``$CC --version`` (``cc`` where CC is unset)."""
    cc = os.environ.get("CC") or shutil.which("cc") or "cc"
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown compiler"
    return out.stdout.splitlines()[0] if out.stdout else "unknown compiler"


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="timed rounds (>= 21)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "cpu_peak.json")
    parser.add_argument("--readme", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args(argv)
    if args.reps < 21:
        parser.error(f"--reps must be >= 21, got {args.reps}")
    info = run_info(args.reps, compiler=compiler_version())
    data = {"machine": info, "rows": run(args.reps)}
    print()
    print(table(data["rows"]))
    publish("cpu_peak", data, args.out, args.readme, update_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())

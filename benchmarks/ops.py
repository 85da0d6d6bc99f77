"""Speed of qcore's quantized ops against float and against Qwix, on this CPU.

Every figure is the median of ``--reps`` timed calls after warm-up, each call on
a different weight buffer from a ring of ``--ring`` buffers (so no call finds
the previous call's weights in cache), in one process. Ratios compare
configurations measured in the same run. The machine, versions, allocator
setting (``GLIBC_TUNABLES``), shapes and repetitions are printed and written to
the JSON next to the results.

Configurations (weights quantized ahead of time, activations at call time):

* ``fp32`` / ``bf16``: ``x @ w`` (``lax.conv_general_dilated``) in that dtype.
* ``int8 w-only``: int8 weights, one scale per output channel, float activations.
  ``(N,K)`` rows store the same weights output-features first, the faster layout here.
* ``int4 w-only``: int4 weights packed two per byte, one scale per output channel.
* ``w8a8``: int8 weights and int8 activations quantized per row at call time.
* ``qwix int8 w-only`` / ``qwix w8a8``: the same with Qwix 0.1.8's ``dot_general``
  (or ``conv_general_dilated``) on its own QArrays.

Run: ``nox -s bench`` (or ``python benchmarks/ops.py --help``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import plots

import qcore
from qcore.files import write_atomic

HERE = Path(__file__).resolve().parent
DOT = (((1,), (0,)), ((), ()))
CONV_DN = ("NHWC", "HWIO", "NHWC")
MATMUL_SHAPES = [(1, 4096, 4096), (8, 4096, 4096), (64, 4096, 4096)]
CONV_SHAPE = ((8, 56, 56, 64), (3, 3, 64, 64))

W8 = qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,))
W4 = qcore.HowToQuantize(qtype="int4", channelwise_axes=(1,), pack=True, pack_axis=0)
# The same weights stored (N, K), output features first (torch's layout): XLA:CPU's GEMM
# packs its right-hand operand on every call, so the kernels put the weight on the left.
W8_NK = qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,))
W4_NK = qcore.HowToQuantize(qtype="int4", channelwise_axes=(0,), pack=True, pack_axis=1)
DOT_NK = (((1,), (1,)), ((), ()))
A8 = qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,))
K8 = qcore.HowToQuantize(qtype="int8", channelwise_axes=(3,))
X8 = qcore.HowToQuantize(qtype="int8", channelwise_axes=(0,))

Impl = tuple[Callable[..., jax.Array], Callable[[jax.Array], Any]]


def matmul_impls(qwix: Any) -> dict[str, Impl]:
    """name -> (jitted fn(x, prepared_w), prepare(w_f32))."""
    impls: dict[str, Impl] = {
        "fp32": (jax.jit(lambda x, w: x @ w), lambda w: w),
        "bf16": (
            jax.jit(lambda x, w: (x.astype(jnp.bfloat16) @ w).astype(jnp.float32)),
            lambda w: w.astype(jnp.bfloat16),
        ),
        "int8 w-only": (
            jax.jit(lambda x, q: qcore.dot_general(x, q, DOT)),
            lambda w: qcore.quantize(w, W8),
        ),
        "int4 w-only": (
            jax.jit(lambda x, q: qcore.dot_general(x, q, DOT)),
            lambda w: qcore.quantize(w, W4),
        ),
        "w8a8": (
            jax.jit(lambda x, q: qcore.dot_general(qcore.quantize(x, A8), q, DOT)),
            lambda w: qcore.quantize(w, W8),
        ),
        "int8 w-only (N,K)": (
            jax.jit(lambda x, q: qcore.dot_general(x, q, DOT_NK)),
            lambda w: qcore.quantize(w.T, W8_NK),
        ),
        "int4 w-only (N,K)": (
            jax.jit(lambda x, q: qcore.dot_general(x, q, DOT_NK)),
            lambda w: qcore.quantize(w.T, W4_NK),
        ),
        "w8a8 (N,K)": (
            jax.jit(lambda x, q: qcore.dot_general(qcore.quantize(x, A8), q, DOT_NK)),
            lambda w: qcore.quantize(w.T, W8_NK),
        ),
    }
    if qwix is not None:
        impls["qwix int8 w-only"] = (
            jax.jit(lambda x, q: qwix.dot_general(x, q, DOT)),
            lambda w: qwix.quantize(w, jnp.int8, channelwise_axes=[1]),
        )
        impls["qwix w8a8"] = (
            jax.jit(
                lambda x, q: qwix.dot_general(
                    qwix.quantize(x, jnp.int8, channelwise_axes=[0]), q, DOT
                )
            ),
            lambda w: qwix.quantize(w, jnp.int8, channelwise_axes=[1]),
        )
    return impls


def conv_impls(qwix: Any) -> dict[str, Impl]:
    """The conv configurations (int4 is left out: convolutions take int8 kernels)."""

    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=CONV_DN)

    def qconv(x, k):
        return qcore.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=CONV_DN)

    impls: dict[str, Impl] = {
        "fp32": (jax.jit(conv), lambda k: k),
        "bf16": (
            jax.jit(lambda x, k: conv(x.astype(jnp.bfloat16), k).astype(jnp.float32)),
            lambda k: k.astype(jnp.bfloat16),
        ),
        "int8 w-only": (jax.jit(qconv), lambda k: qcore.quantize(k, K8)),
        "w8a8": (
            jax.jit(lambda x, k: qconv(qcore.quantize(x, X8), k)),
            lambda k: qcore.quantize(k, K8),
        ),
    }
    if qwix is not None:

        def qwix_conv(x, k):
            return qwix.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=CONV_DN)

        impls["qwix int8 w-only"] = (
            jax.jit(qwix_conv),
            lambda k: qwix.quantize(k, jnp.int8, channelwise_axes=[3]),
        )
        impls["qwix w8a8"] = (
            jax.jit(lambda x, k: qwix_conv(qwix.quantize(x, jnp.int8, channelwise_axes=[0]), k)),
            lambda k: qwix.quantize(k, jnp.int8, channelwise_axes=[3]),
        )
    return impls


def time_call(fn, x, w) -> float:
    """Milliseconds of one call."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(x, w))
    return (time.perf_counter() - t0) * 1e3


# Untimed calls before each timed call last at least this long: on this machine a
# call's time depends on what ran just before it (after a 100 ms bfloat16 call of the
# Flax stack, its int8 model's next three calls took 1.5-2x their steady time, and
# it was steady again about 30 ms after it: the `settle` section of README.md, `settle.py`).
SETTLE_MS = 100.0


def settled_call(fn, x, w, untimed: int = 3, settle_ms: float = SETTLE_MS) -> float:
    """Milliseconds of one call, after untimed calls: ``untimed`` of them and ``settle_ms``.

    The untimed calls go on until both at least ``untimed`` calls and ``settle_ms``
    milliseconds have passed, so the timed call pays neither for a cold start nor
    for what the previous configuration left behind.
    """
    end = time.perf_counter() + settle_ms / 1e3
    calls = 0
    while calls < untimed or time.perf_counter() < end:
        time_call(fn, x, w)
        calls += 1
    return time_call(fn, x, w)


def check(fn, x, w_prepared, reference: np.ndarray) -> float:
    """Relative max error against the float64 product (guards against fast-but-wrong)."""
    y = np.asarray(fn(x, w_prepared), np.float64)
    return float(np.max(np.abs(y - reference)) / np.max(np.abs(reference)))


def run_case(label, x, weights, impls, reps, warmup, reference_fn) -> list[dict[str, Any]]:
    """Times every impl on one shape; returns result rows."""
    rows = []
    ref = reference_fn(np.asarray(x, np.float64), np.asarray(weights[0], np.float64))
    rings = {name: [prepare(w) for w in weights] for name, (_, prepare) in impls.items()}
    for name, (fn, _) in impls.items():
        for i in range(warmup):
            jax.block_until_ready(fn(x, rings[name][i % len(weights)]))
    times: dict[str, list[float]] = {name: [] for name in impls}
    for i in range(reps):  # interleaved: one call of every impl per round
        for name, (fn, _) in impls.items():
            times[name].append(time_call(fn, x, rings[name][i % len(weights)]))
    for name, (fn, _) in impls.items():
        ring = rings[name]
        rows.append(
            {
                "case": label,
                "impl": name,
                "median_ms": statistics.median(times[name]),
                "p10_ms": float(np.percentile(times[name], 10)),
                "p90_ms": float(np.percentile(times[name], 90)),
                "max_rel_error": check(fn, x, ring[0], ref),
                "weight_bytes": int(sum(leaf.nbytes for leaf in jax.tree.leaves(ring[0]))),
            }
        )
        print(f"  {label:28s} {name:18s} {rows[-1]['median_ms']:9.3f} ms", flush=True)
    del rings
    fp32 = next(r["median_ms"] for r in rows if r["impl"] == "fp32")
    qwix_ms = {r["impl"].removeprefix("qwix "): r["median_ms"] for r in rows if "qwix" in r["impl"]}
    for r in rows:
        r["speedup_vs_fp32"] = fp32 / r["median_ms"]
        q = qwix_ms.get(r["impl"].removesuffix(" (N,K)"))
        r["speedup_vs_qwix"] = None if q is None or "qwix" in r["impl"] else q / r["median_ms"]
    return rows


def conv_reference(x: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Float64 SAME convolution (NHWC, HWIO) via numpy, as an independent check."""
    kh, kw = k.shape[:2]
    xp = np.pad(x, ((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)))
    out = np.zeros(x.shape[:3] + (k.shape[3],))
    for i in range(kh):
        for j in range(kw):
            out += xp[:, i : i + x.shape[1], j : j + x.shape[2], :] @ k[i, j]
    return out


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    named = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    cpu = named[0] if named else cpu
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        # The vector extensions int8 and float kernels choose between (LiteRT's XNNPACK
        # and XLA:CPU pick theirs at run time): without VNNI, int8 bytes are widened
        # to 16 bits before they are multiplied.
        "isa": [f for f in ISA_FLAGS if f in flags] or "(unknown)",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "qcore": qcore.__version__,
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", "(unset)"),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "(unset)"),
    }


def run_info(reps: int, **extra: Any) -> dict[str, Any]:
    """Prints and returns what a run is measured on: machine, date, repetitions, ``extra``."""
    info = machine() | {"date": datetime.date.today().isoformat(), "reps": reps} | extra
    print(json.dumps(info, indent=1), flush=True)
    return info


def publish(
    name: str,
    data: dict[str, Any],
    out: Path,
    readme: bool,
    update_readme: Callable[[dict[str, Any], Path], None] | None = None,
) -> None:
    """Writes the results JSON; with ``readme``, rewrites the README section and the chart
    (if ``plots`` draws one for ``name``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(data, indent=1).encode())
    print(f"\nwrote {out}")
    if readme and update_readme is not None:
        update_readme(data, HERE / "README.md")
        chart = f" and {plots.save(name, data)}" if name in plots.CHARTS else ""
        print(f"updated {HERE / 'README.md'}{chart}")


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the results; quantized configs slower than fp32 are flagged."""
    lines = [
        "| case | config | median ms (p10–p90) | vs fp32 | vs Qwix | max rel err | weight KiB "
        "| note |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        vs_q = "" if r["speedup_vs_qwix"] is None else f"{r['speedup_vs_qwix']:.1f}×"
        ours = r["impl"] not in ("fp32", "bf16") and "qwix" not in r["impl"]
        note = "slower than fp32" if ours and r["speedup_vs_fp32"] < 1 else ""
        lines.append(
            f"| {r['case']} | {r['impl']} | {r['median_ms']:.3f} ({r['p10_ms']:.3f}–"
            f"{r['p90_ms']:.3f}) | {r['speedup_vs_fp32']:.2f}× "
            f"| {vs_q} | {r['max_rel_error']:.1e} | {r['weight_bytes'] / 2**10:,.0f} | {note} |"
        )
    return "\n".join(lines)


def measured_on(m: dict[str, Any], versions: str) -> str:
    """The first sentence of every results section: date, machine, versions, allocator."""
    return (
        f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores{_isa(m)}), Python {m['python']}, "
        f"jax {m['jax']}, {versions}; GLIBC_TUNABLES {m['GLIBC_TUNABLES']}, XLA_FLAGS "
        f"{m['XLA_FLAGS']}."
    )


def _isa(m: dict[str, Any]) -> str:
    """``"; avx2, fma"``: the machine's vector extensions, where the run recorded them."""
    isa = m.get("isa")
    return f"; {', '.join(isa) if isinstance(isa, list) else isa}" if isa else ""


def report(data: dict[str, Any]) -> str:
    """The README section: machine, settings and the table."""
    m = data["machine"]
    return "\n".join(
        [
            measured_on(m, f"qcore {m['qcore']}, Qwix {m['qwix']}")
            + f" Median of {m['reps']} calls after warm-up, in rounds that call every config"
            f" of a case once (interleaved), cycling {m['ring']} distinct weight buffers; ratios"
            " are to the fp32 (or Qwix) row of the same case in the same run.",
            "",
            table(data["rows"]),
        ]
    )


def replace_section(path: Path, name: str, body: str) -> None:
    """Replaces the text between ``<!-- name:begin -->`` and ``<!-- name:end -->``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no {begin} ... {end} section to update")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    write_atomic(path, f"{head}{begin}\n{body}\n{end}{tail}".encode())


def update_readme(data: dict[str, Any], path: Path) -> None:
    """Replaces the ops table of benchmarks/README.md."""
    replace_section(path, "ops", report(data))


def load_qwix(skip: bool) -> Any:
    """The qwix module for the comparison rows, or None (skipped or not installed)."""
    if skip:
        return None
    try:
        import qwix  # noqa: PLC0415 - optional comparison
    except ImportError:
        print("qwix not installed: comparison skipped (nox -s bench installs it)")
        return None
    return qwix


def qkernels_version() -> str | None:
    """The installed qkernels package's version, or None (qcore then runs pure XLA)."""
    try:
        import qkernels  # noqa: PLC0415 - optional native kernels
    except ImportError:
        return None
    return qkernels.__version__


def xla_path(fn: Callable) -> Callable:
    """``fn`` (a jitted function) called, and so traced, with qkernels bypassed.

    JAX keys its trace caches on ``native_kernels``, so every call inside the block
    reuses the pure-XLA trace and the calls outside it keep their own.
    """
    from qcore.ops import kernels  # noqa: PLC0415

    def call(*args: Any) -> Any:
        with kernels.native_kernels(False):
            return fn(*args)

    return call


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="timed rounds (>= 21)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ring", type=int, default=4, help="distinct weight buffers")
    parser.add_argument("--quick", action="store_true", help="batch-1 matmul only")
    parser.add_argument("--no-qwix", action="store_true", help="skip the Qwix comparison")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "ops.json")
    parser.add_argument(
        "--readme", action="store_true", help="also rewrite the table in benchmarks/README.md"
    )
    parser.add_argument(
        "--from-json", type=Path, help="only re-render the README table from this results file"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        update_readme(data, HERE / "README.md")
        print(f"updated {HERE / 'README.md'} and {plots.save('ops', data)}")
        return 0
    if args.reps < 21 and not args.quick:
        parser.error(f"--reps must be >= 21, got {args.reps}")
    qwix = load_qwix(args.no_qwix)
    info = run_info(args.reps, qwix=getattr(qwix, "__version__", None), ring=args.ring)
    rows: list[dict[str, Any]] = []
    impls = matmul_impls(qwix)
    shapes = MATMUL_SHAPES[:1] if args.quick else MATMUL_SHAPES
    for m, k, n in shapes:
        x = jax.random.normal(jax.random.key(m), (m, k))
        weights = [jax.random.normal(jax.random.key(100 + i), (k, n)) for i in range(args.ring)]
        rows += run_case(
            f"matmul ({m},{k})x({k},{n})", x, weights, impls, args.reps, args.warmup, np.matmul
        )
        del weights
    if not args.quick:
        xs, ks = CONV_SHAPE
        x = jax.random.normal(jax.random.key(7), xs)
        kernels = [jax.random.normal(jax.random.key(200 + i), ks) for i in range(args.ring)]
        label = f"conv {xs}*{ks[:3]}->{ks[3]}"
        rows += run_case(
            label, x, kernels, conv_impls(qwix), args.reps, args.warmup, conv_reference
        )
    print()
    print(table(rows))
    publish("ops", {"machine": info, "rows": rows}, args.out, args.readme, update_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())

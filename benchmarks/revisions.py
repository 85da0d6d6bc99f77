"""Two revisions of the monorepo measured in one run: Flax PTQ and MiniLM speed, compile time.

``A`` and ``B`` are git revisions (a committed revision is checked out with ``git worktree
add --detach`` under a temporary directory, removed at the end; the main working tree and
index are never touched) or the working tree itself, uncommitted changes included (the
default for ``B``). Each side runs in one long-lived worker process whose ``PYTHONPATH``
holds that revision's ``packages/*/src``; the worker checks, and reports, that ``qcore``
and ``qflax`` are imported from there. Both workers run the same workload code, the
benchmark scripts of this directory (``flax_ptq.py``, ``minilm.py``, ``minilm_model.py``):
only the packages differ.

The driver runs ``--rounds`` rounds; in each, every workload runs once on A and once on
B, back to back, the order alternating between rounds and workloads, so the slow drifts
of a shared machine hit both sides alike. Workloads:

* steady state (``ms/call``): timed calls of the jitted model, results ready (per
  round: Flax, one untimed call then 5 timed ones; MiniLM, one timed call).
  ``flax_ptq.Stack`` (4 x Dense(4096), relu) in float32 (a control: it does not go
  through qflax, so its ratio shows the noise) and quantized with qflax's w8, w8a8, w4
  and nf4 rules; MiniLM (all-MiniLM-L6-v2, one batch of 32 x 128 tokens) float32 (control) and
  w8a8 over its 36 encoder matmuls.
* compile (``ms``, one sample per round, from scratch): ``quantize_model``, the abstract
  ``init`` (``jax.eval_shape``), ``quantize_params``, tracing a fresh ``jax.jit`` of the
  quantized apply, and the first call of another fresh ``jax.jit`` to its result (trace +
  lower + XLA compile + one execution).

Per row: median and p10-p90 of each side's samples, ``B/A`` (ratio of the medians) and
p10-p90 of the per-round ratios (each round's B median over its A median). The outputs
of every steady-state workload are compared between A and B (bitwise; else the max
abs difference is shown).

Run (in the bench venv, ``nox -s bench --install-only`` makes it)::

    python benchmarks/revisions.py 38807c5              # 38807c5 vs the working tree
    python benchmarks/revisions.py 38807c5 HEAD --json /tmp/revisions.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SIDES = ("A", "B")
# name -> (model, config, batch); the order is the table's. "compile" models time the
# steps of quantizing and compiling, the others the steady-state call.
WORKLOADS: dict[str, tuple[str, str, int]] = {
    "flax fp32 b1 (control)": ("flax", "fp32", 1),
    "flax w8 b1": ("flax", "w8", 1),
    "flax w8a8 b1": ("flax", "w8a8", 1),
    "flax w4 b1": ("flax", "w4", 1),
    "flax nf4 b1": ("flax", "nf4", 1),
    "flax w8a8 b64": ("flax", "w8a8", 64),
    "minilm float32 (control)": ("minilm", "float32", 32),
    "minilm w8a8": ("minilm", "w8a8", 32),
    "flax w8a8 compile": ("flax compile", "w8a8", 1),
    "minilm w8a8 compile": ("minilm compile", "w8a8", 32),
}
# Flax configs measured here but not in flax_ptq.py's table (which has Qwix twins).
EXTRA_FLAX_RULES = {"nf4": {"weight_qtype": "nf4"}}
# (untimed, timed) calls per round of a steady-state workload. flax_ptq.py makes three
# untimed calls before each timed one since issue 24 (one did not clear what a bf16 or
# Qwix configuration left behind); here the same workload on the other side comes
# before, so one is kept. minilm.py (~1 s a batch) makes none.
CALLS = {"flax": (1, 5), "minilm": (0, 1)}
STAGES = ("quantize_model", "init (eval_shape)", "quantize_params", "trace", "first call")


# ---------------------------------------------------------------- worker (one per side)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(milliseconds, result) of ``fn()`` with its arrays ready."""
    import jax  # noqa: PLC0415 - the worker imports jax, the driver does not

    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return (time.perf_counter() - t0) * 1e3, out


def _steady(call: Callable[[], Any], calls: tuple[int, int]) -> Callable:
    """A workload: ``calls[0]`` untimed calls, then ``calls[1]`` timed ones."""

    def run() -> dict[str, list[float]]:
        for _ in range(calls[0]):
            _timed(call)
        return {"ms/call": [_timed(call)[0] for _ in range(calls[1])]}

    return run


def _compile(model: Any, rules: list[Any], params: Any, inputs: tuple) -> Callable:
    """A workload: the steps of ``flax_ptq.ours`` / ``minilm.qflax_serve``, timed one by one.

    Every step starts from scratch (a new quantized model, a new ``jax.jit`` of a new
    function), so the trace and the XLA compilation are never found in a cache.
    """
    import jax  # noqa: PLC0415

    import qflax  # noqa: PLC0415

    def run() -> dict[str, list[float]]:
        t = {}
        t["quantize_model"], qmodel = _timed(
            lambda: qflax.quantize_model(model, qflax.PtqProvider(rules))
        )
        t["init (eval_shape)"], abstract = _timed(
            lambda: jax.eval_shape(qmodel.init, jax.random.key(0), *inputs)["params"]
        )
        t["quantize_params"], qparams = _timed(lambda: qflax.quantize_params(params, abstract))

        def fresh() -> Callable:
            return jax.jit(lambda p, *a: qmodel.apply({"params": p}, *a))

        t["trace"], _ = _timed(lambda: fresh().trace(qparams, *inputs).jaxpr)
        t["first call"], _ = _timed(lambda: fresh()(qparams, *inputs))
        return {stage: [t[stage]] for stage in STAGES}

    return run


def _build(names: list[str], outputs: Path) -> tuple[dict[str, Callable], dict[str, str]]:
    """The workloads ``names``, warmed up, and their input shapes.

    Each steady-state workload's output is saved to ``outputs`` (for the A/B comparison).
    """
    import flax_ptq  # noqa: PLC0415 - imported with this side's packages on sys.path
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import minilm  # noqa: PLC0415
    from minilm_model import MiniLM, load_params, load_tokenizer, tokenize  # noqa: PLC0415

    import qflax  # noqa: PLC0415

    @functools.cache
    def stack_params() -> Any:
        return flax_ptq.Stack().init(jax.random.key(0), x(1))["params"]

    @functools.cache
    def x(batch: int) -> jax.Array:
        return jax.random.normal(jax.random.key(batch), (batch, flax_ptq.WIDTH))

    @functools.cache
    def minilm_inputs(batch: int) -> tuple[Any, jax.Array, jax.Array]:
        """(float params, ids, mask): ``batch`` of the fixture's sentences, repeated."""
        sentences = (json.loads(minilm.FIXTURE.read_text())["sentences"] * batch)[:batch]
        ids, mask = tokenize(load_tokenizer(), sentences)
        return jax.tree.map(jnp.asarray, load_params()), jnp.asarray(ids), jnp.asarray(mask)

    def flax_call(config: str, batch: int) -> Callable[[], Any]:
        if config == "fp32":
            fn = jax.jit(lambda x, p: flax_ptq.Stack().apply({"params": p}, x))
            return lambda: fn(x(batch), stack_params())
        fn, p = flax_ptq.ours(config, stack_params(), x(1), EXTRA_FLAX_RULES.get(config))
        return lambda: fn(x(batch), p)

    def minilm_call(config: str, batch: int) -> Callable[[], Any]:
        float32 = config == "float32"
        build = minilm.float_model if float32 else minilm.qflax_ptq(**minilm.RULES[config])
        params, ids, mask = minilm_inputs(batch)
        apply, p = build(params, ids, mask)
        return lambda: apply(p, ids, mask)

    built: dict[str, Callable[[], dict[str, list[float]]]] = {}
    shapes: dict[str, str] = {}
    for name in names:
        model, config, batch = WORKLOADS[name]
        if model.startswith("flax"):
            shapes[name] = f"x {tuple(x(batch).shape)}"
        else:
            shapes[name] = f"ids, mask {tuple(minilm_inputs(batch)[1].shape)}"
        if model == "flax compile":
            rules = [qflax.QuantizationRule(**flax_ptq.RULES[config])]
            built[name] = _compile(flax_ptq.Stack(), rules, stack_params(), (x(batch),))
        elif model == "minilm compile":
            params, ids, mask = minilm_inputs(batch)
            rules = minilm.encoder_rules(**minilm.RULES[config])
            built[name] = _compile(MiniLM(), rules, params, (ids, mask))
        else:
            call = (flax_call if model == "flax" else minilm_call)(config, batch)
            np.save(outputs / f"{name}.npy", np.asarray(call()))
            built[name] = _steady(call, CALLS[model])
    return built, shapes


def _check_imports(root: Path) -> dict[str, str]:
    """Where qcore and qflax come from; raises unless from ``root``'s packages."""
    import qcore  # noqa: PLC0415
    import qflax  # noqa: PLC0415

    files = {m.__name__: str(Path(m.__file__ or "").resolve()) for m in (qcore, qflax)}
    for name, file in files.items():
        if not Path(file).is_relative_to(root / "packages" / name / "src"):
            raise RuntimeError(f"{name} was imported from {file}, not from {root}")
    return files


def worker(root: Path, outputs: Path) -> None:
    """Serves one side: reads one JSON request a line on stdin, answers one JSON line.

    Requests: ``{"cmd": "setup", "workloads": [...]}`` and ``{"cmd": "run", "workload":
    name}``. Anything else the process prints goes to stderr.
    """
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    workloads: dict[str, Callable[[], dict[str, list[float]]]] = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["cmd"] == "setup":
                import jax  # noqa: PLC0415
                from ops import machine  # noqa: PLC0415

                jax.config.update("jax_enable_compilation_cache", False)
                files = _check_imports(root)
                workloads, shapes = _build(request["workloads"], outputs)
                reply: dict[str, Any] = {"files": files, "machine": machine(), "shapes": shapes}
            else:
                reply = {"times": workloads[request["workload"]]()}
        except Exception:  # noqa: BLE001 - the driver shows it and stops
            reply = {"error": traceback.format_exc()}
        answer.write(json.dumps(reply) + "\n")
        answer.flush()


# ---------------------------------------------------------------------------- driver


def _git(*args: str) -> str:
    """Output of a read-only git command in this repository (or ``worktree add/remove``)."""
    return subprocess.run(
        ["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


@contextmanager
def checkouts(revisions: dict[str, str | None]) -> Iterator[dict[str, tuple[Path, str]]]:
    """Per side, (root, description): a detached worktree per commit, or this working tree."""
    tmp = Path(tempfile.mkdtemp(prefix="qbench-"))
    added: list[Path] = []
    try:
        out: dict[str, tuple[Path, str]] = {}
        for side, rev in revisions.items():
            if rev is None:
                changed = len(_git("status", "--porcelain").splitlines())
                head = _git("rev-parse", "--short", "HEAD")
                out[side] = (REPO, f"working tree (HEAD {head} + {changed} changed paths)")
                continue
            try:
                sha = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
            except subprocess.CalledProcessError:
                raise SystemExit(
                    f"revision {side} = {rev!r} is not a commit of {REPO}; give a git "
                    "revision (a hash, tag, branch, HEAD~1, ...) or leave B out for the "
                    "working tree"
                ) from None
            root = tmp / sha[:12]
            if root not in added:
                _git("worktree", "add", "--detach", "--quiet", str(root), sha)
                added.append(root)
            out[side] = (root, f"{rev} ({_git('log', '-1', '--format=%h %s', sha)[:70]})")
        yield out
    finally:
        for root in added:
            with suppress(subprocess.CalledProcessError):
                _git("worktree", "remove", "--force", str(root))
        shutil.rmtree(tmp, ignore_errors=True)


class Worker:
    """One side's worker process, driven request by request over a pipe."""

    def __init__(self, side: str, root: Path, log: Path, outputs: Path) -> None:
        srcs = sorted(str(p) for p in (root / "packages").glob("*/src"))
        env = os.environ | {"PYTHONPATH": os.pathsep.join([*srcs, str(HERE)])}
        self.side, self.log, self.log_file = side, log, log.open("w")
        cmd = [sys.executable, __file__, "--worker", str(root), str(outputs)]
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=pipe, stdout=pipe, stderr=self.log_file, text=True
        )

    def ask(self, **request: Any) -> dict[str, Any]:
        """Sends ``request``, returns the answer; raises with the worker's traceback."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        reply = json.loads(line) if line else {"error": f"worker exited, see {self.log}"}
        if "error" in reply:
            raise SystemExit(f"worker {self.side} failed on {request}:\n{reply['error']}")
        return reply

    def close(self) -> None:
        """Ends the worker (closing its stdin ends its loop)."""
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log_file.close()


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def summarize(samples: dict[str, dict[str, list[list[float]]]]) -> list[dict[str, Any]]:
    """Rows: per label, each side's median/p10/p90 and the B/A ratios."""
    rows = []
    for label, by_side in samples.items():
        row: dict[str, Any] = {"label": label}
        for side in SIDES:
            flat = [v for r in by_side[side] for v in r]
            row[side] = {"median": statistics.median(flat), "p10": _percentile(flat, 10)}
            row[side] |= {"p90": _percentile(flat, 90), "samples": flat}
            row["n"] = len(flat)
        per_round = [
            statistics.median(b) / statistics.median(a)
            for a, b in zip(by_side["A"], by_side["B"], strict=True)
        ]
        row["ratio"] = row["B"]["median"] / row["A"]["median"]
        row["round_ratio_p10"], row["round_ratio_p90"] = (
            _percentile(per_round, 10),
            _percentile(per_round, 90),
        )
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], same: dict[str, str], shapes: dict[str, str]) -> str:
    """Markdown table of ``summarize``'s rows.

    ``same`` says if A and B gave equal outputs, ``shapes`` gives each workload's inputs.
    """
    lines = [
        "| workload | shape | measure | A median | A p10–p90 | B median | B p10–p90 | B/A "
        "| per-round B/A p10–p90 | calls per side | outputs A vs B |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        workload, measure = r["label"].split(": ")
        a, b = r["A"], r["B"]
        lines.append(
            f"| {workload} | {shapes[workload]} | {measure} | {a['median']:.2f} | "
            f"{a['p10']:.2f}–{a['p90']:.2f} | {b['median']:.2f} | {b['p10']:.2f}–{b['p90']:.2f} "
            f"| {r['ratio']:.3f} | {r['round_ratio_p10']:.2f}–{r['round_ratio_p90']:.2f} | "
            f"{r['n']} | {same.get(workload, '')} |"
        )
    return "\n".join(lines)


def compare_outputs(outputs: dict[str, Path], names: list[str]) -> dict[str, str]:
    """Per steady workload: "identical" or the max abs difference of B's output from A's."""
    same = {}
    for name in names:
        files = [outputs[side] / f"{name}.npy" for side in SIDES]
        if all(f.exists() for f in files):
            a, b = (np.load(f) for f in files)
            diff = float(np.max(np.abs(a.astype(np.float64) - b)))
            same[name] = "identical" if np.array_equal(a, b) else f"max abs diff {diff:.1e}"
    return same


def main(argv: list[str] | None = None) -> int:
    """Runs the comparison (or, with ``--worker``, one side's worker); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="revision A (any git revision, e.g. 38807c5)")
    parser.add_argument("new", nargs="?", help="revision B (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=21, help="rounds (>= 21; --quick: any)")
    parser.add_argument("--quick", action="store_true", help="allow fewer than 21 rounds")
    parser.add_argument(
        "--only", nargs="*", help="run only the workloads whose name contains one of these"
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # started by Worker: --worker ROOT OUTPUTS
        worker(Path(argv[1]), Path(argv[2]))
        return 0
    args = parser.parse_args(argv)
    if args.rounds < (1 if args.quick else 21):
        parser.error(f"--rounds must be >= 21 (or >= 1 with --quick), got {args.rounds}")
    names = [n for n in WORKLOADS if not args.only or any(s in n for s in args.only)]
    if not names:
        parser.error(f"--only {args.only} matches none of {list(WORKLOADS)}")
    start = time.perf_counter()
    with (
        checkouts({"A": args.base, "B": args.new}) as roots,
        tempfile.TemporaryDirectory(prefix="qbench-out-") as out,
    ):
        outputs = {side: Path(out, side) for side in SIDES}
        workers = {}
        try:
            for side in SIDES:
                outputs[side].mkdir()
                log = Path(out).parent / f"qbench-worker-{side}.log"
                workers[side] = Worker(side, roots[side][0], log, outputs[side])
            info = {}
            for side in SIDES:
                t0 = time.perf_counter()
                info[side] = workers[side].ask(cmd="setup", workloads=names)
                print(
                    f"{side} = {roots[side][1]}\n    qflax: {info[side]['files']['qflax']}\n"
                    f"    set up in {time.perf_counter() - t0:.1f} s (log {workers[side].log})",
                    flush=True,
                )
            samples: dict[str, dict[str, list[list[float]]]] = {}
            for r in range(args.rounds):
                for i, name in enumerate(names):
                    for side in SIDES if (r + i) % 2 == 0 else SIDES[::-1]:
                        for measure, ms in (
                            workers[side].ask(cmd="run", workload=name)["times"].items()
                        ):
                            label = f"{name}: {measure}"
                            samples.setdefault(label, {s: [] for s in SIDES})[side].append(ms)
                print(f"round {r + 1}/{args.rounds} done", flush=True)
            same = compare_outputs(outputs, names)
        finally:
            for w in workers.values():
                w.close()
    rows = summarize(samples)
    m = info["A"]["machine"]
    header = (
        f"Measured {datetime.date.today()} on {m['cpu']} ({m['cores']} cores), Python "
        f"{m['python']}, jax {m['jax']}; GLIBC_TUNABLES {m['GLIBC_TUNABLES']}, XLA_FLAGS "
        f"{m['XLA_FLAGS']}. A = {roots['A'][1]}; B = {roots['B'][1]}. {args.rounds} rounds, "
        "A and B back to back per workload, order alternating; steady rows: ms per call of "
        "the jitted model (per round: Flax, 1 untimed + 5 timed calls; MiniLM, 1 timed "
        "call); compile rows: ms per step from scratch, 1 per round. "
        f"Run took {(time.perf_counter() - start) / 60:.1f} min."
    )
    print(f"\n{header}\n\n{table(rows, same, info['A']['shapes'])}")
    if args.json:
        data = {"machine": m, "sides": {s: {"revision": roots[s][1]} | info[s] for s in SIDES}}
        data |= {"rounds": args.rounds, "rows": rows, "outputs": same, "header": header}
        args.json.write_text(json.dumps(data, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

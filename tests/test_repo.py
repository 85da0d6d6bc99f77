"""Repository-wide checks: CI entry point, package layout, noxfile, dependency direction."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES_DIR = ROOT / "packages"
PACKAGE_NAMES = sorted(
    p.name for p in PACKAGES_DIR.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
)

# Every package's distribution name: the import names are taken on the package index by
# unrelated projects (e.g. `qcore`), so a requirement on a bare `qcore` could install theirs.
DIST_PREFIX = "jaxquant-"
DISTRIBUTIONS = {f"{DIST_PREFIX}{name}": name for name in PACKAGE_NAMES}
# The third-party distributions the packages may require (runtime, extras, test groups).
# A requirement on anything else fails test_requirements_name_only_ours_or_known_third_parties.
THIRD_PARTY = {
    "jax",
    "numpy",
    "ml-dtypes",
    "flax",
    "orbax-checkpoint",
    "safetensors",
    "tokenizers",  # reads all-MiniLM-L6-v2's tokenizer in qlitert's tests
    "matplotlib",
    "litert-converter",
    "ai-edge-litert",
    "pytest",
    "hypothesis",
    "scipy",
    "scikit-learn",
    "onnx",
    "onnxruntime",
}

# Packages qcore must never depend on (docs/design.md: qcore <- qflax, qcore <- qlitert,
# qcore <- qtorchlike, qcore <- qflax <- qort).
QCORE_FORBIDDEN = {
    "flax",
    "tensorflow",
    "torch",
    "litert",
    "onnx",
    "onnxruntime",
    "qflax",
    "qlitert",
    "qtorchlike",
    "qort",
}
# The local packages each package may require (dependencies and extras) and import: the
# dependencies point one way, and what two packages share lives in qcore.
LOCAL_DEPS_ALLOWED = {
    # qkernels only through the `native` extra (qcore runs without it)
    "qcore": {"qkernels"},
    "qkernels": set(),
    "qflax": {"qcore"},
    "qlitert": {"qcore"},
    # qlitert and qort only through the `litert` and `onnx` extras
    "qtorchlike": {"qcore", "qlitert", "qort"},
    "qort": {"qcore", "qflax"},
}


def fenced_blocks(markdown: str) -> list[str]:
    """Return the bodies of the top-level ``` fenced blocks of a markdown text."""
    return re.findall(r"^```[^\n]*\n(.*?)^```\s*$", markdown, flags=re.MULTILINE | re.DOTALL)


def script_commands(script: str) -> list[str]:
    """Return the commands a bash script runs, without comments, set-up and cd lines."""
    commands = []
    for line in script.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.startswith(("set ", "cd ")):
            continue
        commands.append(line)
    return commands


def pip_install_targets(command: str) -> set[str]:
    """Return the packages a ``[python -m] pip install [options] pkg...`` command installs."""
    words = shlex.split(command)
    start = words.index("install") + 1
    return {w for w in words[start:] if not w.startswith("-")}


def requirement_name(requirement: str) -> str:
    """Return the normalised distribution name of a PEP 508 requirement string."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def noxfile_packages(name: str = "PACKAGES") -> dict[str, list[str]]:
    """Return the PACKAGES (or NATIVE_PACKAGES) dict of noxfile.py, read without importing nox."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    for node in tree.body:
        target = getattr(node, "target", None) or getattr(node, "targets", [None])[0]
        if isinstance(target, ast.Name) and target.id == name:
            assert isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None
            return ast.literal_eval(node.value)
    raise AssertionError(f"noxfile.py defines no {name}")


def test_the_default_suite_builds_no_native_package() -> None:
    # The default sessions install PACKAGES only; compiled packages are built by their
    # own sessions (kernels, bench), so `nox` needs no compiler.
    assert not set(noxfile_packages()) & set(noxfile_packages("NATIVE_PACKAGES"))


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme_blocks = fenced_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(readme_blocks) >= 2, "README.md needs the demo and the test command blocks"
    readme_install, readme_test = (c.strip() for c in readme_blocks[1].strip().split("&&"))

    ci = script_commands((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert ci[-1] == readme_test == "nox"
    assert len(ci) == 2, ci
    assert pip_install_targets(ci[0]) == pip_install_targets(readme_install) == {"nox", "uv"}


def test_ci_script_is_strict_bash_and_executable() -> None:
    script = ROOT / ".ci" / "run"
    text = script.read_text(encoding="utf-8")
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert script.stat().st_mode & 0o111


def test_readme_demo_command_runs_the_demo_session() -> None:
    demo = fenced_blocks((ROOT / "README.md").read_text(encoding="utf-8"))[0].strip()
    assert demo == "pip install nox uv && nox -s demo"


def test_there_is_at_least_one_package() -> None:
    assert "qcore" in PACKAGE_NAMES


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_package_layout(name: str) -> None:
    package = PACKAGES_DIR / name
    assert (package / "pyproject.toml").is_file()
    assert (package / "src" / name / "__init__.py").is_file()
    assert list((package / "tests").glob("test_*.py")), f"{name}/tests has no test_*.py"


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_package_pyproject_names_it_and_has_a_test_group(name: str) -> None:
    with open(PACKAGES_DIR / name / "pyproject.toml", "rb") as f:
        pyproject = tomllib.load(f)
    assert pyproject["project"]["name"] == f"{DIST_PREFIX}{name}"
    assert "test" in pyproject.get("dependency-groups", {}), f"{name} has no test group"


def test_noxfile_packages_match_the_packages_directory() -> None:
    packages = noxfile_packages()
    assert sorted(packages | noxfile_packages("NATIVE_PACKAGES")) == PACKAGE_NAMES
    for name, local_deps in packages.items():
        assert set(local_deps) <= set(packages) - {name}, (name, local_deps)


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_noxfile_local_deps_match_pyproject(name: str) -> None:
    with open(PACKAGES_DIR / name / "pyproject.toml", "rb") as f:
        deps = {requirement_name(r) for r in tomllib.load(f)["project"].get("dependencies", [])}
    local = {DISTRIBUTIONS[d] for d in deps & set(DISTRIBUTIONS)}
    # The noxfile may list transitive local deps too, but must list every direct one.
    listed = noxfile_packages() | noxfile_packages("NATIVE_PACKAGES")
    assert local <= set(listed[name]), (name, local)


def pyproject(name: str) -> dict:
    with open(PACKAGES_DIR / name / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_versions_and_inter_package_bounds_are_consistent(name: str) -> None:
    from packaging.requirements import Requirement

    project = pyproject(name)["project"]
    init = (PACKAGES_DIR / name / "src" / name / "__init__.py").read_text(encoding="utf-8")
    assert f'__version__ = "{project["version"]}"' in init
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    for text in requirements:
        req = Requirement(text)
        if req.name in DISTRIBUTIONS:
            # Bounded on both sides, and admitting the sibling as it is in this checkout.
            assert {s.operator for s in req.specifier} >= {">=", "<"}, (name, text)
            sibling = pyproject(DISTRIBUTIONS[req.name])["project"]["version"]
            assert sibling in req.specifier, (name, text)


def all_requirements(name: str) -> list[str]:
    """Every requirement string of a package: dependencies, extras and dependency groups."""
    project = pyproject(name)
    found = list(project["project"].get("dependencies", []))
    for extra in project["project"].get("optional-dependencies", {}).values():
        found += extra
    for group in project.get("dependency-groups", {}).values():
        found += [r for r in group if isinstance(r, str)]
    return found


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_requirements_name_only_ours_or_known_third_parties(name: str) -> None:
    for text in all_requirements(name):
        dist = requirement_name(text)
        assert dist in DISTRIBUTIONS or dist in THIRD_PARTY, (
            f"packages/{name}/pyproject.toml requires {text!r}: {dist!r} is neither one of "
            f"ours ({sorted(DISTRIBUTIONS)}) nor a known third party (THIRD_PARTY)"
        )


def test_no_distribution_is_named_like_an_import_name() -> None:
    # The bare import names belong to others on the package index (qcore 0.2.x exists).
    assert not set(DISTRIBUTIONS) & set(PACKAGE_NAMES)
    assert not set(PACKAGE_NAMES) & THIRD_PARTY


def test_changelog_has_an_entry_for_every_package_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    for name in PACKAGE_NAMES:
        assert f"{name} {pyproject(name)['project']['version']}" in changelog, name


def test_qcore_depends_on_no_framework_or_downstream_package() -> None:
    with open(PACKAGES_DIR / "qcore" / "pyproject.toml", "rb") as f:
        pyproject = tomllib.load(f)
    requirements = list(pyproject["project"].get("dependencies", []))
    for extra in pyproject["project"].get("optional-dependencies", {}).values():
        requirements += extra
    names = {requirement_name(r) for r in requirements}
    forbidden = QCORE_FORBIDDEN | {f"{DIST_PREFIX}{n}" for n in QCORE_FORBIDDEN}
    assert not names & forbidden
    assert not {n for n in names if n.startswith(("ai-edge-litert", "litert", "tensorflow"))}


def local_requirements(name: str) -> set[str]:
    """The local packages a package requires (dependencies and extras, not test groups)."""
    project = pyproject(name)["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {DISTRIBUTIONS[d] for d in map(requirement_name, requirements) if d in DISTRIBUTIONS}


def imported_packages(tree: ast.AST) -> set[str]:
    """The top-level names of every ``import x`` / ``from x import ...`` (absolute) in a tree."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_local_dependencies_point_one_way() -> None:
    assert sorted(LOCAL_DEPS_ALLOWED) == PACKAGE_NAMES
    for name in PACKAGE_NAMES:
        assert local_requirements(name) <= LOCAL_DEPS_ALLOWED[name], name
    assert local_requirements("qlitert") == {"qcore"}  # not qflax: rules come from qcore


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_sources_import_only_the_local_packages_they_require(name: str) -> None:
    others = set(PACKAGE_NAMES) - {name}
    for path in sorted((PACKAGES_DIR / name / "src").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        extra = imported_packages(tree) & others - local_requirements(name)
        assert not extra, (
            f"{path.relative_to(ROOT)} imports {sorted(extra)}, not required by {name}"
        )


def test_imported_packages_finds_each_kind_of_import() -> None:
    code = (
        "import qflax.rule\nfrom qcore import rules\nfrom . import x\ndef f():\n    import qlitert"
    )
    assert imported_packages(ast.parse(code)) == {"qflax", "qcore", "qlitert"}


def test_requirement_name_normalises() -> None:
    assert requirement_name("ml_dtypes>=0.5") == "ml-dtypes"
    assert requirement_name("jax[cpu] >= 0.10.2") == "jax"
    assert requirement_name("Flax; python_version>'3'") == "flax"


def test_readme_python_examples_run() -> None:
    # The README's python snippets are run here so they cannot drift from the code.
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "README.md should show qcore in a python block"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


# -- package boundaries -------------------------------------------------------------------------

# Imports of another package's private module or name that are known and being removed, as
# (file relative to the repository, dotted private name). The lead's qflax redesign (issue 19)
# empties this list; the test fails on an entry that is no longer an offender, so that it shrinks.
PRIVATE_IMPORTS_ALLOWED: set[tuple[str, str]] = set()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]`` (None for anything but names and attributes)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_uses(tree: ast.AST, own: str | None) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every use of another package's private module or name.

    Covers ``import other._x``, ``from other._x import y``, ``from other.x import _y`` and
    attribute access ``other._x`` / ``alias._y`` on names bound to another package by an import.
    ``own`` is the package the code belongs to (None: it belongs to none, e.g. examples/).
    """
    others = set(PACKAGE_NAMES) - {own}
    bound: dict[str, str] = {}  # local name -> dotted name in another package
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in others:
                    if any(_private(p) for p in parts[1:]):
                        found.append((node.lineno, alias.name))
                    bound[alias.asname or parts[0]] = alias.name if alias.asname else parts[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] not in others:
                continue
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if any(_private(p) for p in [*parts[1:], alias.name]):
                    found.append((node.lineno, name))
                bound[alias.asname or alias.name] = name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _dotted(node)
            if chain and chain[0] in bound:
                found.append((node.lineno, ".".join([bound[chain[0]], *chain[1:]])))
    return sorted(set(found))


def source_files() -> list[tuple[Path, str | None]]:
    """Every Python file of the packages' sources, examples/ and benchmarks/, with its package."""
    files = [(f, n) for n in PACKAGE_NAMES for f in (PACKAGES_DIR / n / "src").rglob("*.py")]
    for folder in ("examples", "benchmarks"):
        files += [(f, None) for f in (ROOT / folder).rglob("*.py")]
    return sorted(files)


def test_no_package_uses_another_packages_private_modules_or_names() -> None:
    found = set()
    for path, own in source_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in private_uses(tree, own):
            found.add((str(path.relative_to(ROOT)), line, name))
    offenders = sorted(f for f in found if (f[0], f[2]) not in PRIVATE_IMPORTS_ALLOWED)
    stale = PRIVATE_IMPORTS_ALLOWED - {(f, name) for f, _, name in found}
    assert not offenders, "private names of another package used (make them public there):\n" + (
        "\n".join(f"{f}:{line}: {name}" for f, line, name in offenders)
    )
    assert not stale, f"PRIVATE_IMPORTS_ALLOWED entries no longer in use: {sorted(stale)}"


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import qcore._x", ["qcore._x"]),
        ("import qcore.numerics as n\nn._TINY", ["qcore.numerics._TINY"]),
        ("from qcore._x import y", ["qcore._x.y"]),
        ("from qcore.qarray import _check, ok", ["qcore.qarray._check"]),
        ("from qcore import qarray\nqarray._check_float(x)", ["qcore.qarray._check_float"]),
        ("import qcore\nqcore.numerics._MAX", ["qcore.numerics._MAX"]),
        ("import qlitert._own\nfrom qlitert import _own", []),  # the file's own package
        ("import qcore\nqcore.numerics.round_values\nx._y\nfrom qcore import __version__", []),
    ],
)
def test_private_uses_finds_each_kind_of_use(code: str, expected: list[str]) -> None:
    assert [name for _, name in private_uses(ast.parse(code), "qlitert")] == expected


# -- public API pins -----------------------------------------------------------------------------

API_DIR = ROOT / "tests" / "api"
API_HINT = "# Regenerate after a deliberate API change: python tests/test_repo.py --update-api"


def public_modules(package: str) -> list[str]:
    """The package and its submodules whose dotted names have no ``_``-prefixed part."""
    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, f"{package}.", onerror=lambda _: None):
        if not any(_private(p) for p in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def public_names(module_name: str) -> list[str]:
    """A module's ``__all__``; without one, the public names it defines (not imports)."""
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        return sorted(module.__all__)
    tree = ast.parse(inspect.getsource(module))
    imported = {
        alias.asname or alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and name not in imported
        and getattr(value, "__module__", module_name) == module_name
    )


def api_lines(package: str) -> list[str]:
    return [f"{m}.{name}" for m in public_modules(package) for name in public_names(m)]


def pinned_packages() -> list[str]:
    """The packages whose API is pinned here: all but the compiled ones, which the
    default suite does not build (qkernels pins its API in its own tests)."""
    return sorted(set(PACKAGE_NAMES) - set(noxfile_packages("NATIVE_PACKAGES")))


def write_api_pins() -> None:
    API_DIR.mkdir(exist_ok=True)
    for package in pinned_packages():
        lines = [API_HINT, *api_lines(package)]
        (API_DIR / f"{package}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def api_diff(package: str, pinned: list[str], current: list[str]) -> str:
    """The message for a public API that differs from its pin ("" when equal)."""
    added, removed = sorted(set(current) - set(pinned)), sorted(set(pinned) - set(current))
    if not added and not removed:
        return ""
    return (
        f"the public API of {package} differs from tests/api/{package}.txt:\n"
        + "".join(f"  + {n}\n" for n in added)
        + "".join(f"  - {n}\n" for n in removed)
        + "If the change is deliberate, run `python tests/test_repo.py --update-api` and "
        "commit the file; a removed name needs a deprecated alias first if users call it."
    )


@pytest.mark.parametrize("package", pinned_packages())
def test_public_api_is_pinned(package: str) -> None:
    text = (API_DIR / f"{package}.txt").read_text(encoding="utf-8")
    pinned = [line for line in text.splitlines() if line and not line.startswith("#")]
    message = api_diff(package, pinned, api_lines(package))
    assert not message, message


def test_api_pin_fails_with_a_diff_when_a_name_is_added_or_removed() -> None:
    current = api_lines("qcore")
    message = api_diff("qcore", [*current[1:], "qcore.gone"], [*current, "qcore.brand_new"])
    changes = [line for line in message.splitlines() if line.startswith("  ")]
    assert sorted(changes) == sorted([f"  + {current[0]}", "  + qcore.brand_new", "  - qcore.gone"])
    assert "tests/api/qcore.txt" in message and "--update-api" in message
    assert api_diff("qcore", current, current) == ""


if __name__ == "__main__":
    if sys.argv[1:] != ["--update-api"]:
        sys.exit("usage: python tests/test_repo.py --update-api  (rewrites tests/api/*.txt)")
    write_api_pins()

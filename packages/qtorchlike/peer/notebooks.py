"""Runs Brevitas' tutorial notebooks and two of its test files on Brevitas and on qtorchlike.

Usage::

    python notebooks.py --brevitas-repo PATH --brevitas-python /tmp/brev/bin/python --out DIR

``PATH`` is a Brevitas checkout or a git directory (read with ``git show REV:path``).
Nothing from Brevitas is stored in this repository: the notebooks and tests are read
from ``PATH`` at run time, and everything derived from them goes to ``DIR``.

What it does
------------
1. Reads the three tutorial notebooks (``NOTEBOOKS``) and two test files (``TEST_FILES``).
2. Runs each notebook's code cells in order, in one persistent namespace per notebook,
   in a subprocess of the Brevitas interpreter. Per cell it keeps what Jupyter shows:
   stdout, the repr of the last expression, and, as numbers, every ``print`` argument
   and the last-expression value when they are tensors, QuantTensors, numbers or
   sequences of them. It also records (per cell, in call order) every tensor that the
   cell's own code draws from ``torch.randn``/``rand``/``randint``/``nn.init.uniform_``/
   ``normal_`` and the initial ``weight``/``bias`` of every ``Conv*``/``Linear`` layer
   built (recorded at the end of ``torch.nn.modules.conv._ConvNd.__init__`` and
   ``torch.nn.Linear.__init__``).
   The Brevitas results are cached under ``DIR/cache`` (keyed by this file, the sources
   and the interpreter), so re-runs only run qtorchlike; ``--no-cache`` runs both.
3. Translates every cell with the same mechanical rules (``RULES`` below; there are no
   per-cell edits: ``HAND_EDITS`` is empty) and runs it in the qtorchlike interpreter,
   where ``torch`` is this harness' shim (see "The torch shim"). The shim replays the
   Brevitas run's random tensors of the same cell in the same order, and every
   qtorchlike layer's first ``weight``/``bias`` assignment (a ``Parameter`` assigned to
   a ``qtorchlike.nn.Module`` under the name ``weight``/``bias``) takes the Brevitas
   layer's initial values, in construction order, before its quantizers are built.
   A replay whose shape does not match falls back to seeded numpy draws and is noted.
4. Compares each cell and classifies it:

   * ``match``: neither side raised; the ``print`` calls and the last-expression values
     agree (see "Comparison");
   * ``both-fail``: both raised exceptions of the same kind (one's type name is in the
     other's MRO); counts as a match;
   * ``differ``: both ran but disagree, or both raised different kinds, or only Brevitas
     raised;
   * ``fail``: only qtorchlike raised.

5. Runs the two test files with pytest in each interpreter (the qtorchlike copies are
   translated by the same rules into a temp dir whose ``conftest.py`` installs the
   shim) and reports each test's outcome. If the Brevitas venv has no pytest, the
   qtorchlike venv's pytest packages are put on its ``PYTHONPATH`` (same Python only).

Writes ``DIR/report.json`` (everything, including both sides' outputs and the translated
cells) and ``DIR/report.md`` (tables), and prints a summary with the first line of
every non-matching cell and the reason.

Translation rules (``RULES``, applied in order to every cell and test file)
--------------------------------------------------------------------------
* ``brevitas.quant_tensor`` -> ``qtorchlike.quant_tensor``; the name ``IntQuantTensor``
  -> ``QuantTensor`` (the concept map in docs/qtorchlike.md pairs them).
* ``brevitas.nn[.x]`` -> ``qtorchlike.nn``, ``brevitas.quant[.x]`` -> ``qtorchlike.quant``,
  ``brevitas.inject.enum`` -> ``qtorchlike.solver`` (where the enums live),
  ``brevitas.inject[.x]`` -> ``qtorchlike.inject``, ``brevitas.core[.x]`` ->
  ``qtorchlike.core``, ``brevitas.proxy[.x]`` -> ``qtorchlike.proxy``, and any other
  ``brevitas`` -> ``qtorchlike`` (``from brevitas import config``).
* A statement ``torch.nn.init.f_(target, ...)`` (in-place init) becomes
  ``target = torch.nn.init.f_(target, ...)``: JAX arrays are immutable, and the shim's
  initialisers return the new array.
* A statement ``name[index] op= expr`` becomes ``name = name.at[index].set(name[index]
  op (expr))``, the JAX spelling of an in-place item update.
* ``torch`` imports are not rewritten: the qtorchlike run installs the shim as the
  modules ``torch``, ``torch.nn``, ``torch.nn.functional``, ``torch.nn.init`` and
  ``torch.random``.

The torch shim (qtorchlike side only)
-------------------------------------
* ``torch.manual_seed`` / ``torch.random.manual_seed`` -> ``qtorchlike.manual_seed``.
* ``torch.randn``, ``rand``, ``randint``, ``nn.init.uniform_``, ``normal_`` -> the
  recorded Brevitas tensors (see 3).
* ``torch.tensor(data)`` -> ``jnp.asarray`` (float64 -> float32, as torch's default).
* ``torch.Tensor`` -> ``jax.Array``; ``torch.no_grad`` -> a null context.
* ``torch.nn.Module``, ``Parameter`` and other ``torch.nn.X`` -> ``qtorchlike.nn.X``;
  ``torch.nn.Conv1d/Conv2d/Linear`` (float layers) -> the qtorchlike layer with
  ``weight_quant=None``.
* Any other ``torch.X`` / ``torch.nn.functional.X`` -> ``qtorchlike.functional.X`` if it
  exists, else ``jax.numpy.X`` (``jax.nn.X`` for functional), with QuantTensor
  arguments passed as their ``.value`` (Brevitas, like qtorchlike's documented rule,
  drops the quantization metadata for ops that leave the grid).
* Torch ``Tensor`` methods that JAX arrays lack are added to JAX's array type while the
  harness runs (``TENSOR_METHODS``): ``isclose``, ``abs``, ``view(*shape)`` (as
  ``reshape``; ``view(dtype)`` keeps JAX's meaning) and ``max/min(dim=...)`` (returning
  ``(values, indices)``; calls without ``dim=`` keep JAX's meaning).
* An ``IPython.display`` stub (``display`` does nothing) is installed on both sides, as
  the venvs have no IPython and rich display is not output that can be compared.

Comparison
----------
Arrays (tensors, JAX/numpy arrays, numbers, bools as 0/1) compare by value: equal
element counts (a shape difference with equal counts, e.g. a scale of shape ``()`` vs
``(1,)``, is noted but not a mismatch) and every element within 1e-5 relative, with an
absolute floor of 1e-6 times the array's largest magnitude; NaN equals NaN. A
QuantTensor compares value, scale, zero_point, bit_width, signed and training. Sequences
and dicts compare item by item; other objects by type name. Strings (printed text,
reprs) compare as token lists: numbers within the printed precision of the coarser side
(torch prints 4 decimals) or 1e-5 relative, ``True``/``False`` as 1/0, and the remaining
words after dropping array-repr noise (``tensor``, ``Array``, ``dtype``, ``grad_fn``,
dtype names, ``...Backward0``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
import types
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO_ROOT = HERE.parents[3]

NOTEBOOKS = {
    "01": "notebooks/01_quant_tensor_quant_conv2d_overview.ipynb",
    "02": "notebooks/02_quant_activation_overview.ipynb",
    "03": "notebooks/03_anatomy_of_a_quantizer.ipynb",
}
TEST_FILES = {
    "test_act": "tests/brevitas/nn/test_act.py",
    "test_linear": "tests/brevitas/nn/test_linear.py",
}

# (pattern, replacement, why): applied in this order, with re.MULTILINE, to every cell
# and test file on the qtorchlike side.
RULES: list[tuple[str, str, str]] = [
    (r"\bbrevitas\.quant_tensor\b", "qtorchlike.quant_tensor", "module of the same name"),
    (r"\bIntQuantTensor\b", "QuantTensor", "docs/qtorchlike.md concept map"),
    (r"\bbrevitas\.nn(\.\w+)*", "qtorchlike.nn", "layers (submodules collapse)"),
    (r"\bbrevitas\.quant(\.\w+)*", "qtorchlike.quant", "quantizer catalogue"),
    (r"\bbrevitas\.inject\.enum\b", "qtorchlike.solver", "enums live in qtorchlike.solver"),
    (r"\bbrevitas\.inject(\.\w+)*", "qtorchlike.inject", "injectors, value, this"),
    (r"\bbrevitas\.core(\.\w+)*", "qtorchlike.core", "implementation names"),
    (r"\bbrevitas\.proxy(\.\w+)*", "qtorchlike.proxy", "quantizer proxies"),
    (r"\bbrevitas\b", "qtorchlike", "anything else (config, ...)"),
    (
        r"^(\s*)torch\.nn\.init\.(\w+_)\(\s*([\w.]+)(.*)\)\s*$",
        r"\1\3 = torch.nn.init.\2(\3\4)",
        "in-place init: immutable arrays, the shim returns the new array",
    ),
    (
        r"^(\s*)([A-Za-z_]\w*)\[([^\]\n]*)\]\s*([-+*/])=\s*(.+?)\s*$",
        r"\1\2 = \2.at[\3].set(\2[\3] \4 (\5))",
        "in-place item update: JAX's .at[].set",
    ),
]

# (notebook, cell index) -> (old text, new text, reason). Deliberately empty: every cell
# goes through RULES only. Add an entry here only when no generic rule can do it.
HAND_EDITS: dict[tuple[str, int], tuple[str, str, str]] = {}

# Torch Tensor methods added to JAX's array type on the qtorchlike side (see docstring).
TENSOR_METHODS = ("isclose", "abs", "view", "max", "min")

RTOL = 1e-5
FLOOR = 1e-6
MAX_VALUES = 20000  # array elements kept per value
WORKER_TIMEOUT = 600

# Marks errors raised by the shim itself (a translation limit, not a qtorchlike gap).
SHIM_TAG = "[harness torch shim]"


# ---------------------------------------------------------------------------------------
# Sources and translation
# ---------------------------------------------------------------------------------------


def read_source(repo: Path, path: str, rev: str) -> str:
    """A file of the Brevitas repo: from the work tree if present, else ``git show``."""
    f = repo / path
    if f.is_file():
        return f.read_text()
    out = subprocess.run(
        ["git", "-C", str(repo), "show", f"{rev}:{path}"],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(f"cannot read {path} from {repo} ({rev}): {out.stderr.strip()}")
    return out.stdout


def code_cells(notebook_json: str) -> list[str]:
    """The source of each code cell, in order."""
    nb = json.loads(notebook_json)
    cells = []
    for c in nb["cells"]:
        if c.get("cell_type") == "code":
            src = c["source"]
            cells.append("".join(src) if isinstance(src, list) else src)
    return cells


def translate(src: str) -> str:
    """Applies RULES to ``src``."""
    for pattern, repl, _ in RULES:
        src = re.sub(pattern, repl, src, flags=re.MULTILINE)
    return src


def translate_cell(nb: str, index: int, src: str) -> str:
    """RULES, then the cell's HAND_EDITS entry if it has one."""
    out = translate(src)
    if (nb, index) in HAND_EDITS:
        old, new, _ = HAND_EDITS[(nb, index)]
        out = out.replace(old, new)
    return out


def first_line(src: str) -> str:
    """The first line of code (not blank, not a comment)."""
    for line in src.splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            return s
    return src.strip().splitlines()[0] if src.strip() else ""


# ---------------------------------------------------------------------------------------
# Worker side: runs in the Brevitas or the qtorchlike interpreter
# ---------------------------------------------------------------------------------------


def _np():
    import numpy as np

    return np


class Tape:
    """Random tensors and initial layer weights, per cell, in call order.

    In the Brevitas run it records; in the qtorchlike run it replays the records of the
    same cell, and notes any draw it could not replay.
    """

    def __init__(self, replay: dict[int, dict[str, list]] | None = None) -> None:
        self.cell = -1
        self.records: dict[int, dict[str, list]] = {}
        self.replay = replay
        self.notes: dict[int, list[str]] = {}
        self._pending: dict[int, dict] = {}
        self._rng = _np().random.default_rng(0)

    def start(self, cell: int) -> None:
        self.cell = cell
        self._pending.clear()

    def _rec(self, kind: str) -> list:
        return self.records.setdefault(self.cell, {"random": [], "weights": []})[kind]

    def note(self, msg: str) -> None:
        self.notes.setdefault(self.cell, []).append(msg)

    # -- recording (Brevitas) --
    def record_random(self, fn: str, arr: Any) -> None:
        self._rec("random").append({"fn": fn, "array": arr})

    def record_weights(self, layer: str, weight: Any, bias: Any) -> None:
        self._rec("weights").append({"layer": layer, "weight": weight, "bias": bias})

    # -- replay (qtorchlike) --
    def _queue(self, kind: str) -> list:
        if self.replay is None:
            return []
        return self.replay.get(self.cell, {}).get(kind, [])

    def replay_random(self, fn: str, shape: tuple[int, ...] | None, fallback) -> Any:
        np = _np()
        queue = self._queue("random")
        if queue:
            rec = queue.pop(0)
            arr = rec["array"]
            if rec["fn"] == fn and (shape is None or tuple(arr.shape) == tuple(shape)):
                return arr
            self.note(
                f"random draw {fn}{shape} not replayed (Brevitas drew {rec['fn']}"
                f"{tuple(arr.shape)} here)"
            )
        elif self.replay is not None:
            self.note(f"random draw {fn}{shape} not replayed (Brevitas drew nothing more)")
        return np.asarray(fallback(self._rng))

    def replay_param(self, module: Any, name: str, shape: tuple[int, ...]) -> Any:
        if self.replay is None:
            return None
        layer = type(module).__name__
        if name == "weight":
            queue = self._queue("weights")
            if not queue:
                self.note(f"{layer}.weight{shape} not replayed (Brevitas built no more layers)")
                return None
            rec = queue.pop(0)
            self._pending[id(module)] = rec
            w = rec["weight"]
            if tuple(w.shape) != tuple(shape):
                self.note(
                    f"{layer}.weight{shape} not replayed (Brevitas {rec['layer']} had "
                    f"{tuple(w.shape)})"
                )
                return None
            return w
        rec = self._pending.get(id(module))
        if rec is None:
            return None
        b = rec["bias"]
        if b is None or tuple(b.shape) != tuple(shape):
            self.note(f"{layer}.bias{shape} not replayed (Brevitas: {_shape_of(b)})")
            return None
        return b

    # -- storage --
    def save(self, path: Path) -> None:
        np = _np()
        arrays, meta = {}, {}
        for cell, rec in self.records.items():
            m = meta[str(cell)] = {"random": [], "weights": []}
            for k, r in enumerate(rec["random"]):
                key = f"c{cell}_r{k}"
                arrays[key] = r["array"]
                m["random"].append({"fn": r["fn"], "key": key})
            for k, r in enumerate(rec["weights"]):
                entry = {"layer": r["layer"], "weight": f"c{cell}_w{k}", "bias": None}
                arrays[entry["weight"]] = r["weight"]
                if r["bias"] is not None:
                    entry["bias"] = f"c{cell}_b{k}"
                    arrays[entry["bias"]] = r["bias"]
                m["weights"].append(entry)
        np.savez(path.with_suffix(".npz"), **arrays)
        path.with_suffix(".json").write_text(json.dumps(meta))

    @staticmethod
    def load(path: Path) -> dict[int, dict[str, list]]:
        np = _np()
        meta = json.loads(path.with_suffix(".json").read_text())
        data = np.load(path.with_suffix(".npz"))
        out: dict[int, dict[str, list]] = {}
        for cell, m in meta.items():
            out[int(cell)] = {
                "random": [{"fn": r["fn"], "array": data[r["key"]]} for r in m["random"]],
                "weights": [
                    {
                        "layer": w["layer"],
                        "weight": data[w["weight"]],
                        "bias": None if w["bias"] is None else data[w["bias"]],
                    }
                    for w in m["weights"]
                ],
            }
        return out


def _shape_of(x: Any) -> str:
    return "None" if x is None else str(tuple(x.shape))


def _called_from_cell(depth: int = 2) -> bool:
    return sys._getframe(depth).f_code.co_filename.startswith("<cell")


def install_ipython_stub() -> None:
    """``IPython.display`` with a ``display`` that shows nothing (both sides)."""
    ipython = types.ModuleType("IPython")
    display_mod = types.ModuleType("IPython.display")

    class Markdown:
        def __init__(self, data: str = "") -> None:
            self.data = data

    display_mod.Markdown = Markdown
    display_mod.display = lambda *a, **k: None
    ipython.display = display_mod
    sys.modules["IPython"] = ipython
    sys.modules["IPython.display"] = display_mod


def setup_brevitas(tape: Tape) -> None:
    """Records the cells' random tensors and every Conv/Linear layer's initial weights."""
    import torch

    def to_np(t: Any) -> Any:
        return t.detach().cpu().numpy().copy()

    def recording(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            out = fn(*a, **k)
            if _called_from_cell():
                tape.record_random(name, to_np(out))
            return out

        return wrapper

    for name in ("randn", "rand", "randint"):
        setattr(torch, name, recording(name, getattr(torch, name)))
    for name in ("uniform_", "normal_"):
        setattr(torch.nn.init, name, recording(name, getattr(torch.nn.init, name)))

    def recording_init(cls: type) -> None:
        orig = cls.__init__

        def init(self: Any, *a: Any, **k: Any) -> None:
            orig(self, *a, **k)
            bias = getattr(self, "bias", None)
            tape.record_weights(
                type(self).__name__, to_np(self.weight), None if bias is None else to_np(bias)
            )

        cls.__init__ = init

    recording_init(torch.nn.modules.conv._ConvNd)
    recording_init(torch.nn.Linear)


def _tensor_methods(jnp: Any, value_of: Any) -> None:
    """Adds TENSOR_METHODS to JAX's concrete array type."""
    array_type = type(jnp.zeros(()))
    orig_view, orig_max, orig_min = array_type.view, array_type.max, array_type.min

    def isclose(self, other, rtol=1e-5, atol=1e-8, equal_nan=False):
        return jnp.isclose(self, value_of(other), rtol=rtol, atol=atol, equal_nan=equal_nan)

    def view(self, *shape):
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        if dims and all(isinstance(d, int) for d in dims):
            return self.reshape(tuple(dims))
        return orig_view(self, *shape)

    def reducer(orig, fn, arg):
        def method(self, *a, dim=None, keepdim=False, **k):
            if dim is None:
                return orig(self, *a, **k)
            return (fn(self, axis=dim, keepdims=keepdim), arg(self, axis=dim, keepdims=keepdim))

        return method

    methods = {
        "isclose": isclose,
        "abs": lambda self: jnp.abs(self),
        "view": view,
        "max": reducer(orig_max, jnp.max, jnp.argmax),
        "min": reducer(orig_min, jnp.min, jnp.argmin),
    }
    assert set(methods) == set(TENSOR_METHODS)
    for name, fn in methods.items():
        setattr(array_type, name, fn)


def install_shim(tape: Tape | None = None) -> types.ModuleType:
    """Installs the torch shim (see the module docstring) as ``torch`` and its submodules."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import qtorchlike
    import qtorchlike.functional as F
    import qtorchlike.nn as qnn

    tape = tape if tape is not None else Tape()
    value_of = F.value

    def size_of(size: tuple, kw: dict) -> tuple[int, ...]:
        s = kw.pop("size", size)
        if len(s) == 1 and isinstance(s[0], tuple | list):
            s = s[0]
        return tuple(int(d) for d in s)

    def as_jnp(a: Any, dtype: Any = None) -> Any:
        return jnp.asarray(a, dtype)

    def randn(*size, **kw):
        shape = size_of(size, kw)
        return as_jnp(
            tape.replay_random("randn", shape, lambda r: r.standard_normal(shape)), jnp.float32
        )

    def rand(*size, **kw):
        shape = size_of(size, kw)
        return as_jnp(tape.replay_random("rand", shape, lambda r: r.random(shape)), jnp.float32)

    def randint(*args, **kw):
        low, high, size = kw.pop("low", 0), kw.pop("high", None), kw.pop("size", None)
        args = list(args)
        if size is None and args and isinstance(args[-1], tuple | list):
            size = args.pop()
        if high is None:
            high = args.pop() if args else None
        if args:
            low = args.pop()
        shape = tuple(size)
        return as_jnp(tape.replay_random("randint", shape, lambda r: r.integers(low, high, shape)))

    def initializer(name: str, draw: Any) -> Any:
        def init(t, *a, **k):
            shape = tuple(t.shape)
            return as_jnp(tape.replay_random(name, shape, draw(shape, *a, **k)), t.dtype)

        return init

    def tensor(data, dtype=None, **kw):
        a = np.asarray(value_of(data))
        if dtype is None and a.dtype == np.float64:
            dtype = jnp.float32
        return jnp.asarray(a, dtype)

    def plain(fn: Any) -> Any:
        def call(*a, **k):
            a = [value_of(x) for x in a]
            k = {n: value_of(x) for n, x in k.items()}
            return fn(*a, **k)

        call.__name__ = getattr(fn, "__name__", "fn")
        return call

    def lookup(prefix: str, sources: list[Any]) -> Any:
        def getattr_(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            for i, src in enumerate(sources):
                if hasattr(src, name):
                    obj = getattr(src, name)
                    # qtorchlike's own functions take QuantTensors; jax's get plain arrays.
                    return (
                        obj if i == 0 or not callable(obj) or isinstance(obj, type) else plain(obj)
                    )
            raise AttributeError(
                f"{SHIM_TAG} no {prefix}.{name}: neither "
                + " nor ".join(getattr(s, "__name__", "?") for s in sources)
                + " has it"
            )

        return getattr_

    def float_layer(base: type) -> type:
        def __init__(self, *a, **k):
            k.setdefault("weight_quant", None)
            base.__init__(self, *a, **k)

        return type(base.__name__.replace("Quant", ""), (base,), {"__init__": __init__})

    torch = types.ModuleType("torch")
    torch.__doc__ = f"{SHIM_TAG} (qtorchlike peer harness)"
    nn = types.ModuleType("torch.nn")
    functional = types.ModuleType("torch.nn.functional")
    init = types.ModuleType("torch.nn.init")
    random = types.ModuleType("torch.random")

    torch.manual_seed = qtorchlike.manual_seed
    random.manual_seed = qtorchlike.manual_seed
    torch.randn, torch.rand, torch.randint, torch.tensor = randn, rand, randint, tensor
    torch.Tensor = jax.Array
    torch.no_grad = contextlib.nullcontext
    torch.__getattr__ = lookup("torch", [F, jnp])

    init.uniform_ = initializer("uniform_", lambda s, a=0.0, b=1.0: lambda r: r.uniform(a, b, s))
    init.normal_ = initializer(
        "normal_", lambda s, mean=0.0, std=1.0: lambda r: r.normal(mean, std, s)
    )
    init.__getattr__ = lookup("torch.nn.init", [])

    nn.Module, nn.Parameter = qnn.Module, qnn.Parameter
    nn.Conv1d = float_layer(qnn.QuantConv1d)
    nn.Conv2d = float_layer(qnn.QuantConv2d)
    nn.Linear = float_layer(qnn.QuantLinear)
    nn.__getattr__ = lookup("torch.nn", [qnn])
    functional.__getattr__ = lookup("torch.nn.functional", [F, jax.nn])

    torch.nn, nn.functional, nn.init, torch.random = nn, functional, init, random
    sys.modules.update(
        {
            "torch": torch,
            "torch.nn": nn,
            "torch.nn.functional": functional,
            "torch.nn.init": init,
            "torch.random": random,
        }
    )
    _tensor_methods(jnp, value_of)

    # Initial weights: a layer's first Parameter assignment under "weight"/"bias".
    orig_setattr = qnn.Module.__setattr__
    param_type = qnn.Parameter

    def setattr_hook(self, name, value):
        if (
            name in ("weight", "bias")
            and isinstance(param_type, type)
            and isinstance(value, param_type)
            and name not in self.__dict__.get("_parameters", {})
        ):
            arr = tape.replay_param(self, name, tuple(value.data.shape))
            if arr is not None:
                value = param_type(jnp.asarray(arr, value.data.dtype), value.requires_grad)
        orig_setattr(self, name, value)

    qnn.Module.__setattr__ = setattr_hook
    return torch


# -- describing values -----------------------------------------------------------------


def _array_struct(x: Any) -> dict | None:
    np = _np()
    if hasattr(x, "detach") and hasattr(x, "numpy"):  # torch
        arr = x.detach().cpu().numpy()
    elif isinstance(x, np.ndarray | np.generic) or (
        hasattr(x, "__array__") and hasattr(x, "shape") and hasattr(x, "dtype")
    ):
        arr = np.asarray(x)
    else:
        return None
    if arr.dtype.kind not in "biuf":
        return None
    flat = arr.astype(np.float64).ravel()
    return {
        "kind": "array",
        "shape": list(arr.shape),
        "dtype": str(arr.dtype),
        "size": int(flat.size),
        "values": flat[:MAX_VALUES].tolist(),
    }


def _flag(v: Any) -> Any:
    if v is None or isinstance(v, bool):
        return v
    with contextlib.suppress(Exception):
        return bool(v.item() if hasattr(v, "item") else v)
    return repr(v)


def describe(v: Any, depth: int = 0) -> dict:
    """A JSON-able structure of ``v`` holding its numbers (see "Comparison")."""
    if v is None:
        return {"kind": "none"}
    if isinstance(v, bool | int | float):
        return {
            "kind": "array",
            "shape": [],
            "dtype": type(v).__name__,
            "size": 1,
            "values": [float(v)],
        }
    if isinstance(v, str):
        return {"kind": "text", "value": v[:5000]}
    if type(v).__name__.endswith("QuantTensor") and hasattr(v, "bit_width"):
        out: dict[str, Any] = {"kind": "quant_tensor", "type": type(v).__name__}
        for f in ("value", "scale", "zero_point", "bit_width"):
            out[f] = _array_struct(getattr(v, f, None)) or {"kind": "none"}
        for f in ("signed", "training"):
            try:
                out[f] = _flag(getattr(v, f))
            except Exception as e:  # noqa: BLE001 - a property that raises
                out[f] = f"<{type(e).__name__}>"
        return out
    if isinstance(v, type):
        return {"kind": "class", "name": v.__name__}
    arr = _array_struct(v)
    if arr is not None:
        return arr
    if isinstance(v, tuple | list) and depth < 4:
        return {
            "kind": "seq",
            "type": type(v).__name__,
            "items": [describe(x, depth + 1) for x in list(v)[:64]],
        }
    if isinstance(v, dict) and depth < 4:
        return {"kind": "dict", "items": {str(k): describe(x, depth + 1) for k, x in v.items()}}
    return {"kind": "object", "type": type(v).__name__}


def _safe_repr(v: Any) -> str:
    try:
        return repr(v)[:3000]
    except Exception as e:  # noqa: BLE001 - any repr failure is reported as such
        return f"<repr failed: {type(e).__name__}: {e}>"


def _exc_info(e: BaseException, fname: str, src: str) -> dict:
    tb = traceback.extract_tb(e.__traceback__)
    cell_line, where = "", ""
    lines = src.splitlines()
    for fr in tb:
        if fr.filename == fname and fr.lineno and fr.lineno <= len(lines):
            cell_line = lines[fr.lineno - 1].strip()
    if tb:
        last = tb[-1]
        where = f"{last.filename}:{last.lineno} in {last.name}"
    return {
        "type": type(e).__name__,
        "qualname": f"{type(e).__module__}.{type(e).__qualname__}",
        "mro": [c.__name__ for c in type(e).__mro__],
        "message": str(e)[:3000],
        "cell_line": cell_line,
        "where": where,
        "traceback": "".join(traceback.format_exception(e)[-6:])[-4000:],
    }


class Missing:
    """Stands for a name a failed ``from ... import`` could not bind (``--keep-going``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<missing {self.name}>"


def _bind_missing(stmt: ast.stmt, ns: dict[str, Any]) -> None:
    """After a failed ``from m import a, b``: binds what exists, a Missing for the rest."""
    if not isinstance(stmt, ast.ImportFrom) or not stmt.module or stmt.level:
        return
    import importlib

    try:
        mod = importlib.import_module(stmt.module)
    except Exception:  # noqa: BLE001 - the whole module is missing
        mod = None
    for alias in stmt.names:
        name = alias.asname or alias.name
        if name not in ns:
            ns[name] = getattr(mod, alias.name, None) or Missing(alias.name)


def _run_cell(src: str, fname: str, ns: dict[str, Any], keep_going: bool) -> dict[str, Any]:
    """One cell, Jupyter-style: statements, then the last expression's value.

    With ``keep_going``, a failing top-level statement does not stop the cell: the
    rest still runs (names a failed import could not bind become ``Missing``), and
    every exception is kept (the first decides the cell's status).
    """
    res: dict[str, Any] = {"ok": True}
    errors: list[dict] = []
    try:
        tree = ast.parse(src, filename=fname)
    except SyntaxError as e:
        return {"ok": False, "exc": _exc_info(e, fname, src)}
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    chunks = [[s] for s in tree.body] if keep_going else [tree.body]
    for chunk in chunks:
        try:
            exec(compile(ast.Module(chunk, []), fname, "exec"), ns)
        except Exception as e:  # noqa: BLE001 - the cell's exception is the result
            errors.append(_exc_info(e, fname, src))
            if not keep_going:
                break
            _bind_missing(chunk[0], ns)
    if last is not None and (keep_going or not errors):
        try:
            value = eval(compile(last, fname, "eval"), ns)
            if value is not None:
                res["value"] = describe(value)
                res["repr"] = _safe_repr(value)
        except Exception as e:  # noqa: BLE001 - the cell's exception is the result
            errors.append(_exc_info(e, fname, src))
    if errors:
        res = {"ok": False, "exc": errors[0], "more_exc": errors[1:]}
    return res


def run_cells(cells: list[str], tape: Tape, result_path: Path, keep_going: bool = False) -> None:
    """Runs ``cells`` in one namespace, Jupyter-style; writes results after every cell."""
    import builtins

    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    results: list[dict] = []
    for i, src in enumerate(cells):
        tape.start(i)
        prints: list[list[dict]] = []

        def cell_print(*args: Any, _prints: list = prints, **kw: Any) -> None:
            _prints.append([describe(a) for a in args])
            builtins.print(*args, **kw)

        ns["print"] = cell_print
        buf = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(buf):
            res = _run_cell(src, f"<cell {i}>", ns, keep_going)
        res["seconds"] = round(time.perf_counter() - t0, 3)
        res["stdout"] = buf.getvalue()[-5000:]
        res["prints"] = prints
        res["notes"] = tape.notes.get(i, [])
        results.append(res)
        result_path.write_text(json.dumps(results))


def worker(side: str, job_path: Path) -> None:
    """Entry point of a notebook run in one interpreter (``--worker``)."""
    job = json.loads(job_path.read_text())
    install_ipython_stub()
    if side == "brevitas":
        tape = Tape()
        setup_brevitas(tape)
    else:
        replay = Tape.load(Path(job["tape"])) if job.get("tape") else None
        tape = Tape(replay)
        install_shim(tape)
    run_cells(job["cells"], tape, Path(job["result"]), job.get("keep_going", False))
    if side == "brevitas":
        tape.save(Path(job["tape_out"]))


# ---------------------------------------------------------------------------------------
# Comparison (pure Python: runs in whatever interpreter runs the harness)
# ---------------------------------------------------------------------------------------


def _close(a: float, b: float, floor: float) -> bool:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return True
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return False
    d = abs(a - b)
    return d <= RTOL * max(abs(a), abs(b)) or d <= floor


def _fmt(x: float) -> str:
    return f"{x:.8g}"


def compare_arrays(b: dict, q: dict) -> str | None:
    """None when equal (see "Comparison"), else the first difference."""
    if b["size"] != q["size"]:
        return f"shape {tuple(b['shape'])} vs {tuple(q['shape'])}"
    bv, qv = b["values"], q["values"]
    finite = [abs(x) for x in bv if not (math.isnan(x) or math.isinf(x))]
    floor = FLOOR * (max(finite) if finite else 0.0)
    bad = [i for i, (x, y) in enumerate(zip(bv, qv, strict=False)) if not _close(x, y, floor)]
    if not bad:
        return None
    i = bad[0]
    shape = (
        f" (shapes {tuple(b['shape'])} vs {tuple(q['shape'])})" if b["shape"] != q["shape"] else ""
    )
    return (
        f"{len(bad)}/{b['size']} values differ, first at flat index {i}: "
        f"{_fmt(bv[i])} vs {_fmt(qv[i])}{shape}"
    )


_NOISE = re.compile(
    r"^(tensor|Array|array|dtype|grad_fn|device|cpu|requires_grad|float16|float32|float64|"
    r"bfloat16|u?int\d+|bool|\w+Backward\d*)$"
)
_TOKEN = re.compile(
    r"(?P<num>(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.]))"
    r"|(?P<word>[A-Za-z_]\w*)"
)


def _tokens(s: str) -> tuple[list[tuple[float, float]], list[str]]:
    nums: list[tuple[float, float]] = []
    words: list[str] = []
    for m in _TOKEN.finditer(s):
        if m.group("num"):
            t = m.group("num")
            mant, _, exp = t.lower().partition("e")
            decimals = len(mant.split(".")[1]) if "." in mant else 0
            step = 0.5 * 10.0 ** (-decimals + (int(exp) if exp else 0))
            nums.append((float(t), step if ("." in mant or exp) else 0.0))
        else:
            w = m.group("word")
            if w in ("True", "False"):
                nums.append((1.0 if w == "True" else 0.0, 0.0))
            elif w in ("nan", "inf"):
                nums.append((float(w), 0.0))
            elif not _NOISE.match(w):
                words.append(w)
    return nums, words


def compare_text(b: str, q: str) -> str | None:
    """Compares numbers (at printed precision) and words; None when equal."""
    if b == q:
        return None
    bn, bw = _tokens(b)
    qn, qw = _tokens(q)
    if bw != qw:
        for i, (x, y) in enumerate(zip(bw, qw, strict=False)):
            if x != y:
                return f"text differs at word {i}: {x!r} vs {y!r}"
        return f"text has {len(bw)} words vs {len(qw)}"
    if len(bn) != len(qn):
        return f"text has {len(bn)} numbers vs {len(qn)}"
    for i, ((x, sx), (y, sy)) in enumerate(zip(bn, qn, strict=True)):
        if not (_close(x, y, 0.0) or abs(x - y) <= max(sx, sy) * 1.001):
            return f"number {i} in text: {_fmt(x)} vs {_fmt(y)}"
    return None


def _kind(v: dict) -> str:
    k = v["kind"]
    if k == "object":
        return f"object {v['type']}"
    if k == "class":
        return f"class {v['name']}"
    if k == "array":
        return f"array{tuple(v['shape'])}"
    return k


def compare_values(b: dict, q: dict) -> str | None:
    """None when ``b`` (Brevitas) and ``q`` (qtorchlike) agree, else the first difference."""
    kb, kq = b["kind"], q["kind"]
    if kb != kq:
        return f"Brevitas gives {_kind(b)}, qtorchlike {_kind(q)}"
    if kb == "array":
        return compare_arrays(b, q)
    if kb == "text":
        return compare_text(b["value"], q["value"])
    if kb == "quant_tensor":
        for f in ("value", "scale", "zero_point", "bit_width"):
            r = compare_values(b[f], q[f])
            if r:
                return f"QuantTensor.{f}: {r}"
        for f in ("signed", "training"):
            if b[f] != q[f]:
                return f"QuantTensor.{f}: {b[f]} vs {q[f]}"
        return None
    if kb == "seq":
        if len(b["items"]) != len(q["items"]):
            return f"{len(b['items'])} items vs {len(q['items'])}"
        for i, (x, y) in enumerate(zip(b["items"], q["items"], strict=True)):
            r = compare_values(x, y)
            if r:
                return f"item {i}: {r}"
        return None
    if kb == "dict":
        if sorted(b["items"]) != sorted(q["items"]):
            return f"keys {sorted(b['items'])} vs {sorted(q['items'])}"
        for k in b["items"]:
            r = compare_values(b["items"][k], q["items"][k])
            if r:
                return f"[{k!r}]: {r}"
        return None
    if kb == "object":
        return None if b["type"] == q["type"] else f"object {b['type']} vs {q['type']}"
    if kb == "class":
        return None if b["name"] == q["name"] else f"class {b['name']} vs {q['name']}"
    return None


def _same_kind(b: dict, q: dict) -> bool:
    base = {"Exception", "BaseException", "object"}
    return b["type"] == q["type"] or bool(
        ({b["type"]} & set(q["mro"]) or {q["type"]} & set(b["mro"])) - base
    )


def _exc_line(e: dict) -> str:
    msg = e["message"].strip().splitlines()[0] if e["message"].strip() else ""
    return f"{e['type']}: {msg}"[:400]


def compare_cell(b: dict, q: dict) -> tuple[str, str]:
    """(status, reason) of one cell; see the module docstring."""
    if b["ok"] and q["ok"]:
        reason = None
        if len(b["prints"]) != len(q["prints"]):
            reason = f"printed {len(b['prints'])} times vs {len(q['prints'])}"
        else:
            for i, (pb, pq) in enumerate(zip(b["prints"], q["prints"], strict=True)):
                r = compare_values({"kind": "seq", "items": pb}, {"kind": "seq", "items": pq})
                if r:
                    reason = f"print #{i}: {r}"
                    break
        if reason is None:
            bv, qv = b.get("value", {"kind": "none"}), q.get("value", {"kind": "none"})
            r = compare_values(bv, qv)
            if r:
                reason = f"value: {r}"
        return ("match", "") if reason is None else ("differ", reason)
    if not b["ok"] and not q["ok"]:
        be, qe = b["exc"], q["exc"]
        if _same_kind(be, qe):
            return "both-fail", f"both raise {qe['type']}"
        return "differ", f"Brevitas raises {_exc_line(be)} | qtorchlike raises {_exc_line(qe)}"
    if b["ok"]:
        return "fail", _exc_line(q["exc"])
    return "differ", f"Brevitas raises {_exc_line(b['exc'])}; qtorchlike does not"


def harness_suspect(q: dict) -> str:
    """Why a qtorchlike failure may be the harness' rather than qtorchlike's ('' if not)."""
    if q.get("ok", True):
        return ""
    e = q["exc"]
    text = e["message"] + e["traceback"]
    if SHIM_TAG in text:
        return "torch shim has no counterpart"
    if "ArrayImpl' object has no attribute" in text:
        return "torch Tensor method on a JAX array"
    if "does not support item assignment" in text or "immutable" in text:
        return "in-place update of a JAX array"
    return ""


# ---------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------


def bound_names(src: str) -> set[str]:
    """Top-level names a cell binds (assignments, defs, classes, imports)."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _missing_name(exc: dict) -> str | None:
    """The name of a NameError ("name 'x' is not defined"), else None."""
    m = re.search(r"name '(\w+)' is not defined", exc["message"])
    return m.group(1) if m and exc["type"] == "NameError" else None


def mark_blocked(rows: list[dict]) -> None:
    """Sets ``blocked_by`` on cells whose qtorchlike NameError comes from an earlier failure.

    The blocking cell is the latest earlier cell that binds the missing name and raised in
    qtorchlike; ``root`` follows the chain back to the first such cell.
    """
    for r in rows:
        r["blocked_by"] = r["root"] = None
        q = r["qtorchlike"]
        name = None if r["status"] in ("match", "both-fail") or q["ok"] else _missing_name(q["exc"])
        if name is None:
            continue
        for prev in reversed(rows[: r["cell"]]):
            if name in bound_names(prev["translated_source"]):
                if not prev["qtorchlike"]["ok"]:
                    r["blocked_by"] = prev["cell"]
                    r["root"] = prev["root"] if prev["root"] is not None else prev["cell"]
                    r["reason"] = f"blocked by cell {prev['cell']} ({r['reason']})"
                break


def _env(jax_cache: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "JAX_PLATFORMS": "cpu",
            "PYTHONHASHSEED": "0",
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    if jax_cache is not None:
        # qtorchlike compiles every eager op; JAX's persistent cache makes re-runs fast.
        env.update(
            {
                "JAX_COMPILATION_CACHE_DIR": str(jax_cache),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
            }
        )
    return env


def run_worker(
    python: str, side: str, job: dict, workdir: Path, log: Path, env: dict[str, str]
) -> list[dict]:
    """Runs one notebook in ``python``; returns the per-cell results (padded on a crash)."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path = workdir / f"{side}-job.json"
    job_path.write_text(json.dumps(job))
    result = Path(job["result"])
    result.unlink(missing_ok=True)
    cmd = [python, str(HERE), "--worker", side, str(job_path)]
    try:
        proc = subprocess.run(
            cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT
        )
        log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        crash = f"worker exited with {proc.returncode}: {proc.stderr.strip()[-500:]}"
        failed = proc.returncode != 0
    except subprocess.TimeoutExpired:
        crash, failed = f"worker timed out after {WORKER_TIMEOUT}s", True
    results = json.loads(result.read_text()) if result.exists() else []
    if failed or len(results) < len(job["cells"]):
        exc = {
            "type": "HarnessError",
            "qualname": "HarnessError",
            "mro": ["HarnessError"],
            "message": crash,
            "cell_line": "",
            "where": "",
            "traceback": "",
        }
        while len(results) < len(job["cells"]):
            results.append({"ok": False, "exc": exc, "prints": [], "stdout": "", "notes": []})
    return results


def cache_key(*parts: str) -> str:
    """A hash of this file and ``parts``."""
    h = hashlib.sha256(HERE.read_bytes())
    for p in parts:
        h.update(b"\0" + p.encode())
    return h.hexdigest()[:16]


def run_notebook(nb: str, text: str, args: argparse.Namespace, out: Path) -> dict:
    """Both sides of one notebook, compared."""
    cells = code_cells(text)
    translated = [translate_cell(nb, i, c) for i, c in enumerate(cells)]
    bpy = str(Path(args.brevitas_python).absolute())
    bdir = out / "cache" / f"brevitas-{nb}-{cache_key(text, bpy)}"
    bres_path = bdir / "result.json"
    tape = bdir / "tape"
    t0 = time.perf_counter()
    cached = bres_path.exists() and tape.with_suffix(".npz").exists() and not args.no_cache
    if cached:
        bres = json.loads(bres_path.read_text())
    else:
        if bdir.exists():
            shutil.rmtree(bdir)
        job = {"cells": cells, "result": str(bres_path), "tape_out": str(tape)}
        bres = run_worker(bpy, "brevitas", job, bdir / "work", bdir / "log.txt", _env())
        if any(r.get("exc", {}).get("type") == "HarnessError" for r in bres):
            bres_path.unlink(missing_ok=True)  # never cache a crashed run
    tb = time.perf_counter() - t0
    qdir = out / "qtorchlike" / nb
    if qdir.exists():
        shutil.rmtree(qdir)
    job = {
        "cells": translated,
        "result": str(qdir / "result.json"),
        "tape": str(tape) if tape.with_suffix(".npz").exists() else None,
        "keep_going": args.keep_going,
    }
    env = _env(out / "cache" / "jax")
    qres = run_worker(args.qtorchlike_python, "qtorchlike", job, qdir, qdir / "log.txt", env)
    tq = time.perf_counter() - t0 - tb
    rows = []
    for i, (src, tsrc, b, q) in enumerate(zip(cells, translated, bres, qres, strict=True)):
        status, reason = compare_cell(b, q)
        notes = q.get("notes", [])
        # --keep-going: later exceptions, less NameErrors for names this cell binds.
        bound = bound_names(tsrc)
        more = [e for e in q.get("more_exc", []) if _missing_name(e) not in bound]
        if more and status != "match":
            reason += " [then: " + "; ".join(_exc_line(e) for e in more) + "]"
        if notes and status != "match":
            reason += f" [replay: {'; '.join(notes)}]"
        rows.append(
            {
                "cell": i,
                "status": status,
                "reason": reason,
                "first_line": first_line(src),
                "harness_suspect": harness_suspect(q) if status != "match" else "",
                "translated": tsrc != src,
                "source": src,
                "translated_source": tsrc,
                "brevitas": b,
                "qtorchlike": q,
            }
        )
    mark_blocked(rows)
    return {
        "notebook": nb,
        "path": NOTEBOOKS[nb],
        "cells": rows,
        "seconds": {"brevitas": round(tb, 1), "qtorchlike": round(tq, 1), "cached": cached},
    }


def _pytest_path(args: argparse.Namespace, tmp: Path) -> str | None:
    """A PYTHONPATH giving the Brevitas interpreter pytest, if it lacks it ('' if it has it)."""
    has = subprocess.run(
        [args.brevitas_python, "-c", "import pytest"], capture_output=True, env=_env()
    )
    if has.returncode == 0:
        return ""
    probe = (
        "import sys, importlib\n"
        "print(f'{sys.version_info[0]}.{sys.version_info[1]}')\n"
        "for m in ('pytest', '_pytest', 'pluggy', 'iniconfig', 'pygments', 'py'):\n"
        "    print(importlib.import_module(m).__file__)\n"
    )
    out = subprocess.run(
        [args.qtorchlike_python, "-c", probe], capture_output=True, text=True, env=_env()
    )
    ver = subprocess.run(
        [
            args.brevitas_python,
            "-c",
            "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')",
        ],
        capture_output=True,
        text=True,
    )
    lines = out.stdout.split()
    if out.returncode or not lines or lines[0] != ver.stdout.strip():
        return None
    site = tmp / "pytest-site"
    site.mkdir(exist_ok=True)
    for f in map(Path, lines[1:]):
        src = f.parent if f.name == "__init__.py" else f
        with contextlib.suppress(FileExistsError):
            (site / src.name).symlink_to(src)
    return str(site)


CONFTEST = """\
import importlib.util

_spec = importlib.util.spec_from_file_location("qtorchlike_peer_harness", {path!r})
_harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_harness)
_harness.install_ipython_stub()
_harness.install_shim()
"""


def run_pytest(
    python: str, files: dict[str, str], workdir: Path, env: dict[str, str], extra_path: str = ""
) -> dict:
    """Runs pytest on ``files`` (name -> text) in ``workdir``; outcome per test id."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "pytest.ini").write_text("[pytest]\n")
    for name, text in files.items():
        (workdir / f"{name}.py").write_text(text)
    xml = workdir / "junit.xml"
    env = dict(env)
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    cmd += [f"{n}.py" for n in files]
    proc = subprocess.run(
        cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT
    )
    (workdir / "log.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    tests: dict[str, dict] = {}
    if not xml.exists():
        return {"error": proc.stdout[-2000:] + proc.stderr[-2000:], "tests": tests}
    for case in ET.parse(xml).getroot().iter("testcase"):
        cls = case.get("classname", "")
        test_id = f"{cls.split('.')[0]}::{'::'.join(cls.split('.')[1:] + [case.get('name', '')])}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "").strip()
                break
        tests[test_id] = {"outcome": outcome, "message": message[:2000]}
    return {"error": "", "tests": tests}


def run_tests(sources: dict[str, str], args: argparse.Namespace, out: Path) -> dict:
    """Both sides of the test files: per-test outcomes."""
    bpy = str(Path(args.brevitas_python).absolute())
    key = cache_key(*sources.values(), bpy)
    bdir = out / "cache" / f"brevitas-tests-{key}"
    cache = bdir / "outcomes.json"
    t0 = time.perf_counter()
    if cache.exists() and not args.no_cache:
        bres = json.loads(cache.read_text())
    else:
        if bdir.exists():
            shutil.rmtree(bdir)
        bdir.mkdir(parents=True)
        extra = _pytest_path(args, bdir)
        if extra is None:
            bres = {"error": "no pytest in the Brevitas interpreter", "tests": {}}
        else:
            bres = run_pytest(bpy, sources, bdir / "work", _env(), extra)
            if bres["tests"]:
                cache.write_text(json.dumps(bres))
    qdir = out / "qtorchlike" / "tests"
    if qdir.exists():
        shutil.rmtree(qdir)
    qdir.mkdir(parents=True)
    (qdir / "conftest.py").write_text(CONFTEST.format(path=str(HERE)))
    translated = {n: translate(t) for n, t in sources.items()}
    qres = run_pytest(args.qtorchlike_python, translated, qdir, _env(out / "cache" / "jax"))
    rows = []
    for test_id, b in bres["tests"].items():
        q = qres["tests"].get(test_id)
        if q is None:
            q = {"outcome": "missing", "message": qres["error"][-1000:] or "not collected"}
        rows.append({"test": test_id, "brevitas": b, "qtorchlike": q})
    return {
        "tests": rows,
        "brevitas_error": bres["error"],
        "qtorchlike_error": qres["error"],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _short(msg: str, n: int = 300) -> str:
    lines = [ln for ln in msg.strip().splitlines() if ln.strip()]
    # pytest's junit message is "ExcType: text"; keep the first meaningful line.
    return (lines[0] if lines else "")[:n]


def summarise(report: dict) -> str:
    """The printed summary (and the head of report.md)."""
    out = ["(keep-going mode: not Jupyter's behaviour)"] if report["keep_going"] else []
    total = {"match": 0, "cells": 0}
    for nb in report["notebooks"]:
        rows = nb["cells"]
        count = {
            s: sum(r["status"] == s for r in rows) for s in ("match", "both-fail", "differ", "fail")
        }
        ok = count["match"] + count["both-fail"]
        total["match"] += ok
        total["cells"] += len(rows)
        blocked = sum(r["blocked_by"] is not None for r in rows)
        out.append(
            f"notebook {nb['notebook']}: {ok}/{len(rows)} match"
            + (f" ({count['both-fail']} both-fail)" if count["both-fail"] else "")
            + f", {count['differ']} differ, {count['fail']} fail"
            + (f" ({blocked} of the non-matching blocked by an earlier cell)" if blocked else "")
        )
    out.append(f"notebooks total: {total['match']}/{total['cells']} match")
    t = report["tests"]
    passed = sum(r["qtorchlike"]["outcome"] == "passed" for r in t["tests"])
    bpassed = sum(r["brevitas"]["outcome"] == "passed" for r in t["tests"])
    out.append(f"tests: {passed}/{len(t['tests'])} pass in qtorchlike ({bpassed} in Brevitas)")
    if t["brevitas_error"]:
        out.append(f"  Brevitas pytest: {_short(t['brevitas_error'])}")
    out.append("")
    out.append("non-matching cells:")
    for nb in report["notebooks"]:
        for r in nb["cells"]:
            if r["status"] in ("match", "both-fail"):
                continue
            suspect = f" [harness? {r['harness_suspect']}]" if r["harness_suspect"] else ""
            out.append(
                f"  {nb['notebook']} cell {r['cell']} {r['status']}: `{r['first_line']}` -> "
                f"{r['reason']}{suspect}"
            )
            q = r["qtorchlike"]
            if not q["ok"] and q["exc"]["cell_line"] and q["exc"]["cell_line"] != r["first_line"]:
                out.append(f"      at `{q['exc']['cell_line']}`")
    out.append("failing tests:")
    for r in t["tests"]:
        if r["qtorchlike"]["outcome"] != "passed":
            out.append(
                f"  {r['test']}: {r['qtorchlike']['outcome']}: {_short(r['qtorchlike']['message'])}"
            )
    return "\n".join(out)


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")[:300]


def write_markdown(report: dict, path: Path) -> None:
    """report.md: the summary, then a table per notebook and one for the tests."""
    lines = ["# qtorchlike vs Brevitas: tutorial notebooks and tests", ""]
    lines += ["```", summarise(report), "```", ""]
    for nb in report["notebooks"]:
        lines += [f"## notebook {nb['notebook']} ({nb['path']})", ""]
        lines += ["| cell | status | first line | reason |", "| --- | --- | --- | --- |"]
        for r in nb["cells"]:
            lines.append(
                f"| {r['cell']} | {r['status']} | `{_md_cell(r['first_line'])}` | "
                f"{_md_cell(r['reason'])} |"
            )
        lines.append("")
    lines += [
        "## tests",
        "",
        "| test | Brevitas | qtorchlike | message |",
        "| --- | --- | --- | --- |",
    ]
    for r in report["tests"]["tests"]:
        lines.append(
            f"| {r['test']} | {r['brevitas']['outcome']} | {r['qtorchlike']['outcome']} | "
            f"{_md_cell(_short(r['qtorchlike']['message']))} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """The CLI (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--brevitas-repo", type=Path, help="Brevitas checkout or git dir")
    p.add_argument("--rev", default="HEAD", help="revision to read from a git dir")
    p.add_argument("--brevitas-python", default="/tmp/brev/bin/python")
    p.add_argument(
        "--qtorchlike-python",
        default=str(REPO_ROOT / ".nox" / "tests-qtorchlike" / "bin" / "python"),
    )
    p.add_argument("--out", type=Path, help="directory for the report and caches")
    p.add_argument("--no-cache", action="store_true", help="re-run the Brevitas side too")
    p.add_argument("--jobs", type=int, default=3, help="subprocesses at once")
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="qtorchlike side: run a failing cell's remaining statements too, binding names "
        "a failed import misses to placeholders (finds gaps hidden behind earlier ones; "
        "not Jupyter's behaviour)",
    )
    p.add_argument("--worker", nargs=2, metavar=("SIDE", "JOB"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return 0
    if args.brevitas_repo is None or args.out is None:
        p.error("--brevitas-repo and --out are required")
    t0 = time.perf_counter()
    # Absolute (not resolved: a venv's python is a symlink); workers run in other dirs.
    args.brevitas_python = str(Path(args.brevitas_python).absolute())
    args.qtorchlike_python = str(Path(args.qtorchlike_python).absolute())
    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    nb_text = {
        nb: read_source(args.brevitas_repo, path, args.rev) for nb, path in NOTEBOOKS.items()
    }
    test_text = {
        n: read_source(args.brevitas_repo, path, args.rev) for n, path in TEST_FILES.items()
    }
    with ThreadPoolExecutor(args.jobs) as pool:
        tests = pool.submit(run_tests, test_text, args, out)
        nbs = [pool.submit(run_notebook, nb, text, args, out) for nb, text in nb_text.items()]
        report = {
            "brevitas_repo": str(args.brevitas_repo),
            "rev": args.rev,
            "keep_going": args.keep_going,
            "rules": [{"pattern": a, "replacement": b, "why": c} for a, b, c in RULES],
            "hand_edits": [
                {"cell": f"{k[0]}:{k[1]}", "old": v[0], "new": v[1], "why": v[2]}
                for k, v in HAND_EDITS.items()
            ],
            "notebooks": [f.result() for f in nbs],
            "tests": tests.result(),
        }
    report["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    write_markdown(report, out / "report.md")
    print(summarise(report))
    print(f"\n{report['seconds']}s; report: {out / 'report.md'}, {out / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

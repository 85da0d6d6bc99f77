"""Quantized checkpoints: orbax directories and safetensors files, crash-safe.

:func:`save` writes params (quantized or not) with orbax-checkpoint, plus the
rules in ``qflax.json``; :func:`load` restores them into the structure of abstract
quantized params (``jax.eval_shape`` of the PTQ model's ``init``) or into an
abstract NNX PTQ model (``nnx.eval_shape(lambda: quantize_model(...))``), so a
prequantized checkpoint loads without the float weights ever existing.
:func:`load_rules` gives the rules back.

Saving never touches an existing checkpoint until the new one is complete: it is
written next to the target and moved into place at the end. A save that fails or
is killed leaves the previous checkpoint loadable (if a kill lands between the two
renames of the final swap, :func:`load` finds the previous one under
``<directory>.old-*``).

:func:`export_safetensors` / :func:`import_safetensors` use one flat file whose
entries are ``<param path>.qvalue``, ``.scale``, ``.zero_point``, ``.tensor_scale``
for quantized params (``<path>.scale`` for static activation scales, ``<path>``
for float ones). Dtypes safetensors cannot name (bfloat16, float8, e8m0...) are
stored as their raw bits with the dtype in the file's metadata.

Needs the ``checkpoint`` extra: ``pip install "jaxquant-qflax[checkpoint]"``
(orbax-checkpoint, safetensors).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qflax.rule import QuantizationRule

RULES_FILE = "qflax.json"
FORMAT = "qflax-checkpoint-1"


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp  # noqa: PLC0415 - optional dependency
    except ImportError as err:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "qflax.checkpoint needs orbax-checkpoint: pip install 'jaxquant-qflax[checkpoint]'"
        ) from err
    return ocp


def rules_to_json(rules: list[QuantizationRule] | tuple[QuantizationRule, ...]) -> list[dict]:
    """JSON-able form of rules (qtypes by name).

    Raises:
        ValueError: For a rule whose ``module_path`` is a callable.
    """
    out = []
    for i, rule in enumerate(rules):
        if callable(rule.module_path):
            raise ValueError(
                f"rules[{i}].module_path is a callable; only regex strings can be saved"
            )
        d = {}
        for field in (
            "module_path",
            "op_names",
            "weight_qtype",
            "act_qtype",
            "tile_size",
            "act_static_scale",
            "weight_calibration_method",
            "act_calibration_method",
            "act_batch_axes",
            "rotation",
            "rotation_seed",
        ):
            value = getattr(rule, field)
            if field.endswith("qtype") and value is not None and not isinstance(value, str):
                value = value.name
            if field == "tile_size" and isinstance(value, tuple):
                value = {"axes": [list(p) for p in value]}
            d[field] = list(value) if isinstance(value, tuple) else value
        out.append(d)
    return out


def rules_from_json(data: list[dict]) -> list[QuantizationRule]:
    """Inverse of :func:`rules_to_json`."""
    rules = []
    for d in data:
        d = dict(d)
        tile = d.get("tile_size")
        if isinstance(tile, dict):
            d["tile_size"] = {int(a): t for a, t in tile["axes"]}
        rules.append(QuantizationRule(**d))
    return rules


def save(
    directory: str | os.PathLike,
    params: Any,
    *,
    rules: list[QuantizationRule] | tuple[QuantizationRule, ...] | None = None,
) -> Path:
    """Saves ``params`` (any pytree of arrays and QuantizedParams) and ``rules``.

    Args:
        directory: The checkpoint directory; an existing checkpoint there is
            replaced only once the new one is complete.
        params: Params (boxed Linen params are saved unboxed), or an NNX model
            (its state is saved as a pure dict).
        rules: The rules that quantized them, for :func:`load_rules`.

    Returns:
        The checkpoint directory.
    """
    ocp = _orbax()
    target = Path(directory).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    tree = _pure(params)
    meta = {"format": FORMAT, "rules": None if rules is None else rules_to_json(rules)}
    tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "params", tree)
        checkpointer.wait_until_finished()
        (tmp / RULES_FILE).write_text(json.dumps(meta, indent=1))
        old = None
        if target.exists():
            old = target.with_name(f"{target.name}.old-{uuid.uuid4().hex[:8]}")
            target.rename(old)
        tmp.rename(target)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _resolve(directory: str | os.PathLike) -> Path:
    target = Path(directory).absolute()
    if (target / RULES_FILE).exists():
        return target
    previous = sorted(target.parent.glob(f"{target.name}.old-*"), key=lambda p: p.stat().st_mtime)
    previous = [p for p in previous if (p / RULES_FILE).exists()]
    if previous:
        warnings.warn(
            f"{target} is missing; loading the previous checkpoint {previous[-1]} (a save "
            "was interrupted while swapping it in)",
            UserWarning,
            stacklevel=3,
        )
        return previous[-1]
    raise FileNotFoundError(f"directory={str(directory)!r} holds no qflax checkpoint")


def load(directory: str | os.PathLike, abstract: Any) -> Any:
    """Restores a checkpoint into the structure of ``abstract``.

    Args:
        directory: A directory written by :func:`save`.
        abstract: Abstract params of the model that will use them (e.g.
            ``jax.eval_shape(qmodel.init, key, x)["params"]``; boxed allowed; leaves
            with a ``sharding`` are restored sharded), or an abstract NNX model.

    Returns:
        The params (unboxed), or for an NNX ``abstract`` the model with them.
    """
    ocp = _orbax()
    path = _resolve(directory)
    if isinstance(abstract, nnx.Module):
        graphdef, state = nnx.split(abstract)
        restored = ocp.StandardCheckpointer().restore(path / "params", nnx.to_pure_dict(state))
        nnx.replace_by_pure_dict(state, restored)
        return nnx.merge(graphdef, state)
    return ocp.StandardCheckpointer().restore(path / "params", _pure(abstract))


def load_rules(directory: str | os.PathLike) -> list[QuantizationRule] | None:
    """The rules saved with a checkpoint (None if it was saved without)."""
    meta = json.loads((_resolve(directory) / RULES_FILE).read_text())
    return None if meta["rules"] is None else rules_from_json(meta["rules"])


def _pure(tree: Any) -> Any:
    if isinstance(tree, nnx.Module):
        return nnx.to_pure_dict(nnx.state(tree))
    return nn.meta.unbox(tree)


# -- safetensors ---------------------------------------------------------------


def _key(path: tuple) -> str:
    """``Dense_0/kernel.qvalue`` from a pytree key path."""
    parts, attrs = [], []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            if k.name not in ("qarray", "value"):
                attrs.append(k.name)
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(k))
    return "/".join(parts) + "".join(f".{a}" for a in attrs)


_NATIVE = {"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
           "float16", "float32", "float64"}  # fmt: skip


def export_safetensors(
    file: str | os.PathLike,
    params: Any,
    *,
    rules: list[QuantizationRule] | tuple[QuantizationRule, ...] | None = None,
) -> Path:
    """Writes params to one safetensors file (written aside, then renamed into place)."""
    from safetensors.numpy import save_file  # noqa: PLC0415 - optional dependency

    leaves = jax.tree_util.tree_flatten_with_path(_pure(params))[0]
    tensors, dtypes = {}, {}
    for path, leaf in leaves:
        key = _key(path)
        a = np.asarray(jax.device_get(leaf))
        if a.dtype.name not in _NATIVE:
            dtypes[key] = a.dtype.name
            a = a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))
        tensors[key] = np.array(a, order="C")  # ascontiguousarray would make 0-d 1-d
    meta = {"format": FORMAT, "dtypes": dtypes,
            "rules": None if rules is None else rules_to_json(rules)}  # fmt: skip
    target = Path(file).absolute()
    tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        save_file(tensors, str(tmp), metadata={"qflax": json.dumps(meta)})
        tmp.replace(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def import_safetensors(file: str | os.PathLike, abstract: Any) -> Any:
    """Reads a file written by :func:`export_safetensors` into ``abstract``'s structure.

    Raises:
        ValueError: For a missing entry or one whose shape or dtype differs from
            the abstract params (naming the entry and both).
    """
    from safetensors import safe_open  # noqa: PLC0415 - optional dependency

    model = abstract if isinstance(abstract, nnx.Module) else None
    leaves, treedef = jax.tree_util.tree_flatten_with_path(_pure(abstract))
    out = []
    with safe_open(str(file), framework="numpy") as f:
        meta = json.loads((f.metadata() or {}).get("qflax", "{}"))
        dtypes = meta.get("dtypes", {})
        names = set(f.keys())
        for path, want in leaves:
            key = _key(path)
            if key not in names:
                raise ValueError(f"{file}: entry {key!r} is missing")
            a = f.get_tensor(key)
            if key in dtypes:
                a = a.view(jnp.dtype(dtypes[key]))
            if a.shape != tuple(want.shape) or a.dtype != want.dtype:
                raise ValueError(
                    f"{file}: entry {key!r} is {a.dtype}{list(a.shape)}, the model expects "
                    f"{want.dtype}{list(want.shape)}"
                )
            out.append(jnp.asarray(a))
    restored = jax.tree_util.tree_unflatten(treedef, out)
    if model is None:
        return restored
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


def load_safetensors_rules(file: str | os.PathLike) -> list[QuantizationRule] | None:
    """The rules stored in a safetensors file's metadata (None if none)."""
    from safetensors import safe_open  # noqa: PLC0415 - optional dependency

    with safe_open(str(file), framework="numpy") as f:
        meta = json.loads((f.metadata() or {}).get("qflax", "{}"))
    rules = meta.get("rules")
    return None if rules is None else rules_from_json(rules)

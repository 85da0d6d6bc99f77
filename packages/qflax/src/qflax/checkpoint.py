"""Quantized checkpoints: orbax directories and safetensors files, crash-safe.

:func:`save` writes params (quantized or not) with orbax-checkpoint, plus the
rules and a sha256 digest of every param in ``qflax.json``; :func:`load` checks
the digests and restores them into the structure of abstract
quantized params (``jax.eval_shape`` of the PTQ model's ``init``) or into an
abstract NNX PTQ model (``nnx.eval_shape(lambda: quantize_model(...))``), so a
prequantized checkpoint loads without the float weights ever existing.
:func:`load_rules` gives the rules back.

Writing never destroys anything: a checkpoint (or file) is written next to the
target and moved into place at the end. Only a previous output of the same writer
is replaced, and only with ``overwrite=True``; anything else at the path (a
directory or file of yours, a checkpoint with files added) is a ``FileExistsError``
that leaves it untouched. A save that fails leaves the directory as it was, with
no temporary; a save that is killed leaves the previous checkpoint loadable (if a
kill lands between the two renames of the final swap, :func:`load` finds the
previous one under ``<directory>.old-*``).

:func:`export_safetensors` / :func:`import_safetensors` use one flat file whose
entries are ``<param path>.qvalue``, ``.scale``, ``.zero_point``, ``.tensor_scale``
for quantized params (``<path>.scale`` for static activation scales, ``<path>``
for float ones). Dtypes safetensors cannot name (bfloat16, float8, e8m0...) are
stored as their raw bits with the dtype in the file's metadata, next to a sha256
digest of every entry that :func:`import_safetensors` checks.

A damaged checkpoint, or one that does not fit the model, raises
:class:`CheckpointError` naming the file and the entry (param path or rule).

Needs the ``checkpoint`` extra: ``pip install "jaxquant-qflax[checkpoint]"``
(orbax-checkpoint, safetensors).
"""

from __future__ import annotations

import hashlib
import json
import os
import reprlib
import warnings
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qflax import _files
from qflax.rule import QuantizationRule

RULES_FILE = "qflax.json"
FORMAT = "qflax-checkpoint-1"
_CHECKPOINT = "qflax checkpoint"
_SAFETENSORS = "qflax safetensors file"


class CheckpointError(ValueError):
    """A checkpoint or safetensors file that is damaged or does not fit the model.

    The message names the file or directory and the entry: the param path (with
    the saved and expected dtype and shape), the safetensors entry whose digest
    does not match, or the rule (``rules[i]``) that cannot be read.
    """


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
        TypeError: If ``rules`` is not a list or tuple of QuantizationRule.
        ValueError: For a rule whose ``module_path`` is a callable.
    """
    if not isinstance(rules, list | tuple):
        raise TypeError(f"rules={rules!r} is a {type(rules).__name__}; allowed: a list of "
                        "QuantizationRule (or None)")  # fmt: skip
    for i, rule in enumerate(rules):
        if not isinstance(rule, QuantizationRule):
            raise TypeError(f"rules[{i}]={rule!r} is a {type(rule).__name__}; allowed: "
                            "QuantizationRule")  # fmt: skip
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
    """Inverse of :func:`rules_to_json`.

    Raises:
        ValueError: If ``data`` is not a list, or naming the entry (``rules[i]``)
            that is not a valid rule.
    """
    if not isinstance(data, list):
        raise ValueError(f"rules must be a list of rule dicts, got {type(data).__name__} {data!r}")
    rules = []
    for i, d in enumerate(data):
        if not isinstance(d, dict):
            raise ValueError(f"rules[{i}] is {d!r} (a {type(d).__name__}), not a rule dict")
        try:
            d = dict(d)
            tile = d.get("tile_size")
            if isinstance(tile, dict):
                d["tile_size"] = {int(a): t for a, t in tile["axes"]}
            rules.append(QuantizationRule(**d))
        except (TypeError, ValueError, KeyError) as err:
            raise ValueError(f"rules[{i}] is not a valid rule: {err}") from err
    return rules


def _rules(meta: dict, file: Path) -> list[QuantizationRule] | None:
    try:
        return None if meta.get("rules") is None else rules_from_json(meta["rules"])
    except ValueError as err:
        raise CheckpointError(f"{file}: {err}") from err


def _check_format(meta: Any, where: str) -> dict:
    found = meta.get("format") if isinstance(meta, dict) else meta
    if found != FORMAT:
        raise CheckpointError(
            f"{where}: format {found!r} is not {FORMAT!r} (written by another version of "
            "qflax, or damaged)"
        )
    return meta


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _leaves(params: Any, tree: Any) -> list[tuple[str, Any]]:
    """``(entry key, leaf)`` of the pure tree of ``params``, checked for writing."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if jax.tree_util.treedef_is_leaf(treedef) and leaves:
        raise TypeError(
            f"params={reprlib.repr(params)} is a {type(params).__name__}; allowed: "
            "a pytree (e.g. a dict) of arrays and QuantizedParams, or an NNX model"
        )
    if not leaves:
        raise ValueError(f"params={reprlib.repr(params)} has no arrays; there is nothing to write")
    seen: dict[str, tuple] = {}
    for path, leaf in leaves:
        if not isinstance(leaf, _ARRAY_TYPES):
            raise TypeError(
                f"params leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__} "
                f"({reprlib.repr(leaf)}); allowed: arrays (jax or numpy) and numbers"
            )
        key = _key(path)
        if key in seen:
            raise ValueError(
                f"params {jax.tree_util.keystr(seen[key])} and {jax.tree_util.keystr(path)} map "
                f"to the same entry {key!r}; rename one of them"
            )
        seen[key] = path
    return [(_key(path), leaf) for path, leaf in leaves]


def _digest(leaf: Any) -> str:
    return hashlib.sha256(np.asarray(jax.device_get(leaf)).tobytes()).hexdigest()


def save(
    directory: str | os.PathLike,
    params: Any,
    *,
    rules: list[QuantizationRule] | tuple[QuantizationRule, ...] | None = None,
    overwrite: bool = False,
) -> Path:
    """Saves ``params`` (any pytree of arrays and QuantizedParams) and ``rules``.

    The checkpoint is written next to ``directory`` and renamed into place once
    complete; missing parent directories are created.

    Args:
        directory: The checkpoint directory: a free path, an empty directory, or
            (with ``overwrite=True``) a checkpoint written by this function.
        params: Params (boxed Linen params are saved unboxed), or an NNX model
            (its state is saved as a pure dict).
        rules: The rules that quantized them, for :func:`load_rules`.
        overwrite: Whether a previous checkpoint at ``directory`` may be replaced
            (it is deleted only after the new one is in place).

    Returns:
        The checkpoint directory.

    Raises:
        FileExistsError: If ``directory`` holds anything else (a file, a directory
            that is not a checkpoint, a checkpoint with other files added), or a
            checkpoint and ``overwrite`` is False; it is left untouched.
        TypeError: If ``params`` is not a pytree of arrays (naming the leaf), or
            ``rules`` not a list of QuantizationRule.
        ValueError: If ``params`` has no arrays, or two of its paths map to the
            same entry (e.g. ``{"a/b": x, "a": {"b": y}}``).
    """
    ocp = _orbax()
    target = Path(directory).absolute()
    tree = _pure(params)
    meta = {"format": FORMAT, "rules": None if rules is None else rules_to_json(rules),
            "sha256": {key: _digest(leaf) for key, leaf in _leaves(params, tree)}}  # fmt: skip
    _files.check_target(target, "directory", overwrite=overwrite, what=_CHECKPOINT,
                        problem=_not_a_checkpoint, directory=True)  # fmt: skip
    with _files.new_directory(target, "directory", _CHECKPOINT) as tmp:
        checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())  # synchronous
        try:
            checkpointer.save(tmp / "params", tree)
        finally:
            checkpointer.close()
        _files.write_new(tmp / RULES_FILE, json.dumps(meta, indent=1).encode())
    return target


def _not_a_checkpoint(path: Path) -> str | None:
    """Why ``path`` is not a checkpoint written by :func:`save` (None if it is one)."""
    if not path.is_dir():
        return "it is a file"
    try:
        _read_meta(path)
    except (CheckpointError, OSError):
        return f"it has no valid {RULES_FILE}"
    others = sorted(p.name for p in path.iterdir() if p.name not in (RULES_FILE, "params"))
    return f"it also holds {others}" if others else None


def _read_meta(directory: Path) -> dict:
    file = directory / RULES_FILE
    try:
        meta = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{file} is damaged: it is not UTF-8 JSON ({err})") from err
    return _check_format(meta, str(file))


def _resolve(directory: str | os.PathLike) -> Path:
    target = Path(directory).absolute()
    if (target / RULES_FILE).is_file():
        return target
    previous = sorted(target.parent.glob(f"{target.name}.old-*"), key=lambda p: p.stat().st_mtime)
    previous = [p for p in previous if (p / RULES_FILE).is_file()]
    if previous:
        warnings.warn(
            f"{target} is missing; loading the previous checkpoint {previous[-1]} (a save "
            "was interrupted while swapping it in)",
            UserWarning,
            stacklevel=3,
        )
        return previous[-1]
    raise FileNotFoundError(f"directory={str(directory)!r} holds no qflax checkpoint")


def load(directory: str | os.PathLike, abstract: Any, *, verify: bool = True) -> Any:
    """Restores a checkpoint into the structure of ``abstract``.

    Args:
        directory: A directory written by :func:`save`.
        abstract: Abstract params of the model that will use them (e.g.
            ``jax.eval_shape(qmodel.init, key, x)["params"]``; boxed allowed; leaves
            with a ``sharding`` are restored sharded), or an abstract NNX model.
        verify: Whether to check every param against the sha256 digest saved
            with it in ``qflax.json`` (False skips the check, e.g. to rescue a
            damaged checkpoint).

    Returns:
        The params (unboxed), or for an NNX ``abstract`` the model with them.

    Raises:
        FileNotFoundError: If ``directory`` holds no checkpoint.
        CheckpointError: If the checkpoint is damaged (a param whose bytes differ
            from its digest, no digests, unreadable files), or its params differ
            from ``abstract``'s (missing or extra params, another dtype or shape,
            a quantized param where ``abstract`` has a float one: each named by
            its path).
        TypeError: If ``abstract`` has no arrays, or a leaf of it is not an
            array or ShapeDtypeStruct.
    """
    ocp = _orbax()
    path = _resolve(directory)
    meta = _read_meta(path)
    tree = _pure(abstract)  # an NNX model's state as a pure dict
    wanted = _abstract_leaves(tree, abstract)
    digests = meta.get("sha256") if verify else None
    if verify and not isinstance(digests, dict):
        raise CheckpointError(
            f"{path / RULES_FILE} has no sha256 digests of the params (written "
            "by an older qflax, or edited); verify=False loads it unverified"
        )
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    try:
        _check_saved(path / "params", checkpointer, wanted)
        try:
            restored = checkpointer.restore(path / "params", tree)
        except Exception as err:  # orbax/tensorstore raise many types for damaged data
            raise _unreadable(path / "params", err) from err
    finally:
        checkpointer.close()
    if digests is not None:
        for path_, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
            if _digest(leaf) != digests.get(_key(path_)):
                raise CheckpointError(
                    f"{path / 'params'}: param {_key(path_)!r} is damaged: its bytes do not match "
                    f"the sha256 digest saved in {RULES_FILE} (verify=False loads it anyway)"
                )
    return _into(abstract, restored)


def _check_saved(params_dir: Path, checkpointer: Any, wanted: dict) -> None:
    """Raises CheckpointError unless the saved arrays are exactly ``wanted``."""
    for file in sorted((params_dir / "array_metadatas").glob("*")):  # orbax names only the dir
        try:
            json.loads(file.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{file} is damaged: it is not JSON ({err})") from err
    try:
        saved_tree = checkpointer.metadata(params_dir).item_metadata
    except Exception as err:  # orbax/tensorstore raise many types for damaged data
        raise _unreadable(params_dir, err) from err
    if saved_tree is None:  # orbax only logs a warning
        raise CheckpointError(
            f"{params_dir} cannot be read: its metadata (_METADATA, manifest.ocdbt) is missing "
            "or damaged"
        )
    saved = {_names(p): (_dtype_shape(m.dtype, m.shape), "/".join(_names(p)))
             for p, m in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}  # fmt: skip
    _check_entries(str(params_dir), "param", wanted, saved)


def _unreadable(params_dir: Path, err: Exception) -> CheckpointError:
    first = (str(err).strip().splitlines() or [""])[0]
    return CheckpointError(f"{params_dir} cannot be read: {type(err).__name__}: {first}")


def _check_entries(where: str, kind: str, wanted: dict, saved: dict) -> None:
    """Raises CheckpointError for missing, extra and mismatched entries.

    ``wanted`` maps an entry's key to ``(display name, "dtype[shape]")``, ``saved``
    to ``("dtype[shape]" or None to not compare it, display name)``.
    """
    missing = [(k, name) for k, (name, _) in wanted.items() if k not in saved]
    for k, name in missing:
        if any(_under(s, k) for s in saved):
            raise CheckpointError(
                f"{where}: the checkpoint holds a quantized {kind} at {name!r} where the abstract "
                "tree has a float array: pass the quantized model's abstract params (e.g. "
                "jax.eval_shape(qmodel.init, key, x)['params'])"
            )
    missing = [name for _, name in missing]
    if missing:
        raise CheckpointError(f"{where}: {kind}s missing from the checkpoint: {missing}")
    extra = [name for k, (_, name) in saved.items() if k not in wanted]
    if extra:
        raise CheckpointError(f"{where}: the checkpoint has {kind}s that are not in the model: "
                              f"{extra}")  # fmt: skip
    for k, (name, want) in wanted.items():
        if saved[k][0] not in (None, want):
            raise CheckpointError(
                f"{where}: {kind} {name!r} is {saved[k][0]} in the checkpoint, the model "
                f"expects {want}"
            )


def _under(key: Any, prefix: Any) -> bool:
    """Whether entry ``key`` lies inside ``prefix`` (a quantized param's field)."""
    if isinstance(key, str):
        return key.startswith(f"{prefix}.")
    return len(key) > len(prefix) and key[: len(prefix)] == prefix


def _dtype_shape(dtype: Any, shape: Any) -> str:
    return f"{jnp.dtype(dtype).name}{list(shape)}"


def _names(path: tuple) -> tuple[str, ...]:
    """The key names of a pytree path (dict keys, attributes, indices) as strings."""
    names = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
        else:
            names.append(str(k))
    return tuple(names)


def _abstract_leaves(tree: Any, abstract: Any) -> dict:
    """``{names: (display name, "dtype[shape]")}`` of an abstract tree's leaves."""
    if not jax.tree_util.tree_leaves(tree):
        raise TypeError(
            f"abstract={reprlib.repr(abstract)} has no arrays; pass the abstract params of the "
            "model (e.g. jax.eval_shape(qmodel.init, key, x)['params']) or an abstract NNX model"
        )
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"abstract leaf {_key(path)!r} is a {type(leaf).__name__} ({leaf!r}); "
                "allowed: arrays or jax.ShapeDtypeStruct (e.g. from jax.eval_shape)"
            )
        out[_names(path)] = (_key(path), _dtype_shape(leaf.dtype, leaf.shape))
    return out


def load_rules(directory: str | os.PathLike) -> list[QuantizationRule] | None:
    """The rules saved with a checkpoint (None if it was saved without).

    Raises:
        CheckpointError: If ``qflax.json`` or a rule in it is damaged (naming the
            file and ``rules[i]``).
    """
    path = _resolve(directory)
    return _rules(_read_meta(path), path / RULES_FILE)


def _into(abstract: Any, restored: Any) -> Any:
    """``restored`` (a pure dict), or for an NNX ``abstract`` the model holding it."""
    if not isinstance(abstract, nnx.Module):
        return restored
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


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
    overwrite: bool = False,
) -> Path:
    """Writes params to one safetensors file (written aside, then renamed into place).

    The metadata records each entry's dtype and sha256 digest and the rules.

    Args:
        file: The file to write: a free path or (with ``overwrite=True``) a file
            written by this function. Missing parent directories are created.
        params: Params, or an NNX model (its state).
        rules: The rules that quantized them, for :func:`load_safetensors_rules`.
        overwrite: Whether a previous export at ``file`` may be replaced.

    Returns:
        The file's path.

    Raises:
        FileExistsError: If ``file`` is anything else (a directory, a file that is
            not a qflax safetensors export), or an export and ``overwrite`` is
            False; it is left untouched.
        TypeError: If ``params`` is not a pytree of arrays (naming the leaf), or
            ``rules`` not a list of QuantizationRule.
        ValueError: If ``params`` has no arrays, or two of its paths map to the
            same entry (``{"a/b": x, "a": {"b": y}}``, or a key ``"kernel.qvalue"``
            next to a quantized ``kernel``); nothing is written.
    """
    from safetensors.numpy import save_file  # noqa: PLC0415 - optional dependency

    tensors, dtypes, digests = {}, {}, {}
    for key, leaf in _leaves(params, _pure(params)):
        a = np.asarray(jax.device_get(leaf))
        if a.dtype.name not in _NATIVE:
            dtypes[key] = a.dtype.name
            a = a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))
        tensors[key] = np.array(a, order="C")  # ascontiguousarray would make 0-d 1-d
        digests[key] = hashlib.sha256(tensors[key].tobytes()).hexdigest()
    meta = {"format": FORMAT, "dtypes": dtypes, "sha256": digests,
            "rules": None if rules is None else rules_to_json(rules)}  # fmt: skip
    target = Path(file).absolute()
    _files.check_target(target, "file", overwrite=overwrite, what=_SAFETENSORS,
                        problem=_not_our_safetensors)  # fmt: skip
    _files.write_file(
        target,
        "file",
        lambda tmp: save_file(tensors, str(tmp), metadata={"qflax": json.dumps(meta)}),
    )
    return target


def _header(file: Path) -> dict:
    """The JSON header of a safetensors file (CheckpointError if damaged)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else 0
        if not 2 <= n <= min(size - 8, 100_000_000):
            raise CheckpointError(
                f"{file}: the safetensors header is truncated or damaged ({size} bytes in all, "
                f"header of {n} bytes)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{file}: the safetensors header is damaged ({err})") from err
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is damaged (not a JSON object)")
    return header


def _qflax_meta(file: Path) -> dict:
    """The qflax metadata of a safetensors file ({} for a file written by other tools)."""
    raw = (_header(file).get("__metadata__") or {}).get("qflax")
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except (TypeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{file}: the qflax metadata is damaged ({err})") from err
    return _check_format(meta, f"{file}: the qflax metadata")


def _not_our_safetensors(path: Path) -> str | None:
    """Why ``path`` is not a file written by :func:`export_safetensors` (None if it is)."""
    if path.is_dir():
        return "it is a directory"
    try:
        meta = _qflax_meta(path)
    except CheckpointError as err:
        return str(err).removeprefix(f"{path}: ")
    return None if meta else "a safetensors file without qflax metadata"


def _existing(file: str | os.PathLike) -> Path:
    path = Path(file)
    if path.is_dir():
        raise IsADirectoryError(f"file={str(file)!r} is a directory, not a safetensors file")
    if not path.exists():
        raise FileNotFoundError(f"file={str(file)!r} does not exist")
    return path


def import_safetensors(file: str | os.PathLike, abstract: Any, *, verify: bool = True) -> Any:
    """Reads a file written by :func:`export_safetensors` into ``abstract``'s structure.

    Args:
        file: The safetensors file.
        abstract: Abstract params (see :func:`load`) or an abstract NNX model.
        verify: Whether to check every entry against the sha256 digest saved with
            it (False skips the hashing, for speed). A qflax file without digests
            (written by an older qflax, or edited) loads only with
            ``verify=False``; files of other tools (no qflax metadata) load
            unverified.

    Returns:
        The params, or for an NNX ``abstract`` the model with them.

    Raises:
        CheckpointError: For a damaged file (header, metadata, no digests, or an
            entry whose digest differs), a missing or extra entry, or one whose shape or dtype
            differs from the abstract params (naming the file, the entry and both).
        TypeError: If a leaf of ``abstract`` is not an array or ShapeDtypeStruct.
    """
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415 - optional dependency

    path = _existing(file)
    meta = _qflax_meta(path)
    dtypes, digests = meta.get("dtypes", {}), meta.get("sha256") if verify else None
    if verify and meta and not isinstance(digests, dict):
        raise CheckpointError(
            f"{path}: the qflax metadata has no sha256 digests (written by an "
            "older qflax, or edited); verify=False loads it unverified"
        )
    tree = _pure(abstract)
    wanted = {name: (name, spec) for name, spec in _abstract_leaves(tree, abstract).values()}
    out = []
    try:
        with safe_open(str(path), framework="numpy") as f:
            _check_entries(str(path), "entry", wanted, {k: (None, k) for k in f.keys()})  # noqa: SIM118
            for key, (_, want) in wanted.items():
                a = f.get_tensor(key)
                if digests is not None and hashlib.sha256(a.tobytes()).hexdigest() != digests.get(
                    key
                ):
                    raise CheckpointError(
                        f"{path}: entry {key!r} is damaged: its bytes do not match the sha256 "
                        "digest saved with it (verify=False loads it anyway)"
                    )
                if key in dtypes:
                    a = a.view(jnp.dtype(dtypes[key]))
                if _dtype_shape(a.dtype, a.shape) != want:
                    raise CheckpointError(
                        f"{path}: entry {key!r} is {_dtype_shape(a.dtype, a.shape)}, the model "
                        f"expects {want}"
                    )
                out.append(jnp.asarray(a))
    except SafetensorError as err:
        raise CheckpointError(f"{path} cannot be read: {err}") from err
    return _into(abstract, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), out))


def load_safetensors_rules(file: str | os.PathLike) -> list[QuantizationRule] | None:
    """The rules stored in a safetensors file's metadata (None if none).

    Raises:
        CheckpointError: If the metadata or a rule in it is damaged (naming the
            file and ``rules[i]``).
    """
    path = _existing(file)
    return _rules(_qflax_meta(path), path)

"""Quantized checkpoints: bit-exact round trips, abstract loading, rules, crash safety."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from archs import small as zoo
from flax import nnx

import qflax
from qcore.testing import assert_rejects
from qflax import QuantizationRule as Rule
from qflax import checkpoint

X = jax.random.normal(jax.random.key(1), (8, 128))
RULES = [
    Rule(module_path="Dense_0", weight_qtype="nf4", tile_size=32, act_qtype="int8"),
    Rule(weight_qtype="int4", tile_size={0: 64}, weight_calibration_method="mse"),
]
NNX_RULES = [Rule(module_path="fc1", weight_qtype="float8_e4m3fn"), Rule(weight_qtype="mxfp4")]


@pytest.fixture(scope="module")
def linen():
    qmodel = qflax.quantize_model(zoo.LinenMLP(), qflax.PtqProvider(RULES))
    params = qmodel.init(jax.random.key(0), X)["params"]
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), X)["params"]
    return qmodel, params, abstract


def assert_identical(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_orbax_round_trip_is_bit_exact_and_restores_rules(linen, tmp_path):
    qmodel, params, abstract = linen
    checkpoint.save(tmp_path / "ckpt", params, rules=RULES)
    restored = checkpoint.load(tmp_path / "ckpt", abstract)
    assert_identical(restored, params)
    assert checkpoint.load_rules(tmp_path / "ckpt") == RULES
    np.testing.assert_array_equal(
        qmodel.apply({"params": restored}, X), qmodel.apply({"params": params}, X)
    )


def test_safetensors_round_trip_is_bit_exact_with_entries_named_by_path(linen, tmp_path):
    _, params, abstract = linen
    file = checkpoint.export_safetensors(tmp_path / "q.safetensors", params, rules=RULES)
    from safetensors import safe_open

    with safe_open(str(file), framework="numpy") as f:
        keys = set(f.keys())
    assert {"Dense_0/kernel.qvalue", "Dense_0/kernel.scale", "Dense_0/bias"} <= keys
    assert_identical(checkpoint.import_safetensors(file, abstract), params)
    assert checkpoint.load_safetensors_rules(file) == RULES


def test_safetensors_entry_mismatch_names_the_entry(linen, tmp_path):
    _, params, abstract = linen
    small = qflax.quantize_model(zoo.LinenMLP(), qflax.PtqProvider([Rule(weight_qtype="int8")]))
    file = checkpoint.export_safetensors(tmp_path / "q.safetensors", params)
    other = jax.eval_shape(small.init, jax.random.key(0), X)["params"]
    with pytest.raises(ValueError, match=r"entry 'Dense_\d/kernel.qvalue' is"):
        checkpoint.import_safetensors(file, other)


def test_awq_params_with_carried_input_scales_round_trip(tmp_path):
    from qflax.awq import awq

    rules = [Rule(weight_qtype="int4", tile_size=32)]
    model = zoo.LinenMLP()
    fparams = model.init(jax.random.key(0), X)["params"]
    xs = [jax.random.normal(jax.random.key(i), (16, 128)) for i in range(2)]
    params = awq(model, fparams, rules, xs, progress=False)
    abstract = jax.eval_shape(lambda: params)
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    checkpoint.save(tmp_path / "awq", params, rules=rules)
    file = checkpoint.export_safetensors(tmp_path / "awq.safetensors", params)
    from safetensors import safe_open

    with safe_open(str(file), framework="numpy") as f:
        assert "Dense_0/kernel.input_scale" in set(f.keys())
    for loaded in (
        checkpoint.load(tmp_path / "awq", abstract),
        checkpoint.import_safetensors(file, abstract),
    ):
        assert_identical(loaded, params)
        np.testing.assert_array_equal(
            qmodel.apply({"params": loaded}, X), qmodel.apply({"params": params}, X)
        )


def test_nnx_prequantized_checkpoint_loads_into_an_abstract_model(tmp_path):
    def build():
        return qflax.quantize_model(zoo.NnxMLP(nnx.Rngs(0)), qflax.PtqProvider(NNX_RULES), X)

    model = build()
    checkpoint.save(tmp_path / "nnx", model, rules=NNX_RULES)
    checkpoint.export_safetensors(tmp_path / "nnx.safetensors", model)
    for loaded in (
        checkpoint.load(tmp_path / "nnx", nnx.eval_shape(build)),
        checkpoint.import_safetensors(tmp_path / "nnx.safetensors", nnx.eval_shape(build)),
    ):
        assert_identical(nnx.to_pure_dict(nnx.state(loaded)), nnx.to_pure_dict(nnx.state(model)))
        np.testing.assert_array_equal(loaded(X), model(X))
    assert checkpoint.load_rules(tmp_path / "nnx") == NNX_RULES


def test_a_failed_save_leaves_the_previous_checkpoint(linen, tmp_path, monkeypatch):
    _, params, abstract = linen
    checkpoint.save(tmp_path / "ckpt", params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    import orbax.checkpoint as ocp

    def broken_save(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ocp.Checkpointer, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path / "ckpt", zeros, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no leftovers
    monkeypatch.undo()
    assert_identical(checkpoint.load(tmp_path / "ckpt", abstract), params)


CRASH = """
import os, jax, jax.numpy as jnp, flax.linen as nn
import orbax.checkpoint as ocp
import qflax
from qflax import checkpoint

x = jnp.ones((2, 16))
rules = [qflax.QuantizationRule(weight_qtype="int8")]
qmodel = qflax.quantize_model(nn.Dense(8), qflax.PtqProvider(rules))
params = qmodel.init(jax.random.key(0), x)["params"]
checkpoint.save("{dir}", params)
original = ocp.Checkpointer.save

def die(self, *args, **kwargs):
    original(self, *args, **kwargs)  # the new checkpoint's arrays are on disk...
    os._exit(3)                      # ...when the process is killed

ocp.Checkpointer.save = die
checkpoint.save("{dir}", jax.tree.map(jnp.zeros_like, params), overwrite=True)
"""


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(linen, tmp_path):
    target = tmp_path / "ckpt"
    script = textwrap.dedent(CRASH).format(dir=target)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 3, out.stderr[-2000:]
    qmodel = qflax.quantize_model(nn.Dense(8), qflax.PtqProvider([Rule(weight_qtype="int8")]))
    x = jnp.ones((2, 16))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
    restored = checkpoint.load(target, abstract)
    assert_identical(restored, qmodel.init(jax.random.key(0), x)["params"])


def test_missing_checkpoint_and_unsavable_rules_raise(tmp_path, linen):
    _, params, abstract = linen
    with pytest.raises(FileNotFoundError, match="holds no qflax checkpoint"):
        checkpoint.load(tmp_path / "nothing", abstract)
    with pytest.raises(ValueError, match="callable"):
        checkpoint.save(tmp_path / "c", params, rules=[Rule(module_path=lambda p: True)])
    assert not (tmp_path / "c").exists()


def test_rules_json_keeps_every_field_that_changes_numerics():
    rules = [
        Rule(weight_qtype="int4", act_qtype="int8", rotation="hadamard", rotation_seed=3),
        Rule(act_qtype="int8", act_batch_axes=(0,), tile_size={0: 16}),
        Rule(weight_qtype="nf4"),  # act_batch_axes=None: one scale per row
    ]
    assert checkpoint.rules_from_json(checkpoint.rules_to_json(rules)) == rules


# -- overwrite rule, damage and bad input -----------------------------------------------


def test_save_replaces_only_its_own_checkpoint_and_only_with_overwrite(linen, tmp_path):
    _, params, abstract = linen
    ones = jax.tree.map(jnp.ones_like, params)
    target = checkpoint.save(tmp_path / "ckpt", params, rules=RULES)
    assert_rejects(lambda: checkpoint.save(target, ones), FileExistsError, str(target),
                   "overwrite=True", unchanged=(tmp_path,))  # fmt: skip
    assert checkpoint.save(target, ones, overwrite=True) == target
    assert_identical(checkpoint.load(target, abstract), ones)
    assert checkpoint.load_rules(target) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory holds nothing to lose
    checkpoint.save(empty, params)
    nested = checkpoint.save(tmp_path / "a" / "b" / "ckpt", params)  # parents are created
    assert_identical(checkpoint.load(nested, abstract), params)


def test_export_replaces_only_its_own_file_and_only_with_overwrite(linen, tmp_path):
    _, params, abstract = linen
    ones = jax.tree.map(jnp.ones_like, params)
    file = checkpoint.export_safetensors(tmp_path / "q.safetensors", params)
    assert_rejects(lambda: checkpoint.export_safetensors(file, ones), FileExistsError,
                   str(file), "overwrite=True", unchanged=(tmp_path,))  # fmt: skip
    checkpoint.export_safetensors(file, ones, overwrite=True)
    assert_identical(checkpoint.import_safetensors(file, abstract), ones)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.safetensors"]


def test_flipped_data_bytes_are_found_unless_verify_is_false(linen, tmp_path):
    _, params, abstract = linen
    file = checkpoint.export_safetensors(tmp_path / "q.safetensors", params)
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x10  # in the last tensor's data
    file.write_bytes(bytes(data))
    e = assert_rejects(
        lambda: checkpoint.import_safetensors(file, abstract),
        checkpoint.CheckpointError,
        str(file),
        "sha256",
        unchanged=(tmp_path,),
    )
    assert isinstance(e, ValueError)
    loaded = checkpoint.import_safetensors(file, abstract, verify=False)  # the opt-out
    pairs = zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True)
    differ = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs]
    assert sum(differ) == 1


def test_a_bit_flipped_in_orbax_data_is_found_unless_verify_is_false(linen, tmp_path):
    _, params, abstract = linen
    ckpt = checkpoint.save(tmp_path / "ckpt", params)
    data = ckpt / "params" / "ocdbt.process_0" / "d"
    largest = max((p for p in data.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(largest.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    largest.write_bytes(bytes(raw))
    assert_rejects(
        lambda: checkpoint.load(ckpt, abstract),
        checkpoint.CheckpointError,
        str(ckpt / "params"),
        "sha256",
        "verify=False",
        unchanged=(tmp_path,),
    )
    loaded = checkpoint.load(ckpt, abstract, verify=False)  # the opt-out
    pairs = zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True)
    assert sum(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs) == 1


def test_files_without_digests_load_only_with_verify_false(linen, tmp_path):
    from safetensors.numpy import save_file

    _, params, abstract = linen
    file = checkpoint.export_safetensors(tmp_path / "q.safetensors", params)
    legacy = tmp_path / "legacy.safetensors"
    with safe_open_numpy(file) as f:
        meta = json.loads(f.metadata()["qflax"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    assert set(meta["sha256"]) == set(tensors)
    meta["sha265"] = meta.pop("sha256")  # a renamed key
    save_file(tensors, str(legacy), metadata={"qflax": json.dumps(meta)})
    assert_rejects(lambda: checkpoint.import_safetensors(legacy, abstract),
                   checkpoint.CheckpointError, str(legacy), "sha256", "verify=False",
                   unchanged=(tmp_path,))  # fmt: skip
    assert_identical(checkpoint.import_safetensors(legacy, abstract, verify=False), params)


def test_colliding_param_paths_are_refused(linen, tmp_path):
    _, params, _ = linen
    x, y = jnp.ones(2), jnp.zeros(2)
    quantized = params["Dense_0"]["kernel"]  # its qvalue's key is Dense_0/kernel.qvalue
    for tree, first, second in [
        ({"a/b": x, "a": {"b": y}}, "['a/b']", "['a']['b']"),
        ({"Dense_0": {"kernel": quantized, "kernel.qvalue": x}}, "kernel.qvalue", "qvalue"),
    ]:
        for write in (checkpoint.export_safetensors, checkpoint.save):
            assert_rejects(lambda t=tree, w=write: w(tmp_path / "out", t), ValueError,
                           "params", first, second, "same", unchanged=(tmp_path,))  # fmt: skip


def safe_open_numpy(file):
    from safetensors import safe_open

    return safe_open(str(file), framework="numpy")


def _edit(file, fn):
    file.write_bytes(fn(file.read_bytes()))


def _json_edit(file, fn):
    data = json.loads(file.read_text())
    fn(data)
    file.write_text(json.dumps(data))


def _sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _with(abstract, **changes):
    """``abstract`` with ``Module/name`` entries replaced (None: removed)."""
    out = {k: dict(v) for k, v in abstract.items()}
    for key, value in changes.items():
        module, name = key.split("__")
        if value is None:
            del out[module][name]
        else:
            out.setdefault(module, {})[name] = value
    return out


def _safetensors_with(file, tensors, meta):
    from safetensors.numpy import save_file

    save_file(tensors, str(file), metadata=meta)


def _foreign(lab):
    _safetensors_with(lab.st, {"w": np.ones(3, np.float32)}, {"source": "someone else"})


def _bad_rules(lab, rules):
    with safe_open_numpy(lab.st) as f:
        meta = json.loads(f.metadata()["qflax"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    meta["rules"] = rules
    _safetensors_with(lab.st, tensors, {"qflax": json.dumps(meta)})


class Lab:
    """A copy of a good orbax checkpoint (``ckpt``) and safetensors file (``st``)."""

    def __init__(self, root, source, params, abstract):
        self.root, self.params, self.abstract = root, params, abstract
        self.ckpt, self.st = root / "ckpt", root / "q.safetensors"
        shutil.copytree(source / "ckpt", self.ckpt)
        shutil.copy2(source / "q.safetensors", self.st)
        self.meta = self.ckpt / checkpoint.RULES_FILE
        self.orbax_meta = self.ckpt / "params" / "_METADATA"


E = checkpoint.CheckpointError
# (id, damage(lab), call(lab), error, fragments(lab)): every call must raise and leave
# lab.root byte-identical.
CASES = [
    # -- saving onto something that is not ours (or without overwrite=True)
    ("save-onto-user-dir", lambda lab: (lab.root / "mine").mkdir() or
     (lab.root / "mine" / "notes.txt").write_text("keep me"),
     lambda lab: checkpoint.save(lab.root / "mine", lab.params, overwrite=True),
     FileExistsError, lambda lab: (str(lab.root / "mine"), "not a qflax checkpoint")),
    ("save-onto-file", lambda lab: (lab.root / "f").write_text("keep me"),
     lambda lab: checkpoint.save(lab.root / "f", lab.params, overwrite=True),
     FileExistsError, lambda lab: (str(lab.root / "f"), "not a qflax checkpoint")),
    ("save-onto-checkpoint", None, lambda lab: checkpoint.save(lab.ckpt, lab.params),
     FileExistsError, lambda lab: (str(lab.ckpt), "overwrite=True")),
    ("save-onto-checkpoint-with-user-file", lambda lab: (lab.ckpt / "notes.txt").write_text("x"),
     lambda lab: checkpoint.save(lab.ckpt, lab.params, overwrite=True),
     FileExistsError, lambda lab: (str(lab.ckpt), "notes.txt")),
    ("save-onto-damaged-checkpoint", lambda lab: lab.meta.write_bytes(b"\xff{"),
     lambda lab: checkpoint.save(lab.ckpt, lab.params, overwrite=True),
     FileExistsError, lambda lab: (str(lab.ckpt), "not a qflax checkpoint")),
    ("save-onto-symlink", lambda lab: (lab.root / "link").symlink_to(lab.ckpt),
     lambda lab: checkpoint.save(lab.root / "link", lab.params, overwrite=True),
     FileExistsError, lambda lab: (str(lab.root / "link"), "symbolic link")),
    ("save-under-a-file", lambda lab: (lab.root / "f").write_text("keep me"),
     lambda lab: checkpoint.save(lab.root / "f" / "ckpt", lab.params),
     NotADirectoryError, lambda lab: (str(lab.root / "f" / "ckpt"), "not a directory")),
    ("export-onto-text-file", lambda lab: (lab.root / "x.safetensors").write_text("keep me"),
     lambda lab: checkpoint.export_safetensors(lab.root / "x.safetensors", lab.params,
                                               overwrite=True),
     FileExistsError, lambda lab: (str(lab.root / "x.safetensors"), "not a qflax safetensors")),
    ("export-onto-foreign-safetensors", _foreign,
     lambda lab: checkpoint.export_safetensors(lab.st, lab.params, overwrite=True),
     FileExistsError, lambda lab: (str(lab.st), "not a qflax safetensors")),
    ("export-onto-export", None, lambda lab: checkpoint.export_safetensors(lab.st, lab.params),
     FileExistsError, lambda lab: (str(lab.st), "overwrite=True")),
    ("export-onto-directory", None,
     lambda lab: checkpoint.export_safetensors(lab.ckpt, lab.params, overwrite=True),
     FileExistsError, lambda lab: (str(lab.ckpt), "not a qflax safetensors")),
    ("export-under-a-file", lambda lab: (lab.root / "f").write_text("keep me"),
     lambda lab: checkpoint.export_safetensors(lab.root / "f" / "q.safetensors", lab.params),
     NotADirectoryError, lambda lab: (str(lab.root / "f"), "not a directory")),
    # -- bad params and rules (nothing is written)
    ("save-str-leaf", None, lambda lab: checkpoint.save(lab.root / "n", {"a": "hi"}),
     TypeError, lambda lab: ("params", "['a']", "str", "allowed")),
    ("save-object-leaf", None, lambda lab: checkpoint.save(lab.root / "n", {"a": object()}),
     TypeError, lambda lab: ("params", "['a']", "object", "allowed")),
    ("save-empty", None, lambda lab: checkpoint.save(lab.root / "n", {}),
     ValueError, lambda lab: ("params", "no arrays")),
    ("save-int", None, lambda lab: checkpoint.save(lab.root / "n", 5),
     TypeError, lambda lab: ("params=5", "int")),
    ("save-rules-str", None,
     lambda lab: checkpoint.save(lab.root / "n", lab.params, rules="int8"),
     TypeError, lambda lab: ("rules='int8'", "QuantizationRule")),
    ("save-rules-int", None, lambda lab: checkpoint.save(lab.root / "n", lab.params, rules=[5]),
     TypeError, lambda lab: ("rules[0]=5", "QuantizationRule")),
    ("export-str-leaf", None,
     lambda lab: checkpoint.export_safetensors(lab.root / "n.safetensors", {"a": "hi"}),
     TypeError, lambda lab: ("params", "['a']", "str", "allowed")),
    ("export-object-leaf", None,
     lambda lab: checkpoint.export_safetensors(lab.root / "n.safetensors", {"a": object()}),
     TypeError, lambda lab: ("params", "['a']", "object", "allowed")),
    ("load-abstract-none", None, lambda lab: checkpoint.load(lab.ckpt, None),
     TypeError, lambda lab: ("abstract=None", "eval_shape")),
    ("import-abstract-none", None, lambda lab: checkpoint.import_safetensors(lab.st, None),
     TypeError, lambda lab: ("abstract=None", "eval_shape")),
    ("load-float-abstract-for-quantized", None,
     lambda lab: checkpoint.load(lab.ckpt, _with(lab.abstract, Dense_0__kernel=_sds((128, 64)))),
     E, lambda lab: (str(lab.ckpt), "'Dense_0/kernel'", "quantized", "abstract", "float")),
    ("import-float-abstract-for-quantized", None,
     lambda lab: checkpoint.import_safetensors(
         lab.st, _with(lab.abstract, Dense_0__kernel=_sds((128, 64)))),
     E, lambda lab: (str(lab.st), "'Dense_0/kernel'", "quantized", "abstract", "float")),
    # -- loading from paths that hold no checkpoint
    ("load-missing", None, lambda lab: checkpoint.load(lab.root / "nope", lab.abstract),
     FileNotFoundError, lambda lab: (str(lab.root / "nope"), "holds no qflax checkpoint")),
    ("load-file", None, lambda lab: checkpoint.load(lab.st, lab.abstract),
     FileNotFoundError, lambda lab: (str(lab.st), "holds no qflax checkpoint")),
    ("import-missing", None,
     lambda lab: checkpoint.import_safetensors(lab.root / "nope.safetensors", lab.abstract),
     FileNotFoundError, lambda lab: (str(lab.root / "nope.safetensors"), "does not exist")),
    ("import-directory", None, lambda lab: checkpoint.import_safetensors(lab.ckpt, lab.abstract),
     IsADirectoryError, lambda lab: (str(lab.ckpt), "is a directory")),
    # -- damaged orbax checkpoints
    ("qflax-json-not-utf8", lambda lab: lab.meta.write_bytes(b"\xff\xfe{}"),
     lambda lab: checkpoint.load(lab.ckpt, lab.abstract),
     E, lambda lab: (str(lab.meta), "damaged")),
    ("qflax-json-truncated", lambda lab: _edit(lab.meta, lambda b: b[: len(b) // 2]),
     lambda lab: checkpoint.load_rules(lab.ckpt),
     E, lambda lab: (str(lab.meta), "damaged")),
    ("qflax-json-wrong-format", lambda lab: _json_edit(lab.meta, lambda d: d.update(format=2)),
     lambda lab: checkpoint.load(lab.ckpt, lab.abstract),
     E, lambda lab: (str(lab.meta), "format", checkpoint.FORMAT)),
    ("orbax-metadata-garbage", lambda lab: _edit(lab.orbax_meta, lambda b: b"\xff" + b[1:]),
     lambda lab: checkpoint.load(lab.ckpt, lab.abstract),
     E, lambda lab: (str(lab.ckpt / "params"), "cannot be read", "_METADATA")),
    ("orbax-metadata-truncated", lambda lab: _edit(lab.orbax_meta, lambda b: b[: len(b) // 2]),
     lambda lab: checkpoint.load(lab.ckpt, lab.abstract),
     E, lambda lab: (str(lab.ckpt / "params"), "cannot be read", "_METADATA")),
    ("orbax-manifest-truncated",
     lambda lab: _edit(lab.ckpt / "params" / "manifest.ocdbt", lambda b: b[: len(b) // 2]),
     lambda lab: checkpoint.load(lab.ckpt, lab.abstract),
     E, lambda lab: (str(lab.ckpt / "params"), "cannot be read")),
    ("rules-unknown-field",
     lambda lab: _json_edit(lab.meta, lambda d: d["rules"][1].update(colour="red")),
     lambda lab: checkpoint.load_rules(lab.ckpt),
     E, lambda lab: (str(lab.meta), "rules[1]", "colour")),
    ("rules-bad-qtype",
     lambda lab: _json_edit(lab.meta, lambda d: d["rules"][0].update(weight_qtype="banana")),
     lambda lab: checkpoint.load_rules(lab.ckpt),
     E, lambda lab: (str(lab.meta), "rules[0]", "banana")),
    ("orbax-array-metadata-damaged",
     lambda lab: _edit(lab.ckpt / "params" / "array_metadatas" / "process_0",
                       lambda b: b[: len(b) // 2]),
     lambda lab: checkpoint.load(lab.ckpt, lab.abstract),
     E, lambda lab: (str(lab.ckpt / "params" / "array_metadatas" / "process_0"),)),
    ("rules-not-dicts", lambda lab: _json_edit(lab.meta, lambda d: d.update(rules=[5])),
     lambda lab: checkpoint.load_rules(lab.ckpt),
     E, lambda lab: (str(lab.meta), "rules[0]", "5", "dict")),
    ("rules-not-a-list", lambda lab: _json_edit(lab.meta, lambda d: d.update(rules="all")),
     lambda lab: checkpoint.load_rules(lab.ckpt),
     E, lambda lab: (str(lab.meta), "rules", "list")),
    # -- abstract trees that do not fit (orbax)
    ("orbax-wrong-shape", None,
     lambda lab: checkpoint.load(lab.ckpt, _with(lab.abstract, Dense_0__bias=_sds((65,)))),
     E, lambda lab: (str(lab.ckpt), "'Dense_0/bias'", "float32[64]", "float32[65]")),
    ("orbax-wrong-dtype", None,
     lambda lab: checkpoint.load(lab.ckpt, _with(lab.abstract,
                                                 Dense_1__bias=_sds((256,), jnp.bfloat16))),
     E, lambda lab: (str(lab.ckpt), "'Dense_1/bias'", "float32[256]", "bfloat16[256]")),
    ("orbax-missing-param", None,
     lambda lab: checkpoint.load(lab.ckpt, _with(lab.abstract, Extra__bias=_sds((3,)))),
     E, lambda lab: (str(lab.ckpt), "'Extra/bias'", "missing from the checkpoint")),
    ("orbax-extra-param", None,
     lambda lab: checkpoint.load(lab.ckpt, _with(lab.abstract, Dense_1__bias=None)),
     E, lambda lab: (str(lab.ckpt), "Dense_1/bias", "not in the model")),
    ("orbax-abstract-not-arrays", None,
     lambda lab: checkpoint.load(lab.ckpt, _with(lab.abstract, Dense_1__bias="64 floats")),
     TypeError, lambda lab: ("abstract", "'Dense_1/bias'", "str")),
    # -- damaged safetensors files
    ("st-empty", lambda lab: lab.st.write_bytes(b""),
     lambda lab: checkpoint.import_safetensors(lab.st, lab.abstract),
     E, lambda lab: (str(lab.st), "header")),
    ("st-truncated-header", lambda lab: _edit(lab.st, lambda b: b[:40]),
     lambda lab: checkpoint.import_safetensors(lab.st, lab.abstract),
     E, lambda lab: (str(lab.st), "header")),
    ("st-truncated-data", lambda lab: _edit(lab.st, lambda b: b[:-100]),
     lambda lab: checkpoint.import_safetensors(lab.st, lab.abstract),
     E, lambda lab: (str(lab.st), "cannot be read")),
    ("st-flipped-header-byte", lambda lab: _edit(lab.st, lambda b: b[:8] + b"[" + b[9:]),
     lambda lab: checkpoint.import_safetensors(lab.st, lab.abstract),
     E, lambda lab: (str(lab.st), "header")),
    ("st-damaged-qflax-metadata",
     lambda lab: _edit(lab.st, lambda b: b.replace(b'{\\"format', b'[\\"format', 1)),
     lambda lab: checkpoint.import_safetensors(lab.st, lab.abstract),
     E, lambda lab: (str(lab.st), "qflax metadata")),
    ("st-flipped-data-byte", lambda lab: _edit(lab.st, lambda b: b[:-1] + bytes([b[-1] ^ 1])),
     lambda lab: checkpoint.import_safetensors(lab.st, lab.abstract),
     E, lambda lab: (str(lab.st), "entry", "sha256")),
    ("st-rules-bad-qtype", lambda lab: _bad_rules(lab, [{"weight_qtype": "banana"}]),
     lambda lab: checkpoint.load_safetensors_rules(lab.st),
     E, lambda lab: (str(lab.st), "rules[0]", "banana")),
    # -- abstract trees that do not fit (safetensors)
    ("st-wrong-shape", None,
     lambda lab: checkpoint.import_safetensors(lab.st, _with(lab.abstract,
                                                             Dense_0__bias=_sds((65,)))),
     E, lambda lab: (str(lab.st), "'Dense_0/bias'", "float32[64]", "float32[65]")),
    ("st-wrong-dtype", None,
     lambda lab: checkpoint.import_safetensors(
         lab.st, _with(lab.abstract, Dense_1__bias=_sds((256,), jnp.int32))),
     E, lambda lab: (str(lab.st), "'Dense_1/bias'", "float32[256]", "int32[256]")),
    ("st-missing-entry", None,
     lambda lab: checkpoint.import_safetensors(lab.st, _with(lab.abstract, Extra__bias=_sds((3,)))),
     E, lambda lab: (str(lab.st), "'Extra/bias'", "missing")),
    ("st-extra-entry", None,
     lambda lab: checkpoint.import_safetensors(lab.st, _with(lab.abstract, Dense_1__bias=None)),
     E, lambda lab: (str(lab.st), "Dense_1/bias", "not in the model")),
]  # fmt: skip


@pytest.fixture(scope="module")
def good(linen, tmp_path_factory):
    _, params, abstract = linen
    source = tmp_path_factory.mktemp("good")
    checkpoint.save(source / "ckpt", params, rules=RULES)
    checkpoint.export_safetensors(source / "q.safetensors", params, rules=RULES)
    return source, params, abstract


@pytest.mark.parametrize(("damage", "call", "error", "fragments"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])  # fmt: skip
def test_damaged_checkpoints_and_bad_paths_are_named_and_left_alone(
    good, tmp_path, damage, call, error, fragments
):
    lab = Lab(tmp_path, *good)
    if damage is not None:
        damage(lab)
    e = assert_rejects(lambda: call(lab), error, *fragments(lab), unchanged=(tmp_path,))
    assert "strict=False" not in str(e) and "partial_restore" not in str(e)


def test_an_unwritable_parent_is_named_and_nothing_is_written(linen, tmp_path, monkeypatch):
    _, params, _ = linen
    parent = tmp_path / "locked"
    parent.mkdir()
    real_mkdir = os.mkdir

    def refuse(path, *args, **kwargs):  # what a read-only parent does (root ignores chmod)
        if os.path.dirname(os.fspath(path)) == str(parent):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)
    assert_rejects(lambda: checkpoint.save(parent / "ckpt", params), PermissionError,
                   str(parent / "ckpt"), f"cannot write in {parent}", "Permission denied",
                   unchanged=(tmp_path,))  # fmt: skip

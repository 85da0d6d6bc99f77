"""Reliability: bad or extreme inputs get clear errors, files survive failures, NaN propagates.

Every rejection goes through ``qcore.testing.assert_rejects``: the error type, the
message naming the argument, the value and what is allowed, and the inputs (arrays,
files, directories) byte-identical afterwards.
"""

import importlib
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qflax
import qlitert
from qcore.testing import assert_rejects, assert_unchanged, snapshot
from qlitert import qdq, rules
from qlitert.calibration import update_range

export_module = importlib.import_module("qlitert.export")

W = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
S_IN, Z_IN = qdq.activation_params(-2, 2)
S_OUT, Z_OUT = qdq.activation_params(-4, 4)
RNG = np.random.default_rng(0)
X = RNG.uniform(-2, 2, size=(2, 4)).astype(np.float32)
Y = RNG.uniform(-2, 2, size=(2, 4)).astype(np.float32)


def dense(x):
    wq = qdq.fake_quant(jnp.asarray(W.T), qdq.weight_scales(W.T, 0), narrow_range=True, axis=0)
    return qdq.fake_quant(qdq.fake_quant(x, S_IN, Z_IN) @ wq.T, S_OUT, Z_OUT)


def two(x, y):
    """Two inputs, two outputs: the first output is computed from x only, the second from y."""
    return dense(x), dense(y)


def float_in_int_out(x):
    return qdq.quantize(dense(x), S_OUT, Z_OUT)


@pytest.fixture(scope="module")
def tfl():
    return qlitert.export(two, X, Y)


@pytest.fixture(scope="module")
def model(tfl):
    return qlitert.LiteRTModel(tfl, num_threads=1)


@pytest.fixture(scope="module")
def int_out_tfl():
    return qlitert.export(float_in_int_out, X)


@pytest.fixture(scope="module")
def codes_model():
    """A model with int8 inputs and outputs, run on codes (``quantize_io=False``)."""
    xq = np.asarray(qdq.quantize(jnp.asarray(X), S_IN, Z_IN))

    def codes(q):
        return qdq.quantize(dense(qdq.dequantize(q, S_IN, Z_IN)), S_OUT, Z_OUT)

    return qlitert.LiteRTModel(qlitert.export(codes, xq), quantize_io=False)


@pytest.fixture(scope="module")
def mlp():
    net = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])
    params = net.init(jax.random.key(0), X)
    return net, params


# -- the NaN / inf policy --------------------------------------------------------


def reference(x):
    """The float model in float64: a NaN or inf input row gives a NaN or inf output row."""
    return np.asarray(x, np.float64) @ W.astype(np.float64)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_litert_outputs_computed_from_a_non_finite_input_are_nan(model, bad):
    x = X.copy()
    x[1, 2] = bad
    out_x, out_y = model(x, Y)
    # The int8 model quantizes x with one scale: all of x's block is non-finite, so
    # everything computed from it is NaN; the float model has non-finite values too.
    assert not np.all(np.isfinite(reference(x)))
    assert np.all(np.isnan(out_x))
    # The output computed from y alone is the int8 model's own, close to float.
    np.testing.assert_array_equal(out_y, model(X, Y)[1])
    step = S_OUT[0]
    assert np.max(np.abs(out_y - reference(Y))) <= 3 * step


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_the_jax_simulation_follows_the_same_rule(bad):
    x = X.copy()
    x[0, 0] = bad
    out_x, out_y = jax.jit(two)(x, Y)
    assert np.all(np.isnan(np.asarray(out_x)))
    assert np.max(np.abs(np.asarray(out_y) - reference(Y))) <= 3 * S_OUT[0]


def test_per_channel_weight_blocks_with_inf_become_nan_and_others_are_untouched():
    w = W.T.copy()  # (3, 4): one scale per row
    w[1, 0] = np.inf
    scales = qdq.weight_scales(w, 0)
    assert np.isnan(scales[1]) and np.all(np.isfinite(scales[[0, 2]]))
    s = np.where(np.isfinite(scales), scales, 1.0).astype(np.float32)
    y = np.asarray(qdq.fake_quant(jnp.asarray(w), s, narrow_range=True, axis=0))
    assert np.all(np.isnan(y[1]))
    ref = np.clip(np.round(W.T[[0, 2]] / s[[0, 2], None]), -127, 127) * s[[0, 2], None]
    np.testing.assert_allclose(y[[0, 2]], ref, rtol=1e-6)


def test_an_integer_output_cannot_hold_nan_so_a_non_finite_input_is_an_error(int_out_tfl):
    x = X.copy()
    x[0, 1] = np.nan
    codes = qlitert.LiteRTModel(int_out_tfl, quantize_io=False)
    assert_rejects(
        lambda: codes(x), ValueError, "'serving_default_x0'", "1 non-finite", "int8 codes",
        unchanged=(x,),
    )  # fmt: skip
    floats = qlitert.LiteRTModel(int_out_tfl)(x)  # dequantized: float outputs hold NaN
    assert floats.dtype == np.float32 and np.all(np.isnan(floats))


def test_calibrate_rejects_non_finite_inputs_naming_the_batch(mlp):
    net, params = mlp
    bad = np.full_like(X, np.nan)
    batches = [X, bad]
    assert_rejects(
        lambda: qlitert.calibrate(lambda x: net.apply(params, x), batches),
        ValueError, "batches[1]", "8 non-finite values (NaN or inf) of 8",
        unchanged=(batches,),
    )  # fmt: skip


def test_calibrate_rejects_non_finite_activations_naming_the_site():
    x = np.array([[100.0, 1.0]], np.float32)  # exp(100) overflows float32
    assert_rejects(
        lambda: qlitert.calibrate(jnp.exp, [np.zeros_like(x), x]),
        ValueError, "batches[1]", "exp", "1 non-finite values",
        unchanged=(x,),
    )  # fmt: skip


def test_annotate_rejects_non_finite_weights_naming_the_module(mlp):
    net, params = mlp
    cal = qlitert.calibrate(lambda x: net.apply(params, x), [X])
    bad = jax.tree.map(np.array, params)
    bad["params"]["layers_2"]["kernel"][0, :2] = np.nan
    annotated = qlitert.annotate(lambda x: net.apply(bad, x), cal)
    assert_rejects(
        lambda: annotated(X), ValueError, "module 'layers_2'", "2 non-finite values",
        unchanged=(bad, X),
    )  # fmt: skip


def test_traced_range_updates_turn_a_non_finite_batch_into_a_nan_range():
    entry = jnp.array([-1.0, 3.0, 1.0], jnp.float32)
    new = np.asarray(update_range(entry, jnp.array([0.5, np.inf], jnp.float32), 0.5))
    assert np.all(np.isnan(new[:2])) and new[2] == 2.0
    scale, _ = qdq.range_params(jnp.float32(new[0]), jnp.float32(new[1]), "i8")
    assert np.isnan(scale)  # not the finite fallback scale 1


# -- save: validated, atomic, never replaces what is not ours ---------------------


def test_save_replaces_an_existing_model_only_with_overwrite(tfl, int_out_tfl, tmp_path):
    path = tmp_path / "m.tflite"
    qlitert.save(path, tfl)
    assert_rejects(
        lambda: qlitert.save(path, int_out_tfl), FileExistsError, str(path),
        "already holds a LiteRT model", "overwrite=True", unchanged=(tmp_path,),
    )  # fmt: skip
    assert qlitert.save(path, int_out_tfl, overwrite=True) == path
    assert path.read_bytes() == int_out_tfl
    assert [p.name for p in tmp_path.iterdir()] == ["m.tflite"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_save_never_replaces_another_file(tfl, tmp_path, overwrite):
    path = tmp_path / "notes.txt"
    path.write_text("my notes")
    assert_rejects(
        lambda: qlitert.save(path, tfl, overwrite=overwrite), FileExistsError, str(path),
        "not a LiteRT model", "never replaced", unchanged=(tmp_path,),
    )  # fmt: skip


def test_save_and_check_path_refuse_a_symbolic_link(tfl, tmp_path):
    target = tmp_path / "real.tflite"
    qlitert.save(target, tfl)
    link = tmp_path / "m.tflite"
    link.symlink_to(target)
    for call in (
        lambda: qlitert.check_path(link, overwrite=True),
        lambda: qlitert.save(link, tfl, overwrite=True),
    ):
        assert_rejects(
            call, FileExistsError, str(link), "is a symbolic link; pass the path it points to",
            unchanged=(tmp_path,),
        )  # fmt: skip
        assert link.is_symlink()


def test_save_writes_over_an_empty_file(tfl, tmp_path):
    path = tmp_path / "m.tflite"
    path.touch()
    qlitert.save(path, tfl)
    assert path.read_bytes() == tfl


# save writes through qcore.files.write_atomic (whose own tests fail every step, a
# half-written temporary included); here each os call it makes fails in turn.
STEPS = ["open", "fsync", "replace", "interrupt"]


@pytest.mark.parametrize("step", STEPS)
def test_a_failure_at_any_step_of_save_leaves_the_old_model_and_no_temporary(
    tfl, int_out_tfl, tmp_path, monkeypatch, step
):
    path = tmp_path / "m.tflite"
    qlitert.save(path, tfl)
    before = snapshot(tmp_path)

    def fail(*args):
        raise KeyboardInterrupt if step == "interrupt" else OSError(f"{step} failed")

    monkeypatch.setattr(os, "replace" if step == "interrupt" else step, fail)
    with pytest.raises((OSError, KeyboardInterrupt)):
        qlitert.save(path, int_out_tfl, overwrite=True)
    monkeypatch.undo()
    assert_unchanged(before, tmp_path)


def test_a_failed_directory_sync_after_the_rename_keeps_the_complete_new_model(
    tfl, int_out_tfl, tmp_path, monkeypatch
):
    path = tmp_path / "m.tflite"
    qlitert.save(path, tfl)
    calls = []
    real_fsync = os.fsync

    def second_fails(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError("directory sync not supported")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", second_fails)
    qlitert.save(path, int_out_tfl, overwrite=True)
    assert len(calls) == 2 and path.read_bytes() == int_out_tfl
    assert [p.name for p in tmp_path.iterdir()] == ["m.tflite"]


# -- damaged models: one clear error, never a crash -------------------------------


def test_every_truncation_is_a_clear_error_naming_the_input(tfl):
    lengths = sorted({*range(0, len(tfl), 7), *range(len(tfl) - 40, len(tfl))})
    for n in lengths:
        assert_rejects(
            lambda n=n: qlitert.inspect(tfl[:n]), ValueError, "tflite", "not a valid LiteRT model"
        )


def test_a_truncated_file_is_named_by_its_path(tfl, tmp_path):
    path = tmp_path / "cut.tflite"
    path.write_bytes(tfl[: len(tfl) // 2])
    for call in (qlitert.inspect, qlitert.LiteRTModel):
        assert_rejects(
            lambda call=call: call(path), ValueError, str(path), "truncated",
            unchanged=(tmp_path,),
        )  # fmt: skip


def repacked(tfl, edit):
    """``tfl`` unpacked, changed by ``edit(model)`` and packed again (a consistent flatbuffer)."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromPackedBuf(bytearray(tfl), 0)
    edit(model)
    builder = flatbuffers.Builder(len(tfl))
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def weight_tensor(model):
    return next(t for t in model.subgraphs[0].tensors if t.type == 9 and t.buffer > 0)


def activation_tensor(model):
    """The first int8 tensor without data: an activation."""
    buffers = model.buffers
    return next(
        t
        for t in model.subgraphs[0].tensors
        if t.type == 9 and (t.buffer == 0 or buffers[t.buffer].data is None)
    )


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        # An input of 2**32 values: LiteRT would try to allocate it.
        (lambda m: setattr(m.subgraphs[0].tensors[0], "shape", [2**20, 2**12]), "1048576, 4096"),
        # A weight whose shape no longer fits its bytes: LiteRT would read past them.
        (lambda m: setattr(weight_tensor(m), "shape", [3, 5]), "[3, 5]) holds 12 bytes"),
        (lambda m: setattr(weight_tensor(m).quantization, "zeroPoint", [0, 300, 0]), "300"),
        (lambda m: setattr(m.subgraphs[0].operators[1], "inputs", [0, 99]), "tensor 99"),
        (lambda m: setattr(m.subgraphs[0], "operators", []), "computed by no operator"),
        # A degenerate range's scale: LiteRT 2.3.0 aborted the process loading an ADD
        # with operand scales 0.07 and 1.3e36 (a sum with finfo.min, before the
        # additive mask became a select).
        (lambda m: setattr(activation_tensor(m).quantization, "scale", [1.3e36]), "(0, 1e+30]"),
    ],
)
def test_consistently_damaged_models_are_rejected_before_the_interpreter(tfl, edit, fragment):
    data = repacked(tfl, edit)
    for call in (qlitert.inspect, qlitert.LiteRTModel):
        assert_rejects(lambda call=call: call(data), ValueError, "tflite", fragment)


def test_random_byte_flips_give_a_clear_error_or_a_usable_model(tfl):
    rng = np.random.default_rng(18)
    loaded = rejected = 0
    for _ in range(400):
        data = bytearray(tfl)
        for _ in range(rng.integers(1, 4)):
            data[rng.integers(len(data))] ^= 1 << int(rng.integers(8))
        data = bytes(data)
        try:
            report = qlitert.inspect(data)
        except ValueError as e:
            assert "tflite is not a valid LiteRT model" in str(e)
            rejected += 1
            continue
        report.summary()  # every index in range: nothing fails later
        for op in report.ops:
            report.op_types(op)
        try:
            damaged = qlitert.LiteRTModel(data, num_threads=1)
        except ValueError as e:
            assert "tflite: LiteRT cannot load the model" in str(e)
            continue
        loaded += 1
        try:  # runs, or LiteRT names the op that failed
            damaged(*(np.zeros(d["shape"], d["dtype"]) for d in damaged.inputs))
        except RuntimeError as e:
            assert "Node number" in str(e)
    assert rejected > 100 and loaded > 20  # both paths were exercised


def test_int32_inputs_pass_unquantized_through_the_wrapper():
    table = np.linspace(-1, 1, 40, dtype=np.float32).reshape(10, 4)

    class Embedder(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return nn.Embed(10, 4, embedding_init=lambda *_: jnp.asarray(table))(ids)

    ids = np.array([[0, 3, 9]], np.int32)
    params = Embedder().init(jax.random.key(0), ids)

    def fn(i):
        return Embedder().apply(params, i)

    cal = qlitert.calibrate(fn, [ids])
    got = qlitert.LiteRTModel(qlitert.export(qlitert.annotate(fn, cal), ids))(ids)
    step = float(np.abs(table).max() / 127)  # the int8 table's step (per tensor)
    assert np.max(np.abs(got - table[ids])) <= step + 1e-6


class TokenModel(nn.Module):
    """int32 token ids looked up in an embedding, plus a float input, then Dense layers."""

    @nn.compact
    def __call__(self, ids, x):
        h = nn.Embed(50, 16)(ids) + nn.Dense(16)(x)
        return nn.Dense(4)(nn.relu(nn.Dense(16)(h)))


@pytest.fixture(scope="module")
def token_model():
    rng = np.random.default_rng(5)
    batches = [
        (rng.integers(0, 50, size=(2, 6)).astype(np.int32), rng.normal(size=(2, 6, 8)))
        for _ in range(3)
    ]
    batches = [(ids, x.astype(np.float32)) for ids, x in batches]
    params = TokenModel().init(jax.random.key(0), *batches[0])

    def fn(ids, x):
        return TokenModel().apply(params, ids, x)

    return fn, qlitert.calibrate(fn, batches), batches[0]


@pytest.mark.parametrize("quantize_io", [True, False])
@pytest.mark.parametrize("int8_io", [False, True])
def test_token_ids_go_in_unquantized_and_agree_with_the_annotated_model(
    token_model, int8_io, quantize_io
):
    # Issue 21, bug 5: the int32 ids of a token model, run with quantize_io=True.
    fn, cal, (ids, x) = token_model
    annotated = qlitert.annotate(fn, cal, int8_io=int8_io)
    s_in, z_in = cal.params("0:input1@")  # the float input's site (the ids have none)
    x_in = np.asarray(qdq.quantize(jnp.asarray(x), s_in, z_in)) if int8_io else x
    model = qlitert.LiteRTModel(qlitert.export(annotated, ids, x_in), quantize_io=quantize_io)
    ids_in = model.inputs[0]
    assert np.dtype(ids_in["dtype"]) == np.int32 and ids_in["quantization"] == (0.0, 0)
    out_key = next(k for k in cal.ranges if k.endswith(":output0@"))
    s_out, z_out = (float(v[0]) for v in cal.params(out_key))
    if int8_io:  # the model's output tensor has the output site's parameters
        np.testing.assert_allclose(model.outputs[0]["quantization"], (s_out, z_out), rtol=1e-6)

    def values(y, codes):
        y = np.asarray(y)
        return (y.astype(np.float64) - z_out) * s_out if codes else y.astype(np.float64)

    x_run = x if quantize_io else x_in  # codes in only for an int8-I/O model without conversion
    want = values(annotated(ids, x_in), int8_io)
    got = values(model(ids, x_run), int8_io and not quantize_io)
    assert np.max(np.abs(got - want)) <= s_out * (1 + 1e-4)  # within one output step
    # ids as int64 (numpy's default integers) are the same ids
    np.testing.assert_array_equal(model(ids.astype(np.int64), x_run), model(ids, x_run))
    # and close to the float model
    ref = np.asarray(fn(ids, x), np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05


def test_token_ids_out_of_range_or_float_are_refused_naming_the_input(token_model):
    fn, cal, (ids, x) = token_model
    model = qlitert.LiteRTModel(qlitert.export(qlitert.annotate(fn, cal), ids, x))
    for bad_id in (50, -51):  # -50..49 index the 50 rows (negative: from the end, as in JAX)
        bad = ids.copy()
        bad[1, 2] = bad_id
        lo, hi = min(int(bad.min()), bad_id), max(int(bad.max()), bad_id)
        assert_rejects(
            lambda b=bad: model(b, x), ValueError, "input 'serving_default_x0'",
            f"values in [{lo}, {hi}]", "GATHER_ND", "table of shape (50, 16)",
            "allowed: indices in [-50, 49]", unchanged=(bad, x),
        )  # fmt: skip
    floats = ids.astype(np.float32)
    assert_rejects(
        lambda: model(floats, x), TypeError, "input 'serving_default_x0'", "int32 values",
        "not quantized", "got float32", "allowed: an integer array", unchanged=(floats, x),
    )  # fmt: skip
    from_end = np.where(ids == ids[0, 0], ids - 50, ids)  # the same rows, counted from the end
    np.testing.assert_array_equal(model(from_end, x), model(ids, x))


# -- rejected inputs across the public API ----------------------------------------


def rule(**kw):
    return qflax.QuantizationRule(module_path=".*", **kw)


def call_cases(tfl, model, codes_model, tmp_path):
    """``name -> (call, error, fragments, unchanged)`` for one test each."""
    existing = tmp_path / "model.tflite"
    existing.write_bytes(tfl)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "keep.txt").write_text("keep")
    x, y = X.copy(), Y.copy()
    x3 = x[None]
    wide = np.array([[-300, 0, 1, 300]] * 2)
    nan = x.copy()
    nan[0, 0] = np.nan
    (b,) = jax.export.symbolic_shape("b")
    cal = qlitert.calibrate(jnp.tanh, [x])
    return {
        # save
        "save garbage over a model": (
            lambda: qlitert.save(existing, b"\x00" * 64),
            ValueError, ["tflite", "not a valid LiteRT model", "b'TFL3'"], (tmp_path,)),
        "save a truncated model": (
            lambda: qlitert.save(existing, tfl[:100]),
            ValueError, ["tflite", "truncated"], (tmp_path,)),
        "save text": (
            lambda: qlitert.save(existing, "model"),
            TypeError, ["tflite is a str", "allowed: the .tflite bytes"], (tmp_path,)),
        "save to a directory": (
            lambda: qlitert.save(folder, tfl),
            FileExistsError, [str(folder), "is a directory", "allowed: a .tflite file path"],
            (tmp_path,)),
        "save over another file": (
            lambda: qlitert.save(notes, tfl, overwrite=True),
            FileExistsError, [str(notes), "not a LiteRT model", "never replaced"], (tmp_path,)),
        "save into a missing directory": (
            lambda: qlitert.save(tmp_path / "nope" / "m.tflite", tfl),
            FileNotFoundError, ["nope", "directory does not exist"], (tmp_path,)),
        "save to a non-path": (
            lambda: qlitert.save(3, tfl),
            TypeError, ["path=3 is a int", "allowed: a str or os.PathLike"], (tmp_path,)),
        # inspect and load
        "inspect a short buffer": (
            lambda: qlitert.inspect(b"TFL"),
            ValueError, ["tflite", "3 bytes", "at least 8"], ()),
        "inspect another identifier": (
            lambda: qlitert.inspect(tfl[:4] + b"XYZW" + tfl[8:]),
            ValueError, ["tflite", "b'XYZW'", "b'TFL3'"], ()),
        "inspect a directory": (
            lambda: qlitert.inspect(folder),
            ValueError, [str(folder), "a directory", "allowed: a .tflite file"], (tmp_path,)),
        "inspect a missing file": (
            lambda: qlitert.inspect(tmp_path / "missing.tflite"),
            ValueError, ["missing.tflite", "is missing", "allowed: a .tflite file"],
            (tmp_path,)),
        "inspect a text file": (
            lambda: qlitert.inspect(notes),
            ValueError, [str(notes), "b'otes'", "b'TFL3'"], (tmp_path,)),
        "inspect a number": (
            lambda: qlitert.inspect(12),
            TypeError, ["tflite is a int", "allowed: the .tflite bytes or a file path"], ()),
        "load garbage": (
            lambda: qlitert.LiteRTModel(b"\x00" * 64),
            ValueError, ["tflite", "not a valid LiteRT model"], ()),
        "load a truncated model": (
            lambda: qlitert.LiteRTModel(tfl[: len(tfl) - 9]),
            ValueError, ["tflite", "truncated"], ()),
        "load with zero threads": (
            lambda: qlitert.LiteRTModel(tfl, num_threads=0),
            ValueError, ["num_threads=0", "allowed: an int >= 1"], ()),
        # model inputs
        "run with one input of two": (
            lambda: model(x),
            ValueError, ["takes 2 inputs", "'serving_default_x1'", "got 1"], (x,)),
        "run with three inputs": (
            lambda: model(x, y, y),
            ValueError, ["takes 2 inputs", "got 3"], (x, y)),
        "run with a wrong shape": (
            lambda: model(x[:1], y),
            ValueError, ["'serving_default_x0'", "shape (2, 4)", "got (1, 4)"], (x, y)),
        "run with a wrong rank": (
            lambda: model(x3, y),
            ValueError, ["'serving_default_x0'", "shape (2, 4)", "got (1, 2, 4)"], (x3, y)),
        "run with strings": (
            lambda: model(np.full((2, 4), "a"), y),
            TypeError, ["'serving_default_x0'", "dtype <U1", "allowed: a numeric array"], (y,)),
        "run with objects": (
            lambda: model([[None] * 4] * 2, y),
            TypeError, ["'serving_default_x0'", "dtype object", "numeric"], (y,)),
        "run codes with floats": (
            lambda: codes_model(x),
            TypeError, ["'serving_default_x0'", "takes int8 codes", "got float32",
                        "allowed: an integer array"], (x,)),
        "run codes out of range": (
            lambda: codes_model(wide),
            ValueError, ["'serving_default_x0'", "[-300, 300]", "int8 codes in [-128, 127]"],
            (wide,)),
        # export
        "export a non-callable": (
            lambda: qlitert.export("f", x),
            TypeError, ["fn is a str", "allowed: a callable"], (x,)),
        "export without inputs": (
            lambda: qlitert.export(dense),
            qlitert.ExportError, ["no example input", "allowed: 1 or more"], ()),
        "export with NaN inputs": (
            lambda: qlitert.export(dense, nan),
            qlitert.ExportError, ["example_inputs[0]", "1 non-finite", "validate=False"], (nan,)),
        "export string inputs": (
            lambda: qlitert.export(dense, np.array(["a"])),
            TypeError, ["example_inputs[0]", "dtype <U1", "allowed: numeric arrays"], ()),
        "export too few input names": (
            lambda: qlitert.export(two, x, y, input_names=["a"]),
            qlitert.ExportError, ["input_names=['a']", "allowed: 2 distinct"], (x, y)),
        "export repeated output names": (
            lambda: qlitert.export(two, x, y, output_names=["o", "o"]),
            qlitert.ExportError, ["output_names=['o', 'o']", "allowed: 2 distinct"], (x, y)),
        "export lowercase compute types": (
            lambda: qlitert.export(dense, x, compute_types=["int8"]),
            qlitert.ExportError, ["compute_types=['int8']", "allowed: names among", "'INT8'"],
            (x,)),
        "export a shape spec with validation": (
            lambda: qlitert.export(dense, jax.ShapeDtypeStruct((2, 4), jnp.float32)),
            qlitert.ExportError, ["example_inputs[0]", "validate=True needs arrays"], ()),
        "export a symbolic shape": (
            lambda: qlitert.export(
                dense, jax.ShapeDtypeStruct((b, 4), jnp.float32), validate=False),
            qlitert.ExportError, ["example_inputs[0]", "symbolic shape", "static shape"], ()),
        # calibrate
        "calibrate on one array": (
            lambda: qlitert.calibrate(jnp.tanh, x),
            TypeError, ["batches is one array", "(2, 4)", "allowed: an iterable"], (x,)),
        "calibrate on no batches": (
            lambda: qlitert.calibrate(jnp.tanh, []),
            ValueError, ["batches is empty", "allowed: at least one batch"], ()),
        "calibrate on an empty batch": (
            lambda: qlitert.calibrate(jnp.tanh, [x, np.zeros((0, 4), np.float32)]),
            ValueError, ["batches[1]", "(0, 4)", "allowed: non-empty arrays"], (x,)),
        "calibrate on strings": (
            lambda: qlitert.calibrate(jnp.tanh, [np.array(["a", "b"])]),
            TypeError, ["batches[0]", "dtype <U1", "allowed: numeric arrays"], ()),
        "calibrate on a changing rank": (
            lambda: qlitert.calibrate(jnp.tanh, [x, x3]),
            ValueError, ["batches[1]", "(1, 2, 4)", "batches[0] (2, 4)", "same rank"], (x, x3)),
        "calibrate on a changing input count": (
            lambda: qlitert.calibrate(lambda a, b=None: jnp.tanh(a), [x, (x, y)]),
            ValueError, ["batches[1] has 2 inputs", "batches[0] 1", "same inputs"], (x, y)),
        "calibrate on NaN": (
            lambda: qlitert.calibrate(jnp.tanh, [x, nan]),
            ValueError, ["batches[1]", "1 non-finite values (NaN or inf)"], (x, nan)),
        "calibrate with momentum 1": (
            lambda: qlitert.calibrate(jnp.tanh, [x], momentum=1.0),
            ValueError, ["momentum=1.0", "allowed: 0 <= momentum < 1"], (x,)),
        "calibrate with a NaN momentum": (
            lambda: qlitert.calibrate(jnp.tanh, [x], momentum=float("nan")),
            ValueError, ["momentum=nan", "allowed: 0 <= momentum < 1"], (x,)),
        "calibrate with a string momentum": (
            lambda: qlitert.calibrate(jnp.tanh, [x], momentum="0.9"),
            TypeError, ["momentum='0.9'", "allowed: a float in [0, 1)"], (x,)),
        "calibration never run on a site": (
            lambda: cal.params("nowhere"),
            KeyError, ["'nowhere' was never calibrated"], (cal,)),
        "calibration state of other sites": (
            lambda: cal.with_state({"t": jnp.zeros(3)}),
            ValueError, ["missing sites", "unknown sites ['t']"], (cal,)),
        "calibration state with NaN": (
            lambda: cal.with_state({site: jnp.array([np.nan, 1.0, 2.0]) for site in cal.ranges}),
            ValueError, ["state['0:input0@']", "[nan, 1.0, 2.0]", "allowed: finite"], (cal,)),
        # rules
        "rule with int4 activations": (
            lambda: rules.check([rule(act_qtype="int4")]),
            ValueError, ["rules[0].act_qtype='int4'", "['int8', 'int16']"], ()),
        "rule with int16 weights": (
            lambda: rules.check([rule(weight_qtype="int16")]),
            ValueError, ["rules[0].weight_qtype='int16'", "['int8', 'int4']"], ()),
        "rule with 16x4": (
            lambda: rules.check([rule(act_qtype="int16", weight_qtype="int4")]),
            ValueError, ["rules[0]", "int16 activations need int8 weights"], ()),
        "rule with tiles": (
            lambda: rules.check([rule(act_qtype="int8", tile_size={-1: 4})]),
            ValueError, ["rules[0].tile_size=", "leave it at None"], ()),
        "rule with mse activations": (
            lambda: rules.check([rule(act_qtype="int8", act_calibration_method="mse")]),
            ValueError, ["rules[0].act_calibration_method='mse'", "leave it at 'absmax'"], ()),
        "rule with a rotation": (
            lambda: rules.check([rule(act_qtype="int8", rotation="hadamard")]),
            ValueError, ["rules[0].rotation='hadamard'", "leave it at None"], ()),
        "rule that is a dict": (
            lambda: rules.check([{"module_path": ".*"}]),
            ValueError, ["rules[0]={'module_path': '.*'}", "qflax.QuantizationRule"], ()),
        # qdq
        "fake_quant with u8": (
            lambda: qdq.fake_quant(jnp.ones(3), 0.1, dtype="u8"),
            ValueError, ["dtype='u8'", "['i8', 'i16', 'i4']"], ()),
        "fake_quant with scale 0": (
            lambda: qdq.fake_quant(jnp.ones(3), 0.0),
            ValueError, ["scale=[0.0]", "finite and > 0"], ()),
        "fake_quant with a NaN scale": (
            lambda: qdq.fake_quant(jnp.ones(3), float("nan")),
            ValueError, ["scale=[nan]", "finite and > 0"], ()),
        "fake_quant scales without an axis": (
            lambda: qdq.fake_quant(jnp.ones((2, 3)), [0.1, 0.2]),
            ValueError, ["2 scales need axis="], ()),
        "activation_params of NaN": (
            lambda: qdq.activation_params(np.nan, 1.0),
            ValueError, ["lo=nan", "allowed: finite bounds"], ()),
    }  # fmt: skip


CASES = [
    "save garbage over a model", "save a truncated model", "save text", "save to a directory",
    "save over another file", "save into a missing directory", "save to a non-path",
    "inspect a short buffer", "inspect another identifier", "inspect a directory",
    "inspect a missing file", "inspect a text file", "inspect a number", "load garbage",
    "load a truncated model", "load with zero threads", "run with one input of two",
    "run with three inputs", "run with a wrong shape", "run with a wrong rank",
    "run with strings", "run with objects", "run codes with floats", "run codes out of range",
    "export a non-callable", "export without inputs",
    "export with NaN inputs", "export string inputs", "export too few input names",
    "export repeated output names", "export lowercase compute types",
    "export a shape spec with validation", "export a symbolic shape", "calibrate on one array",
    "calibrate on no batches", "calibrate on an empty batch", "calibrate on strings",
    "calibrate on a changing rank", "calibrate on a changing input count", "calibrate on NaN",
    "calibrate with momentum 1", "calibrate with a NaN momentum",
    "calibrate with a string momentum", "calibration never run on a site",
    "calibration state of other sites", "calibration state with NaN",
    "rule with int4 activations", "rule with int16 weights", "rule with 16x4", "rule with tiles",
    "rule with mse activations", "rule with a rotation",
    "rule that is a dict", "fake_quant with u8",
    "fake_quant with scale 0", "fake_quant with a NaN scale", "fake_quant scales without an axis",
    "activation_params of NaN",
]  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_rejects(tfl, model, codes_model, tmp_path, name):
    call, error, fragments, unchanged = call_cases(tfl, model, codes_model, tmp_path)[name]
    assert_rejects(call, error, *fragments, unchanged=unchanged)


def test_every_case_is_run(tfl, model, codes_model, tmp_path):
    cases = call_cases(tfl, model, codes_model, tmp_path)
    assert sorted(CASES) == sorted(cases) and len(CASES) >= 35

"""Quantization report and mixed-precision search, checked against float64 numpy."""

import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qflax
from qflax.mixed_precision import mixed_precision
from qflax.report import quantization_report

TILE = 16


class MLP(nn.Module):
    """32 -> 64 -> 64 -> 8; ``a`` gets outlier input rows, so it is the sensitive layer."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="a")(x))
        x = nn.relu(nn.Dense(64, name="b")(x))
        return nn.Dense(8, name="head")(x)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(32, 64, rngs=rngs)
        self.b = nnx.Linear(64, 64, rngs=rngs)
        self.head = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.a(x))
        x = nnx.relu(self.b(x))
        return self.head(x)


@pytest.fixture(scope="module")
def setup():
    x = jax.random.normal(jax.random.key(1), (16, 32))
    params = MLP().init(jax.random.key(0), x)["params"]
    # A large positive entry in every tile of layer a: int4 loses its small weights. (Positive,
    # so the tile's bound maps to +7.5 steps and saturates to 7: a negative one would sit on a
    # rounding tie that float32 ulps decide.)
    k = np.array(params["a"]["kernel"])
    k[::TILE, :] = 40.0 * np.abs(k[::TILE, :])
    params = {**params, "a": {**params["a"], "kernel": jnp.asarray(k)}}
    # ...and inputs that are small there, so the small weights carry the signal.
    damp = jnp.where(jnp.arange(32) % TILE == 0, 1 / 40, 1.0).astype(jnp.float32)
    batches = [x * damp, jax.random.normal(jax.random.key(2), (16, 32)) * damp]  # one shape
    return params, batches


def _float_out(params, batches):
    return [np.asarray(MLP().apply({"params": params}, b), np.float64) for b in batches]


def _sqnr(ref, got):
    signal = sum(float(np.sum(r**2)) for r in ref)
    noise = sum(float(np.sum((r - g) ** 2)) for r, g in zip(ref, got, strict=True))
    return 10 * math.log10(signal / noise)


def _int4_tiled_numpy(w, tile):
    """Symmetric int4 (codes -8..7, bound at 7.5 steps), one scale per tile of the input axis."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    tiles = w.reshape(k // tile, tile, n)
    scale = (np.max(np.abs(tiles), axis=1, keepdims=True) / np.float32(7.5)).astype(np.float32)
    codes = np.clip(np.rint(tiles / scale), -8, 7)
    return (codes * scale).reshape(k, n).astype(np.float32)


def _run_rules(rules, params, batches):
    qmodel = qflax.quantize_model(MLP(), qflax.PtqProvider(rules))
    outs, qparams = [], None
    for b in batches:
        y, new = qmodel.apply({"params": params}, b, mutable=["params"])
        outs.append(np.asarray(y, np.float64))
        qparams = qparams or new["params"]
    return outs, qparams


def _all_bytes(tree):
    leaves = jax.tree.leaves(tree)
    return sum(int(np.asarray(leaf).nbytes) for leaf in leaves)


RULES = [qflax.QuantizationRule(weight_qtype="int4", tile_size=TILE)]


def test_report_numbers_match_an_independent_computation(setup):
    params, batches = setup
    report = quantization_report(MLP(), params, RULES, batches, jit=False, progress=False)
    assert [(r.module_path, r.op_name) for r in report.rows] == [
        ("a", "dot_general"),
        ("b", "dot_general"),
        ("head", "dot_general"),
    ]
    row = report.rows[0]
    assert row.shapes == ((16, 32), (32, 64))
    assert row.weights == ("a/kernel",)
    assert (row.weight_qtype, row.tile_size, row.act_qtype) == ("int4", TILE, None)

    # Weight SQNR from a numpy int4 quantizer, in float64.
    w = np.asarray(params["a"]["kernel"], np.float64)
    deq = _int4_tiled_numpy(params["a"]["kernel"], TILE).astype(np.float64)
    want_w = 10 * math.log10(np.sum(w**2) / np.sum((w - deq) ** 2))
    assert row.weight_sqnr_db == pytest.approx(want_w, abs=1e-3)

    # Output SQNR: only layer a quantized by hand, the float model run on it.
    ref = _float_out(params, batches)
    by_hand = {**params, "a": {**params["a"], "kernel": jnp.asarray(deq, jnp.float32)}}
    want_out = _sqnr(ref, _float_out(by_hand, batches))
    assert row.output_sqnr_db == pytest.approx(want_out, abs=0.02)

    # Bytes: packed int4 codes (half a byte each) + one float32 scale per tile and column,
    # which is what the QArray in the quantized model holds.
    assert row.quantized_bytes == 32 * 64 // 2 + (32 // TILE) * 64 * 4
    _, qparams = _run_rules(RULES, params, batches[:1])
    assert qparams is not None
    qa = qparams["a"]["kernel"].qarray
    assert row.quantized_bytes == qa.nbytes == _all_bytes(qa)
    assert row.float_bytes == 32 * 64 * 4
    # Totals: every param, quantized where the rules quantize it.
    assert report.quantized_bytes == _all_bytes(qparams)
    assert report.float_bytes == _all_bytes(params)
    full, _ = _run_rules(RULES, params, batches)
    assert report.output_sqnr_db == pytest.approx(_sqnr(ref, full), abs=1e-6)
    # The outlier layer is the most sensitive one.
    assert row.output_sqnr_db < min(r.output_sqnr_db for r in report.rows[1:])


def test_report_text_json_and_png(setup, tmp_path):
    params, batches = setup
    rules = [
        qflax.QuantizationRule(module_path="head", weight_qtype="int8", act_qtype="int8"),
        *RULES,
    ]
    report = quantization_report(MLP(), params, rules, batches[:1], jit=False, progress=False)
    text = report.to_text()
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["module", "path"]
    assert lines[2].split()[:4] == ["a", "dot_general", "16x32", "32x64"]
    assert "w:int8 a:int8" in lines[4]
    assert len({len(line) for line in lines[:5]}) <= 2  # aligned columns (rstrip may cut)
    assert lines[-1].startswith("all params:")
    data = json.loads(report.to_json())
    assert [r["module_path"] for r in data["rows"]] == ["a", "b", "head"]
    assert data["rows"][2]["act_qtype"] == "int8"
    assert data["float_bytes"] == report.float_bytes
    png = report.plot(tmp_path / "report.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image  # noqa: PLC0415 - the test venv has matplotlib

    assert matplotlib.image.imread(png).ndim == 3


def test_report_progress_and_jit(setup, capsys):
    params, batches = setup
    rules = [qflax.QuantizationRule(module_path="head", weight_qtype="int8")]
    jitted = quantization_report(MLP(), params, rules, batches, progress=True)  # jit=True
    assert "quantization report: 1/1" in capsys.readouterr().err  # no tqdm here: stderr
    eager = quantization_report(MLP(), params, rules, batches, jit=False, progress=False)
    assert jitted.rows[0].quantized_bytes == eager.rows[0].quantized_bytes
    assert jitted.rows[0].weight_sqnr_db == eager.rows[0].weight_sqnr_db
    assert jitted.rows[0].output_sqnr_db == pytest.approx(eager.rows[0].output_sqnr_db, abs=1e-3)


def test_report_nnx_matches_linen(setup):
    params, batches = setup
    model = NnxMLP(nnx.Rngs(0))
    for name in ("a", "b", "head"):
        layer = getattr(model, name)
        layer.kernel.set_raw_value(params[name]["kernel"])
        layer.bias.set_raw_value(params[name]["bias"])
    linen = quantization_report(MLP(), params, RULES, batches, jit=False, progress=False)
    nnx_report = quantization_report(model, None, RULES, batches, progress=False)  # nnx.jit
    assert [(r.module_path, r.quantized_bytes, r.float_bytes) for r in nnx_report.rows] == [
        (r.module_path, r.quantized_bytes, r.float_bytes) for r in linen.rows
    ]
    for a, b in zip(nnx_report.rows, linen.rows, strict=True):
        assert a.weight_sqnr_db == pytest.approx(b.weight_sqnr_db, abs=1e-6)
        assert a.output_sqnr_db == pytest.approx(b.output_sqnr_db, abs=0.01)
    # The model itself is not quantized.
    assert isinstance(model.a.kernel.get_raw_value(), jax.Array)


def test_mixed_precision_within_budget_beats_uniform_int4(setup):
    params, batches = setup
    ref = _float_out(params, batches)
    uniform, uq = _run_rules(RULES, params, batches)
    int4_bytes = _all_bytes(uq)
    int4_err = 10 ** (-_sqnr(ref, uniform) / 10)

    # Same budget as uniform int4: at least as good.
    same = mixed_precision(
        MLP(),
        params,
        batches,
        candidates=("int8", "int4", None),
        budget_bytes=int4_bytes,
        tile_size=TILE,
        jit=False,
        progress=False,
    )
    assert same.total_bytes <= int4_bytes
    assert same.error <= int4_err * (1 + 1e-9)

    # A little more room: the sensitive layer gets int8, strictly better than int4.
    room = 32 * 64 - 32 * 64 // 2  # int8 codes minus int4 codes of layer a (same scales)
    result = mixed_precision(
        MLP(),
        params,
        batches,
        candidates=("int8", "int4"),
        budget_bytes=int4_bytes + room,
        tile_size=TILE,
        jit=False,
        progress=False,
    )
    assert result.assignment[("a", "dot_general")] == "int8"
    assert result.total_bytes <= result.budget_bytes == int4_bytes + room
    assert result.error < int4_err / 2
    # The rules reproduce the claimed bytes and error when users run them.
    outs, qparams = _run_rules(list(result.rules), params, batches)
    assert _all_bytes(qparams) == result.total_bytes
    assert result.output_sqnr_db == pytest.approx(_sqnr(ref, outs), abs=1e-6)
    assert all(r.module_path in ("a", "b", "head") for r in result.rules)
    assert "total" in result.to_text()


def test_mixed_precision_ratio_and_float_candidate(setup):
    params, batches = setup
    result = mixed_precision(
        MLP(),
        params,
        batches[:1],
        candidates=("int8", None),
        budget_ratio=0.6,
        tile_size={"int8": TILE},
        jit=False,
        progress=False,
    )
    assert result.budget_bytes == int(0.6 * _all_bytes(params))
    assert result.total_bytes <= result.budget_bytes
    assert None in result.assignment.values()  # some layer stays float
    assert len(result.rules) == sum(q is not None for q in result.assignment.values())


@pytest.mark.filterwarnings("ignore:quantization rule with module_path='nope'")
def test_bad_inputs(setup):
    params, batches = setup
    with pytest.raises(ValueError, match="no calibration data: calibration_batches is empty"):
        quantization_report(MLP(), params, RULES, [], jit=False, progress=False)
    with pytest.raises(ValueError, match="no calibration data"):
        mixed_precision(MLP(), params, iter([]), budget_ratio=0.5, jit=False, progress=False)
    with pytest.raises(ValueError, match=r"calibration_batches must be an iterable of batches"):
        quantization_report(MLP(), params, RULES, batches[0], jit=False, progress=False)
    with pytest.raises(ValueError, match=r"candidates: 'int3x' is not a qtype: .*int8"):
        mixed_precision(
            MLP(), params, batches, candidates=("int8", "int3x"), budget_ratio=0.5, jit=False
        )
    with pytest.raises(ValueError, match="give exactly one of budget_bytes=None"):
        mixed_precision(MLP(), params, batches)
    with pytest.raises(ValueError, match="give exactly one of"):
        mixed_precision(MLP(), params, batches, budget_bytes=10_000, budget_ratio=0.5, jit=False)
    with pytest.raises(
        ValueError, match=r"budget 1000 bytes .* is below the smallest possible total (\d+) bytes"
    ) as info:
        mixed_precision(
            MLP(),
            params,
            batches[:1],
            candidates=("int8", "int4"),
            budget_bytes=1000,
            jit=False,
            progress=False,
        )
    # The minimum it names: every weight int4 (per channel), biases float.
    want = sum(k * n // 2 + n * 4 + n * 4 for k, n in ((32, 64), (64, 64), (64, 8)))
    assert f"smallest possible total {want} bytes" in str(info.value)
    with pytest.raises(ValueError, match="selects no op with a weight"):
        mixed_precision(MLP(), params, batches, module_path="nope", budget_ratio=0.5, jit=False)
    with pytest.raises(ValueError, match="quantize no op of this model"):
        quantization_report(
            MLP(),
            params,
            [qflax.QuantizationRule(module_path="nope", weight_qtype="int8")],
            batches,
            jit=False,
            progress=False,
        )
    with pytest.raises(ValueError, match="already quantized"):
        _, qparams = _run_rules(RULES, params, batches[:1])
        quantization_report(MLP(), qparams, RULES, batches, jit=False, progress=False)
    with pytest.raises(ValueError, match="pass params=None"):
        quantization_report(NnxMLP(nnx.Rngs(0)), params, RULES, batches, jit=False, progress=False)

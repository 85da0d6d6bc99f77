"""qflax.CalibrationData: one checked calibration-input value for every algorithm.

The older call form (model, params, [rules,] batches, method=...) keeps working with a
DeprecationWarning and gives exactly what the new form gives; the renamed modules and
classes (qflax.calibration, qflax.recipe, report.Site) answer with a warning.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qflax
from qflax import awq, gptq, layer_stats, mixed_precision, presets, report, smoothquant


class Encoder(nn.Module):
    """Two Dense layers in ``__call__``; ``encode`` runs only the first."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="out")(nn.relu(self.encode(x)))

    @nn.compact
    def encode(self, x):
        return nn.Dense(16, name="hidden")(x)


RULES = [qflax.QuantizationRule(weight_qtype="int4", tile_size=8)]
TILES = {"int4": 8, "nf4": 8}


@pytest.fixture(scope="module")
def setup():
    batches = [jax.random.normal(jax.random.key(i), (4, 16)) for i in range(2)]
    params = Encoder().init(jax.random.key(0), batches[0])["params"]
    return params, batches


def _leaves(tree):
    return [np.asarray(getattr(x, "qvalue", x)) for x in jax.tree.leaves(tree)]


def _same(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


# -- checks made once, when the value is made --------------------------------------------


def test_a_model_that_is_not_flax_is_refused():
    with pytest.raises(ValueError, match=r"model=str is neither a flax.linen nor an nnx.Module"):
        qflax.CalibrationData("net", {}, [])


def test_params_must_match_the_flavour(setup):
    params, batches = setup
    with pytest.raises(ValueError, match=r"Linen model needs its float params"):
        qflax.CalibrationData(Encoder(), None, batches)
    linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"NNX model carries its own params.*got dict"):
        qflax.CalibrationData(linear, params, batches)


@pytest.mark.parametrize(
    ("batches", "message"),
    [
        (jnp.ones((2, 16)), r"batches must be an iterable of .* not one array of shape \(2, 16\)"),
        (np.ones(3), r"batches must be an iterable of .* not one array of shape \(3,\)"),
        (3, r"batches=int is not allowed; allowed: an iterable"),
        ("abc", r"batches=str is not allowed"),
        ({"x": 1}, r"batches=dict is not allowed"),
    ],
)
def test_batches_that_are_not_an_iterable_of_inputs_are_refused(setup, batches, message):
    with pytest.raises(ValueError, match=message):
        qflax.CalibrationData(Encoder(), setup[0], batches)


def test_an_unknown_method_is_refused(setup):
    with pytest.raises(ValueError, match=r"method='decode' is not a method of Encoder"):
        qflax.CalibrationData(Encoder(), setup[0], setup[1], method="decode")


def test_inputs_are_tuples_of_positional_arguments(setup):
    x = setup[1][0]
    data = qflax.CalibrationData(Encoder(), setup[0], [x, (x, 1)])
    got = list(data.inputs())
    assert [len(a) for a in got] == [1, 2] and got[0][0] is x and got[1][1] == 1
    assert list(data.inputs()) == got  # a list serves any number of algorithms


def test_an_iterator_is_read_once_and_a_second_use_says_so(setup):
    params, batches = setup
    data = qflax.CalibrationData(Encoder(), params, (b for b in batches))
    stats = layer_stats.collect(data, RULES, progress=False)
    assert int(stats["hidden/kernel"].count) == 8
    with pytest.raises(
        ValueError, match=r"iterator that an earlier call already read \(also when that call"
    ):
        gptq.gptq(data, RULES, progress=False)


def test_no_batches_is_an_error_unless_stats_are_given(setup):
    params, batches = setup
    data = qflax.CalibrationData(Encoder(), params)
    with pytest.raises(ValueError, match=r"no calibration data: data.batches=None"):
        gptq.gptq(data, RULES, progress=False)
    stats = layer_stats.collect(data.with_batches(batches), RULES, progress=False)
    _same(
        gptq.gptq(data, RULES, stats=stats, progress=False),
        gptq.gptq(data.with_batches(batches), RULES, progress=False),
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda d: layer_stats.collect(d, RULES, progress=False),
        lambda d: gptq.gptq(d, RULES, progress=False),
        lambda d: report.quantization_report(d, RULES, progress=False),
        lambda d: mixed_precision.mixed_precision(d, budget_ratio=0.5, progress=False),
        lambda d: presets.four_bit(d, progress=False),
    ],
)
def test_something_else_in_place_of_the_data_is_refused(call):
    with pytest.raises(
        ValueError, match=r"data=list is not allowed; allowed: a qflax.CalibrationData"
    ):
        call([jnp.ones((4, 16))])


def test_the_method_reaches_every_algorithm(setup):
    """``method="encode"`` runs only ``hidden``: the report and the statistics see only it."""
    params, batches = setup
    data = qflax.CalibrationData(Encoder(), params, batches, method="encode")
    rows = report.quantization_report(data, RULES, jit=False, progress=False).rows
    assert [r.module_path for r in rows] == ["hidden"]
    assert list(layer_stats.collect(data, RULES, progress=False)) == ["hidden/kernel"]
    # The report's reference is the float encode output, computed here independently.
    runner = report.Runner(data, jit=False)
    want = np.asarray(Encoder().apply({"params": params}, batches[0], method="encode"))
    np.testing.assert_array_equal(runner.reference[0][0], want)


# -- the older form: same results, one DeprecationWarning -------------------------------


def _old_and_new(setup):
    params, batches = setup
    data = qflax.CalibrationData(Encoder(), params, batches)
    m = Encoder()
    return [
        (
            lambda: layer_stats.collect(m, params, RULES, batches, progress=False),
            lambda: layer_stats.collect(data, RULES, progress=False),
        ),
        (
            lambda: layer_stats.stats_or_collect(None, m, params, RULES, batches, progress=False),
            lambda: layer_stats.stats_or_collect(None, data, RULES, progress=False),
        ),
        (
            lambda: gptq.gptq(m, params, RULES, calibration_batches=batches, progress=False),
            lambda: gptq.gptq(data, RULES, progress=False),
        ),
        (
            lambda: awq.awq(m, params, RULES, batches, grid=4, progress=False),
            lambda: awq.awq(data, RULES, grid=4, progress=False),
        ),
        (
            lambda: smoothquant.smoothquant(m, params, RULES, batches, progress=False),
            lambda: smoothquant.smoothquant(data, RULES, progress=False),
        ),
        (
            lambda: report.quantization_report(m, params, RULES, batches, progress=False).rows,
            lambda: report.quantization_report(data, RULES, progress=False).rows,
        ),
        (
            lambda: (
                mixed_precision.mixed_precision(
                    m, params, batches, budget_ratio=0.4, progress=False
                ).assignment
            ),
            lambda: (
                mixed_precision.mixed_precision(data, budget_ratio=0.4, progress=False).assignment
            ),
        ),
        (
            lambda: (
                presets.four_bit(
                    m, params, batches, tile_size=TILES, budget_ratio=0.5, progress=False
                ).params
            ),
            lambda: (
                presets.four_bit(data, tile_size=TILES, budget_ratio=0.5, progress=False).params
            ),
        ),
        (
            lambda: report.Runner(m, params, batches, jit=False).reference,
            lambda: report.Runner(data, jit=False).reference,
        ),
    ]


@pytest.mark.parametrize("i", range(9))
def test_the_older_form_warns_and_gives_the_same_result(setup, i):
    old, new = _old_and_new(setup)[i]
    with pytest.warns(DeprecationWarning, match=r"deprecated; pass one qflax.CalibrationData"):
        before = old()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        after = new()
    if isinstance(after, tuple) and after and isinstance(after[0], report.ReportRow):
        assert before == after
    elif isinstance(after, dict) and all(
        isinstance(v, layer_stats.LayerStats) for v in after.values()
    ):
        assert list(before) == list(after)
        for k in after:
            np.testing.assert_array_equal(before[k].hessian, after[k].hessian)
            assert before[k].site == after[k].site
    else:
        _same(before, after)


def test_the_older_form_keeps_its_method_keyword(setup):
    params, batches = setup
    with pytest.warns(DeprecationWarning):
        stats = layer_stats.collect(
            Encoder(), params, RULES, batches, method="encode", progress=False
        )
    assert list(stats) == ["hidden/kernel"]


# -- renamed modules and classes ---------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("calibration", "collect", layer_stats.collect),
        ("calibration", "Site", layer_stats.WeightUse),
        ("calibration", "LayerStats", layer_stats.LayerStats),
        ("calibration", "stats_or_collect", layer_stats.stats_or_collect),
        ("calibration", "SUPPORTED_OPS", layer_stats.SUPPORTED_OPS),
        ("recipe", "four_bit", presets.four_bit),
        ("recipe", "RecipeRow", presets.OpChoice),
        ("recipe", "FourBitResult", presets.FourBitResult),
        ("report", "Site", report.QuantizedOp),
    ],
)
def test_old_names_answer_with_a_warning(module, old, new):
    with pytest.warns(DeprecationWarning, match=rf"qflax.{module}.{old} is deprecated; use "):
        assert getattr(getattr(qflax, module), old) is new


@pytest.mark.parametrize("module", ["calibration", "recipe", "report"])
def test_an_unknown_name_of_a_renamed_module_is_an_attribute_error(module):
    with pytest.raises(AttributeError, match="has no attribute 'WeightUses'"):
        _ = getattr(qflax, module).WeightUses


# -- findings of a new-user trial ---------------------------------------------------------


def test_a_tuple_of_arrays_is_refused_as_ambiguous(setup):
    """One batch of two inputs, or two batches? A tuple of arrays ran as two batches."""
    x = setup[1][0]
    with pytest.raises(ValueError, match=r"batches is a tuple of 2 arrays.*pass \[\(x, y\)\]"):
        qflax.CalibrationData(Encoder(), setup[0], (x, x))
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ValueError, match="calibration_batches is"),
    ):
        gptq.gptq(Encoder(), setup[0], RULES, (x, x), progress=False)
    data = qflax.CalibrationData(Encoder(), setup[0], ((x,), (x,)))  # tuples of inputs: fine
    assert data.num_batches == 2


def test_stats_collected_with_other_rules_are_refused(setup):
    params, batches = setup
    data = qflax.CalibrationData(Encoder(), params, batches)
    stats = layer_stats.collect(data, RULES, progress=False)
    int8 = [qflax.QuantizationRule(weight_qtype="int8")]
    for call in (
        lambda: gptq.gptq(data, int8, stats=stats, progress=False),
        lambda: awq.awq(data, int8, stats=stats, progress=False),
    ):
        with pytest.raises(ValueError, match=r"stats\['hidden/kernel'\] was collected for hidden"):
            call()
    _same(  # the same rules: the statistics are reused
        gptq.gptq(data, RULES, stats=stats, progress=False), gptq.gptq(data, RULES, progress=False)
    )


def test_linen_params_must_be_a_mapping(setup):
    with pytest.raises(ValueError, match=r"params=list is not allowed; allowed: the Linen"):
        qflax.CalibrationData(Encoder(), setup[1], None)  # params forgotten: batches in its place


def test_a_model_where_the_data_goes_says_how_to_make_the_data(setup):
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(
            ValueError, match=r"gptq: got a model where the data goes; pass qflax.CalibrationData"
        ),
    ):
        gptq.gptq(Encoder(), RULES)


def test_the_repr_is_a_summary(setup):
    params, batches = setup
    data = qflax.CalibrationData(Encoder(), params, batches, method="encode")
    assert repr(data) == (
        "CalibrationData(model=Encoder, params=given, batches=2, method='encode')"
    )
    assert "batches=an iterator" in repr(data.with_batches(iter(batches)))


class Dropout(nn.Module):
    """Needs ``deterministic`` as a keyword, as most Flax models with dropout do."""

    @nn.compact
    def __call__(self, x, *, deterministic):
        return nn.Dense(8, name="out")(nn.Dropout(0.5, deterministic=deterministic)(x))


def test_kwargs_reach_every_call(setup):
    x = setup[1][0]
    params = Dropout().init(jax.random.key(0), x, deterministic=True)["params"]
    data = qflax.CalibrationData(Dropout(), params, [x], kwargs={"deterministic": True})
    assert "kwargs={'deterministic': True}" in repr(data)
    stats = layer_stats.collect(data, RULES, progress=False)
    xf = np.asarray(x, np.float64)  # float64 reference: sum x^T x over the batch's rows
    np.testing.assert_allclose(stats["out/kernel"].hessian, xf.T @ xf, rtol=1e-5, atol=1e-4)
    want = np.asarray(Dropout().apply({"params": params}, x, deterministic=True))
    np.testing.assert_array_equal(report.Runner(data, jit=False).reference[0][0], want)
    assert report.quantization_report(data, RULES, progress=False).rows[0].module_path == "out"
    with pytest.raises(ValueError, match=r"kwargs=\['deterministic'\] is not allowed; allowed: a"):
        qflax.CalibrationData(Dropout(), params, [x], kwargs=["deterministic"])


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("encdoe", r"method='encdoe' is not a method of Encoder.*did you mean 'encode'\?"),
        (Encoder.encode, r"method=<function Encoder.encode.*allowed: the name \(a str\)"),
    ],
)
def test_a_wrong_method_gets_a_helpful_message(setup, method, message):
    with pytest.raises(ValueError, match=message):
        qflax.CalibrationData(Encoder(), setup[0], setup[1], method=method)


def test_the_older_form_refuses_options_given_by_position(setup):
    params, batches = setup
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(
            TypeError, match=r"gptq\(\) takes its options as keywords after calibration_batches"
        ),
    ):
        gptq.gptq(Encoder(), params, RULES, batches, 64)

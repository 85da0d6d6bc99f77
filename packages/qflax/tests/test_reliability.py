"""Reliability: bad or extreme inputs to qflax's public API, and its NaN/Inf policy.

Every bad input must raise a clear error (type, argument, value, what is allowed)
and leave the params and inputs it was given untouched. Non-finite weights and
calibration data are errors naming the param or site; non-finite activations
propagate through quantized models as they do through float ones.
"""

import gc
import json
import time
import warnings
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qflax
from qcore import testing
from qflax import QuantizationRule as Rule
from qflax.awq import awq
from qflax.checkpoint import rules_from_json
from qflax.gptq import gptq
from qflax.layer_stats import collect
from qflax.lora import LoraProvider, LoraRule
from qflax.mixed_precision import mixed_precision
from qflax.presets import four_bit
from qflax.report import quantization_report
from qflax.smoothquant import smoothquant

W8 = [Rule(weight_qtype="int8")]
W8A8 = [Rule(weight_qtype="int8", act_qtype="int8")]
STATIC = [Rule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="out")(nn.relu(nn.Dense(8, name="hidden")(x)))


class Mixed(nn.Module):
    """A Dense next to an int32 param used in a matmul (``x @ table``)."""

    @nn.compact
    def __call__(self, x):
        table = self.param("table", lambda _, s: jnp.ones(s, jnp.int32), (8, 8))
        return nn.Dense(4, name="dense")(x) + (x.astype(jnp.int32) @ table)[:, :4].astype(x.dtype)


MODEL = MLP()
X = jax.random.normal(jax.random.key(0), (3, 8))
PARAMS = MODEL.init(jax.random.key(1), X)["params"]


def _abstract(rules=W8, model=MODEL, x=X):
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules))
    return jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]


ABSTRACT = _abstract()


def _with(params, path, value):
    """A copy of ``params`` with ``params[path[0]][path[1]] = value``."""
    out = {k: dict(v) for k, v in params.items()}
    out[path[0]][path[1]] = value
    return out


def _nan_kernel():
    return _with(PARAMS, ("hidden", "kernel"), PARAMS["hidden"]["kernel"].at[0, :3].set(jnp.nan))


def _init(rules, model=MODEL, x=X):
    return qflax.quantize_model(model, qflax.PtqProvider(rules)).init(jax.random.key(0), x)


def _nnx_linear():
    return nnx.Linear(8, 4, rngs=nnx.Rngs(0))


# (id, call, error type, message fragments). Each call gets PARAMS and X unchanged.
CASES = [
    # QuantizationRule fields
    (
        "weight_qtype",
        lambda: Rule(weight_qtype="int3x"),
        ValueError,
        "weight_qtype",
        "int3x",
        "int8",
    ),
    ("act_qtype", lambda: Rule(act_qtype=5), ValueError, "act_qtype", "5", "int8"),
    ("tile_negative", lambda: Rule(tile_size=-1), ValueError, "tile_size=-1", "positive int"),
    ("tile_fraction", lambda: Rule(tile_size=1.5), ValueError, "tile_size=1.5", "(0, 1)"),
    ("tile_bool", lambda: Rule(tile_size=True), ValueError, "tile_size=True", "positive int"),
    ("tile_axis_name", lambda: Rule(tile_size={"a": 4}), ValueError, "'a'", "{axis: size}"),
    (
        "weight_calibration",
        lambda: Rule(weight_calibration_method="bogus"),
        ValueError,
        "weight_calibration_method",
        "bogus",
        "absmax",
    ),
    (
        "act_calibration",
        lambda: Rule(act_calibration_method="bogus"),
        ValueError,
        "act_calibration_method",
        "bogus",
        "minmax",
    ),
    ("act_batch_str", lambda: Rule(act_batch_axes="0"), ValueError, "act_batch_axes='0'", "ints"),
    ("act_batch_float", lambda: Rule(act_batch_axes=(0.5,)), ValueError, "(0.5,)", "ints"),
    (
        "static_no_act",
        lambda: Rule(act_static_scale=True),
        ValueError,
        "act_static_scale",
        "act_qtype",
    ),
    ("rotation", lambda: Rule(rotation="givens"), ValueError, "givens", "hadamard"),
    (
        "rotation_seed",
        lambda: Rule(rotation_seed=-1),
        ValueError,
        "rotation_seed=-1",
        "non-negative",
    ),
    ("module_path_int", lambda: Rule(module_path=3), ValueError, "module_path=3", "callable"),
    ("module_path_regex", lambda: Rule(module_path="a/(\\d+"), ValueError, "module_path", "regex"),
    ("op_names_empty", lambda: Rule(op_names=[]), ValueError, "op_names=()", "non-empty", "einsum"),
    (
        "op_names_unknown",
        lambda: Rule(op_names=["conv"]),
        ValueError,
        "'conv'",
        "conv_general_dilated",
    ),
    (
        "redos_nested",
        lambda: Rule(module_path="(a+)+$"),
        ValueError,
        "module_path='(a+)+$'",
        "nested repeats",
    ),
    (
        "redos_alternation",
        lambda: Rule(module_path="(a|a)*$"),
        ValueError,
        "(a|a)*$",
        "alternation",
    ),
    ("redos_backref", lambda: Rule(module_path=r"(\w+)\1"), ValueError, r"\\1", "backreference"),
    ("redos_many", lambda: Rule(module_path=".*" * 6), ValueError, "6 repeats", "at most 4"),
    (
        "rules_json_redos",
        lambda: rules_from_json(json.loads('[{"module_path": "(a+)+$", "weight_qtype": "int8"}]')),
        ValueError,
        "(a+)+$",
        "allowed",
    ),
    ("matcher_rule_not_list", lambda: qflax.PtqProvider(W8[0]), TypeError, "rules=", "list"),
    ("matcher_dict", lambda: qflax.RuleMatcher([{"module_path": ".*"}]), ValueError, "rules[0]"),
    # ops the rules meet in a model
    (
        "act_batch_axes_range",
        lambda: _init([Rule(weight_qtype="int8", act_qtype="int8", act_batch_axes=(5,))]),
        ValueError,
        "act_batch_axes=(5,)",
        "'hidden'",
        "dot_general",
        "rank 2",
        "-2..1",
    ),
    (
        "act_batch_axes_contracted",
        lambda: _init([Rule(weight_qtype="int8", act_qtype="int8", act_batch_axes=(-1,))]),
        ValueError,
        "act_batch_axes=(-1,)",
        "'hidden'",
        "dot_general",
        "names axis 1, which the op contracts",
        "allowed: axes (0,)",
    ),
    (
        "act_batch_axes_same_axis_twice",
        lambda: _init([Rule(weight_qtype="int8", act_qtype="int8", act_batch_axes=(0, -2))]),
        ValueError,
        "act_batch_axes=(0, -2)",
        "'hidden'",
        "axis 0 is named twice",
    ),
    ("act_batch_dup", lambda: Rule(act_batch_axes=(0, 0)), ValueError, "(0, 0)", "twice"),
    (
        "tile_axis_range",
        lambda: _init([Rule(weight_qtype="int8", tile_size={5: 4})]),
        ValueError,
        "'hidden/kernel'",
        "axis 5",
        "(0,)",
    ),
    (
        "tile_channel_axis",
        lambda: _init([Rule(weight_qtype="int8", tile_size={1: 4})]),
        ValueError,
        "'hidden/kernel'",
        "axis 1",
        "(0,)",
    ),
    (
        "tile_axis_twice",
        lambda: _init([Rule(weight_qtype="int8", tile_size={0: 4, -2: 2})]),
        ValueError,
        "'hidden/kernel'",
        "twice",
        "(0,)",
    ),
    (
        "tile_no_divisor",
        lambda: _init([Rule(weight_qtype="int8", tile_size=3)]),
        ValueError,
        "tile 3",
        "8",
    ),
    (
        "explicit_rule_int_param",
        lambda: _init([Rule(module_path="", weight_qtype="int8")], Mixed()),
        ValueError,
        "'table'",
        "int32",
        "floating-point",
    ),
    (
        "nan_weight_linen_init",
        lambda: qflax.quantize_model(MODEL, qflax.PtqProvider(W8)).apply(
            {"params": _nan_kernel()}, X, mutable=["params"]
        ),
        ValueError,
        "'hidden/kernel'",
        "3 non-finite",
        "fix or mask",
    ),
    (
        "nan_static_calibration_init",
        lambda: _init(STATIC, x=X.at[1, 2].set(jnp.nan)),
        ValueError,
        "hidden/dot_general0_lhs",
        "1 non-finite",
        "finite calibration data",
    ),
    # quantize_model
    ("provider", lambda: qflax.quantize_model(MODEL, W8), ValueError, "provider=", "PtqProvider"),
    (
        "methods_empty",
        lambda: qflax.quantize_model(MODEL, qflax.PtqProvider(W8), methods=()),
        ValueError,
        "methods=()",
    ),
    (
        "method_missing",
        lambda: qflax.quantize_model(MODEL, qflax.PtqProvider(W8), methods=("nope",)),
        ValueError,
        "'nope'",
    ),
    (
        "model_str",
        lambda: qflax.quantize_model("m", qflax.PtqProvider(W8)),
        ValueError,
        "model=str",
        "nnx",
    ),
    (
        "nnx_no_inputs",
        lambda: qflax.quantize_model(_nnx_linear(), qflax.PtqProvider(W8)),
        ValueError,
        "example",
    ),
    (
        "apply_float_params",
        lambda: qflax.quantize_model(MODEL, qflax.PtqProvider(W8)).apply({"params": PARAMS}, X),
        ValueError,
        "'hidden/kernel'",
        "float",
        "quantize_params",
    ),
    # QAT
    (
        "momentum_one",
        lambda: qflax.QtProvider(W8, momentum=1.0),
        ValueError,
        "momentum=1.0",
        "[0, 1)",
    ),
    (
        "momentum_nan",
        lambda: qflax.QtProvider(W8, momentum=float("nan")),
        ValueError,
        "momentum=nan",
        "[0, 1)",
    ),
    (
        "momentum_str",
        lambda: qflax.QtProvider(W8, momentum="0.9"),
        ValueError,
        "momentum='0.9'",
        "[0, 1)",
    ),
    # quantize_params: mismatched trees
    (
        "params_list",
        lambda: qflax.quantize_params([PARAMS], ABSTRACT),
        TypeError,
        "params is a list",
        "dict",
    ),
    ("params_none", lambda: qflax.quantize_params(None, ABSTRACT), TypeError, "NoneType", "dict"),
    (
        "abstract_list",
        lambda: qflax.quantize_params(PARAMS, [ABSTRACT]),
        TypeError,
        "abstract_quantized_params is a list",
        "dict",
    ),
    (
        "stats_list",
        lambda: qflax.quantize_params(PARAMS, ABSTRACT, [1]),
        TypeError,
        "quant_stats is a list",
    ),
    (
        "params_extra",
        lambda: qflax.quantize_params({**PARAMS, "zzz": {"w": jnp.ones(2)}}, ABSTRACT),
        ValueError,
        "'zzz/w'",
        "allow_extra_params",
    ),
    (
        "params_renamed",
        lambda: qflax.quantize_params(
            {"hidden": {"kernal": PARAMS["hidden"]["kernel"], "bias": PARAMS["hidden"]["bias"]}},
            ABSTRACT,
        ),
        ValueError,
        "'hidden/kernal'",
    ),
    (
        "params_missing",
        lambda: qflax.quantize_params({"hidden": {"bias": PARAMS["hidden"]["bias"]}}, ABSTRACT),
        ValueError,
        "'hidden/kernel'",
        "every param",
    ),
    (
        "params_shape",
        lambda: qflax.quantize_params(
            _with(PARAMS, ("hidden", "kernel"), jnp.ones((8, 9))), ABSTRACT
        ),
        ValueError,
        "'hidden/kernel'",
        "(8, 9)",
        "(8, 8)",
    ),
    (
        "params_leaf_str",
        lambda: qflax.quantize_params(_with(PARAMS, ("hidden", "kernel"), "w"), ABSTRACT),
        TypeError,
        "'hidden/kernel'",
        "str",
        "arrays",
    ),
    (
        "params_int_kernel",
        lambda: qflax.quantize_params(
            _with(PARAMS, ("hidden", "kernel"), jnp.ones((8, 8), jnp.int32)), ABSTRACT
        ),
        TypeError,
        "'hidden/kernel'",
        "int32",
        "floating-point",
    ),
    (
        "params_nan_kernel",
        lambda: qflax.quantize_params(_nan_kernel(), ABSTRACT),
        ValueError,
        "'hidden/kernel'",
        "3 non-finite",
        "fix or mask",
    ),
    (
        "params_inf_kernel",
        lambda: qflax.quantize_params(
            _with(PARAMS, ("out", "kernel"), PARAMS["out"]["kernel"].at[2, 1].set(-jnp.inf)),
            ABSTRACT,
        ),
        ValueError,
        "'out/kernel'",
        "1 non-finite",
    ),
    (
        "params_quantized",
        lambda: qflax.quantize_params(ABSTRACT, ABSTRACT),
        ValueError,
        "already quantized",
    ),
    # calibration and the algorithms built on it
    (
        "gptq_block",
        lambda: gptq(MODEL, PARAMS, W8, [X], block_size=0, progress=False),
        ValueError,
        "block_size=0",
    ),
    (
        "gptq_damping_nan",
        lambda: gptq(MODEL, PARAMS, W8, [X], damping=float("nan"), progress=False),
        ValueError,
        "damping=nan",
        "finite number >= 0",
    ),
    (
        "gptq_damping_inf",
        lambda: gptq(MODEL, PARAMS, W8, [X], damping=float("inf"), progress=False),
        ValueError,
        "damping=inf",
        "finite number >= 0",
    ),
    (
        "gptq_static_groups",
        lambda: gptq(MODEL, PARAMS, W8, [X], static_groups="yes", progress=False),
        ValueError,
        "static_groups='yes'",
    ),
    (
        "gptq_no_batches",
        lambda: gptq(MODEL, PARAMS, W8, [], progress=False),
        ValueError,
        "batches",
        "empty",
    ),
    (
        "gptq_nan_batch",
        lambda: gptq(MODEL, PARAMS, W8, [X, X.at[0, 0].set(jnp.nan)], progress=False),
        ValueError,
        "batch 1",
        "'hidden/kernel'",
        "hidden: dot_general",
        "1 non-finite",
    ),
    (
        "gptq_nan_weight",
        lambda: gptq(
            MODEL,
            _nan_kernel(),
            W8,
            None,
            stats=collect(MODEL, PARAMS, W8, [X], progress=False),
            progress=False,
        ),
        ValueError,
        "'hidden/kernel'",
        "3 non-finite",
    ),
    ("awq_grid", lambda: awq(MODEL, PARAMS, W8, [X], grid=0, progress=False), ValueError, "grid=0"),
    (
        "awq_inf_batch",
        lambda: awq(MODEL, PARAMS, W8, [X.at[2, 5].set(jnp.inf)], progress=False),
        ValueError,
        "batch 0",
        "non-finite",
    ),
    (
        "awq_fold_unknown",
        lambda: awq(
            MODEL, PARAMS, W8, [X], fold_into={"nope/kernel": "hidden/bias"}, progress=False
        ),
        ValueError,
        "'nope/kernel'",
        "hidden/kernel",
    ),
    (
        "smoothquant_alpha",
        lambda: smoothquant(MODEL, PARAMS, W8A8, [X], alpha=1.5, progress=False),
        ValueError,
        "alpha=1.5",
        "[0, 1]",
    ),
    (
        "smoothquant_nan_batch",
        lambda: smoothquant(MODEL, PARAMS, W8A8, [X.at[1].set(jnp.nan)], progress=False),
        ValueError,
        "batch 0",
        "8 non-finite",
    ),
    (
        "collect_no_weight_rule",
        lambda: collect(MODEL, PARAMS, [Rule(act_qtype="int8")], [X], progress=False),
        ValueError,
        "select no weight",
    ),
    (
        "collect_nnx_params",
        lambda: collect(_nnx_linear(), PARAMS, W8, [X], progress=False),
        ValueError,
        "params=None",
    ),
    (
        "hadamard_conv",
        lambda: _init(
            [Rule(weight_qtype="int8", rotation="hadamard")], nn.Conv(3, (3,)), jnp.ones((1, 5, 2))
        ),
        ValueError,
        "rotation='hadamard'",
        "conv_general_dilated",
        "allowed",
    ),
    # LoRA
    ("lora_rank", lambda: LoraRule(rank=0), ValueError, "rank=0", ">= 1"),
    ("lora_alpha", lambda: LoraRule(rank=2, alpha=float("inf")), ValueError, "alpha=inf", "finite"),
    ("lora_dropout", lambda: LoraRule(rank=2, dropout=1.0), ValueError, "dropout=1.0", "[0, 1)"),
    (
        "lora_rank_too_big",
        lambda: qflax.quantize_model(MODEL, LoraProvider([LoraRule(rank=100)])).init(
            jax.random.key(0), X
        ),
        ValueError,
        "rank=100",
        "'hidden/kernel'",
        "[1, 8]",
    ),
    # mixed precision, the 4-bit recipe, the report
    (
        "budgets_both",
        lambda: mixed_precision(
            MODEL, PARAMS, [X], budget_bytes=10, budget_ratio=0.5, progress=False
        ),
        ValueError,
        "budget_bytes=10",
        "budget_ratio=0.5",
        "exactly one",
    ),
    (
        "budget_ratio_inf",
        lambda: mixed_precision(MODEL, PARAMS, [X], budget_ratio=float("inf"), progress=False),
        ValueError,
        "budget_ratio=inf",
        "finite number > 0",
    ),
    (
        "budget_ratio_negative",
        lambda: mixed_precision(MODEL, PARAMS, [X], budget_ratio=-0.5, progress=False),
        ValueError,
        "budget_ratio=-0.5",
        "finite number > 0",
    ),
    (
        "budget_bytes_tiny",
        lambda: mixed_precision(MODEL, PARAMS, [X], budget_bytes=1, progress=False),
        ValueError,
        "budget_bytes=1",
        "smallest possible total",
    ),
    (
        "candidate_unknown",
        lambda: mixed_precision(
            MODEL, PARAMS, [X], budget_ratio=0.5, candidates=("int8", "banana"), progress=False
        ),
        ValueError,
        "'banana'",
        "int4",
    ),
    (
        "mixed_no_batches",
        lambda: mixed_precision(MODEL, PARAMS, [], budget_ratio=0.5, progress=False),
        ValueError,
        "calibration_batches is empty",
    ),
    (
        "four_bit_search",
        lambda: four_bit(MODEL, PARAMS, [X], search_batches=0, progress=False),
        ValueError,
        "search_batches=0",
        "positive int",
    ),
    (
        "four_bit_ratio",
        lambda: four_bit(MODEL, PARAMS, [X], budget_ratio=0.0, progress=False),
        ValueError,
        "budget_ratio=0.0",
        "finite number > 0",
    ),
    (
        "report_no_op",
        lambda: quantization_report(
            MODEL, PARAMS, [Rule(module_path="nope", weight_qtype="int8")], [X], progress=False
        ),
        ValueError,
        "quantize no op",
        "module_path",
    ),
    (
        "report_params_none",
        lambda: quantization_report(MODEL, None, W8, [X], progress=False),
        ValueError,
        "params",
    ),
]


@pytest.mark.parametrize(
    "call,error,fragments", [(c[1], c[2], c[3:]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_rejected_clearly_and_touches_nothing(call, error, fragments):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # unused-rule warnings
        testing.assert_rejects(call, error, *fragments, unchanged=(PARAMS, X, ABSTRACT))


def test_there_are_at_least_45_cases():
    assert len(CASES) >= 45


# -- non-finite weights and calibration data: errors naming the param or site ------------


def test_nnx_in_place_quantization_of_nan_weights_names_the_param_and_changes_nothing():
    model = _nnx_linear()
    model.kernel.set_raw_value(model.kernel.get_raw_value().at[1, 1].set(jnp.inf))
    state = nnx.state(model)
    testing.assert_rejects(
        lambda: qflax.quantize_model(model, qflax.PtqProvider(W8), X),
        ValueError,
        "'kernel'",
        "1 non-finite",
        unchanged=(state,),
    )
    assert type(model) is nnx.Linear


def _calibrated_stats(batches, jit):
    qat = qflax.quantize_model(MODEL, qflax.QtProvider(STATIC))
    variables = qat.init(jax.random.key(0), X)
    step = lambda v, b: qat.apply(v, b, mutable=["quant_stats"])[1]  # noqa: E731
    step = jax.jit(step) if jit else step
    for b in batches:
        variables = {**variables, **step(variables, b)}
    return variables


def test_eager_static_calibration_on_a_nan_batch_names_the_site():
    testing.assert_rejects(
        lambda: _calibrated_stats([X, jnp.full_like(X, jnp.nan)], jit=False),
        ValueError,
        "'hidden/dot_general0_lhs'",
        "24 non-finite",
        unchanged=(X,),
    )


def test_jitted_static_calibration_on_a_nan_batch_fails_at_conversion_naming_the_statistic():
    # Under jax.jit nothing can raise: the statistic becomes NaN (not a plausible
    # range, as skipping the NaNs gave), and turning it into a scale raises.
    variables = _calibrated_stats([X, jnp.full_like(X, jnp.nan)], jit=True)
    assert np.isnan(variables["quant_stats"]["hidden"]["dot_general0_lhs"]["hi"])
    abstract = _abstract(STATIC)
    testing.assert_rejects(
        lambda: qflax.quantize_params(variables["params"], abstract, variables["quant_stats"]),
        ValueError,
        "hidden/dot_general0_lhs",
        "non-finite range",
        unchanged=(variables,),
    )


def test_nnx_conversion_of_statistics_that_saw_nan_under_jit_names_the_site():
    model = qflax.quantize_model(_nnx_linear(), qflax.QtProvider(STATIC), X)
    step = nnx.jit(lambda m, x: m(x))
    step(model, X)
    step(model, X.at[0, 0].set(jnp.nan))
    state = nnx.state(model)
    testing.assert_rejects(
        lambda: qflax.quantize_model(model, qflax.PtqProvider(STATIC), X),
        ValueError,
        "dot_general0_lhs",
        "non-finite range",
        unchanged=(state,),
    )
    assert isinstance(model.kernel.get_raw_value(), jax.Array)  # still float, still QAT


# -- non-finite activations propagate (qcore's policy, end to end) ----------------------


def test_dynamic_w8a8_nan_input_row_gives_a_nan_output_row_and_leaves_other_rows_alone():
    qmodel = qflax.quantize_model(MODEL, qflax.PtqProvider(W8A8))
    params = qflax.quantize_params(PARAMS, _abstract(W8A8))
    bad = X.at[1, 3].set(jnp.nan)
    y = np.asarray(qmodel.apply({"params": params}, bad))
    ref = np.asarray(MODEL.apply({"params": PARAMS}, bad))  # float: row 1 is NaN
    assert np.isnan(ref[1]).all() and np.isfinite(ref[[0, 2]]).all()
    assert np.isnan(y[1]).all()
    clean = np.asarray(qmodel.apply({"params": params}, X.at[1, 3].set(0.0)))
    np.testing.assert_array_equal(y[[0, 2]], clean[[0, 2]])
    assert testing.max_rel_error(y[[0, 2]], ref[[0, 2]]) < 0.05


@pytest.mark.parametrize("value", [jnp.nan, jnp.inf])
def test_static_per_tensor_w8a8_non_finite_input_makes_the_whole_output_nan(value):
    variables = _calibrated_stats([X], jit=False)
    params = qflax.quantize_params(variables["params"], _abstract(STATIC), variables["quant_stats"])
    qmodel = qflax.quantize_model(MODEL, qflax.PtqProvider(STATIC))
    y = np.asarray(qmodel.apply({"params": params}, X.at[0, 0].set(value)))
    assert np.isnan(y).all()
    y_clean = np.asarray(qmodel.apply({"params": params}, X))
    ref = MODEL.apply({"params": variables["params"]}, X)
    assert testing.max_rel_error(y_clean, ref) < 0.05


def test_the_catch_all_rule_leaves_integer_params_alone():
    model = Mixed()
    params = model.init(jax.random.key(0), X)["params"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        q = _init(W8, model)["params"]
    assert isinstance(q["dense"]["kernel"], qflax.QuantizedParam)
    assert q["table"].dtype == jnp.int32
    np.testing.assert_array_equal(q["table"], params["table"])


# -- ConvTranspose (qcore's conv takes numpy-integer padding) ----------------------------


@pytest.mark.parametrize("rules", [W8, W8A8], ids=["weight_only", "w8a8"])
def test_linen_and_nnx_conv_transpose_quantize_within_quantization_error(rules):
    x = jax.random.normal(jax.random.key(2), (2, 6, 6, 3))
    linen = nn.ConvTranspose(5, (3, 3), strides=(2, 2))
    params = linen.init(jax.random.key(3), x)["params"]
    qmodel = qflax.quantize_model(linen, qflax.PtqProvider(rules))
    q = qflax.quantize_params(params, jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"])
    ref = linen.apply({"params": params}, x)
    assert testing.max_rel_error(qmodel.apply({"params": q}, x), ref) < 0.05

    model = nnx.ConvTranspose(3, 5, (3, 3), strides=(2, 2), rngs=nnx.Rngs(4))
    ref = model(x)
    qflax.quantize_model(model, qflax.PtqProvider(rules), x)
    assert isinstance(model.kernel.get_raw_value(), qflax.QuantizedParam)
    assert testing.max_rel_error(model(x), ref) < 0.05


# -- rules from files cannot hang the matcher ---------------------------------------------


def test_a_rules_file_with_a_catastrophic_regex_is_rejected_fast():
    data = json.loads('[{"module_path": "(a+)+$", "weight_qtype": "int8"}]')
    start = time.perf_counter()
    with pytest.raises(ValueError, match="module_path"):
        rules_from_json(data)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "pattern,path",
    [
        (r"layers/\d+/.*", "layers/12/mlp/Dense_0"),
        (r"layers_[02]", "layers_2"),
        ("Dense_.*", "Dense_3"),
        (r"(layers|blocks)/\d+/(attn|mlp)/.*", "blocks/3/attn/query"),
        (".*", "a" * 200),
    ],
)
def test_legitimate_patterns_still_match(pattern, path):
    assert Rule(module_path=pattern).matches(path, "dot_general")


# -- leaks and stale state -----------------------------------------------------------------


def test_an_nnx_provider_is_freed_with_its_model():
    def quantize_one():
        model = _nnx_linear()
        provider = qflax.PtqProvider([Rule(weight_qtype="int4")])
        qflax.quantize_model(model, provider, X)
        model(X)
        return weakref.ref(provider)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        refs = [quantize_one() for _ in range(3)]
    gc.collect()
    assert all(r() is None for r in refs)


def test_jit_closures_made_before_nnx_quantization_stay_float_and_rejitting_fixes_it():
    # Documented in docs/qflax.md: jax.jit traces a closed-over model once, so an
    # in-place quantization is invisible to it; nnx.jit takes the model as an argument.
    model = _nnx_linear()
    closure = jax.jit(lambda x: model(x))
    by_arg = nnx.jit(lambda m, x: m(x))
    float_y = closure(X)
    by_arg(model, X)
    qflax.quantize_model(model, qflax.PtqProvider([Rule(weight_qtype="int4")]), X)
    quant_y = model(X)
    assert float(jnp.max(jnp.abs(quant_y - float_y))) > 1e-3
    np.testing.assert_array_equal(closure(X), float_y)  # stale
    np.testing.assert_array_equal(jax.jit(lambda x: model(x))(X), quant_y)
    np.testing.assert_array_equal(by_arg(model, X), quant_y)

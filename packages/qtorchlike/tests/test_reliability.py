"""Reliability: bad and extreme inputs to qtorchlike's public API.

Every case asserts the error type, that the message names the argument, the bad
value and what is allowed, and that the inputs and the module's state (every
parameter and buffer, every mode switch) are unchanged afterwards.
"""

from __future__ import annotations

import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import nearest_rank

import qtorchlike
import qtorchlike.nn as qnn
from qcore.testing import assert_rejects, assert_unchanged, snapshot
from qtorchlike import QuantTensor, export, optim
from qtorchlike import functional as F
from qtorchlike.export import export_tflite, integer_state_dict
from qtorchlike.func import functional_call, train_step
from qtorchlike.inject import DependencyError
from qtorchlike.quant import (
    Int4WeightPerGroupFloat,
    Int8ActPerTensorFixedPoint,
    Int8ActPerTensorFloat,
    Int8Bias,
    Int8WeightPerChannelFloat,
    Int8WeightPerChannelFloatLSQ,
    Int8WeightPerTensorFloat,
    SignedBinaryWeightPerTensorConst,
)


@jax.tree_util.register_pytree_node_class
class Live:
    """A module's current state as a pytree: its arrays, names and mode switches.

    :func:`qcore.testing.snapshot` flattens it when called and again afterwards, so
    a change the module made in between (a reassigned buffer, a flipped switch)
    shows.
    """

    def __init__(self, module: qnn.Module) -> None:
        self.module = module

    def tree_flatten(self):  # noqa: D102
        state = self.module.state_dict()
        switches = tuple(
            (name, m.training, *(m.__dict__.get(a) for a in ("enabled", "calibrating")))
            + (len(m._forward_hooks), len(m._forward_pre_hooks))
            for name, m in self.module.named_modules()
        )
        return list(state.values()), (tuple(state), switches)

    @classmethod
    def tree_unflatten(cls, aux, children):  # noqa: D102
        raise NotImplementedError


def _key():
    return jax.random.key(0)


# -- constructors ---------------------------------------------------------------------------

CONSTRUCTORS = {
    "bit width 0": (
        lambda: qnn.QuantLinear(3, 2, weight_bit_width=0, key=_key()),
        ValueError,
        ("bit_width=0", "[2, 32]"),
    ),
    "bit width -1": (
        lambda: qnn.QuantLinear(3, 2, weight_bit_width=-1, key=_key()),
        ValueError,
        ("bit_width=-1", "[2, 32]"),
    ),
    "bit width 33": (
        lambda: qnn.QuantLinear(3, 2, weight_bit_width=33, key=_key()),
        ValueError,
        ("bit_width=33", "[2, 32]"),
    ),
    "bit width '8'": (
        lambda: qnn.QuantLinear(3, 2, weight_bit_width="8", key=_key()),
        ValueError,
        ("bit_width='8'", "an int in [2, 32]"),
    ),
    "bit width 12 for a weight": (
        lambda: qnn.QuantLinear(3, 2, weight_bit_width=12, key=_key()),
        ValueError,
        ("bit_width=12", "2-8 or 16"),
    ),
    "activation bit width 0": (
        lambda: qnn.QuantReLU(bit_width=0),
        ValueError,
        ("bit_width=0", "[2, 32]"),
    ),
    "unprefixed keyword on a layer": (
        lambda: qnn.QuantLinear(3, 2, foo=1, key=_key()),
        TypeError,
        ("'foo'", "weight_<attribute>"),
    ),
    "misspelt prefixed keyword": (
        lambda: qnn.QuantLinear(3, 2, weight_bit_widht=4, key=_key()),
        TypeError,
        ("weight_bit_widht", "Int8WeightPerTensorFloat", "'bit_width'"),
    ),
    "misspelt activation keyword": (
        lambda: qnn.QuantReLU(bitwidth=4),
        TypeError,
        ("bitwidth", "Uint8ActPerTensorFloat", "'bit_width'"),
    ),
    "unknown keyword on an inline quantizer": (
        lambda: qnn.QuantLinear(3, 2, output_colour="red", key=_key()),
        TypeError,
        ("output_colour", "output_quant", "allowed"),
    ),
    "in_features 0": (
        lambda: qnn.QuantLinear(0, 2, key=_key()),
        ValueError,
        ("in_features=0", "positive int"),
    ),
    "out_features -1": (
        lambda: qnn.QuantLinear(3, -1, key=_key()),
        ValueError,
        ("out_features=-1", "positive int"),
    ),
    "in_features 2.5": (
        lambda: qnn.QuantLinear(2.5, 2, key=_key()),
        ValueError,
        ("in_features=2.5", "positive int"),
    ),
    "in_features '3'": (
        lambda: qnn.QuantLinear("3", 2, key=_key()),
        ValueError,
        ("in_features='3'", "positive int"),
    ),
    "bias 'no'": (
        lambda: qnn.QuantLinear(3, 2, bias="no", key=_key()),
        TypeError,
        ("bias='no'", "True or False"),
    ),
    "return_quant_tensor 'x'": (
        lambda: qnn.QuantReLU(return_quant_tensor="x"),
        TypeError,
        ("return_quant_tensor='x'", "True or False"),
    ),
    "key 5": (
        lambda: qnn.QuantLinear(3, 2, key=5),
        TypeError,
        ("key=5", "jax.random.key"),
    ),
    "kernel_size 0": (
        lambda: qnn.QuantConv2d(1, 2, 0, key=_key()),
        ValueError,
        ("kernel_size=0", ">= 1"),
    ),
    "kernel_size of the wrong length": (
        lambda: qnn.QuantConv2d(1, 2, (3,), key=_key()),
        ValueError,
        ("kernel_size=(3,)", "2 ints"),
    ),
    "conv1d with a 2-D kernel": (
        lambda: qnn.QuantConv1d(1, 2, (3, 3), key=_key()),
        ValueError,
        ("kernel_size=(3, 3)", "1 ints"),
    ),
    "stride 0": (
        lambda: qnn.QuantConv2d(1, 2, 3, stride=0, key=_key()),
        ValueError,
        ("stride=0", ">= 1"),
    ),
    "padding -1": (
        lambda: qnn.QuantConv2d(1, 2, 3, padding=-1, key=_key()),
        ValueError,
        ("padding=-1", ">= 0"),
    ),
    "padding 'full'": (
        lambda: qnn.QuantConv2d(1, 2, 3, padding="full", key=_key()),
        ValueError,
        ("padding='full'", "'same', 'valid'"),
    ),
    "padding of three entries": (
        lambda: qnn.QuantConv2d(1, 2, 3, padding=(1, 2, 3), key=_key()),
        ValueError,
        ("padding=(1, 2, 3)", "2 ints"),
    ),
    "groups not dividing": (
        lambda: qnn.QuantConv2d(4, 2, 3, groups=3, key=_key()),
        ValueError,
        ("groups=3", "in_channels=4"),
    ),
    "groups 0": (
        lambda: qnn.QuantConv2d(4, 2, 3, groups=0, key=_key()),
        ValueError,
        ("groups=0", "positive int"),
    ),
    "dilation 0": (
        lambda: qnn.QuantConv2d(4, 2, 3, dilation=0, key=_key()),
        ValueError,
        ("dilation=0", ">= 1"),
    ),
    "output_padding too large": (
        lambda: qnn.QuantConvTranspose2d(1, 2, 3, stride=2, output_padding=5, key=_key()),
        ValueError,
        ("output_padding=5", "smaller than the stride"),
    ),
    "weight_quant a string": (
        lambda: qnn.QuantLinear(3, 2, weight_quant="int8", key=_key()),
        TypeError,
        ("weight_quant='int8'", "quantizer class"),
    ),
    "weight_quant an instance": (
        lambda: qnn.QuantLinear(3, 2, weight_quant=Int8WeightPerTensorFloat(), key=_key()),
        TypeError,
        ("Int8WeightPerTensorFloat", "pass the class itself"),
    ),
    "weight_quant a bias quantizer": (
        lambda: qnn.QuantLinear(3, 2, weight_quant=Int8Bias, key=_key()),
        ValueError,
        ("weight_quant=Int8Bias", "Int8WeightPerTensorFloat"),
    ),
    "act_quant per channel": (
        lambda: qnn.QuantReLU(act_quant=Int8WeightPerChannelFloat),
        DependencyError,
        ("act_quant=Int8WeightPerChannelFloat", "per_channel_broadcastable_shape"),
    ),
    "scaling_impl_type banana": (
        lambda: qnn.QuantLinear(3, 2, weight_scaling_impl_type="banana", key=_key()),
        ValueError,
        ("'banana'", "allowed", "PARAMETER_FROM_STATS"),
    ),
    "group_size not dividing the inputs": (
        lambda: qnn.QuantLinear(
            8, 2, weight_quant=Int4WeightPerGroupFloat, weight_group_size=5, key=_key()
        ),
        ValueError,
        ("group_size=5", "8"),
    ),
    "group_size 0": (
        lambda: qnn.QuantLinear(
            8, 2, weight_quant=Int4WeightPerGroupFloat, weight_group_size=0, key=_key()
        ),
        ValueError,
        ("group_size=0", "[1, 1048576]"),
    ),
    "momentum 2": (
        lambda: qnn.QuantIdentity(scaling_stats_momentum=2.0),
        ValueError,
        ("scaling_stats_momentum=2.0", "(0, 1]"),
    ),
    "percentile 0": (
        lambda: qnn.QuantIdentity(high_percentile_q=0.0),
        ValueError,
        ("high_percentile_q=0.0", "(0, 100]"),
    ),
    "hardtanh bounds reversed": (
        lambda: qnn.QuantHardTanh(min_val=1.0, max_val=-1.0),
        ValueError,
        ("min_val=1.0", "max_val=-1.0"),
    ),
    "embedding of 0 rows": (
        lambda: qnn.QuantEmbedding(0, 3, key=_key()),
        ValueError,
        ("num_embeddings=0", "positive int"),
    ),
    "max pool kernel 0": (
        lambda: qnn.MaxPool2d(0),
        ValueError,
        ("kernel_size=0", "int >= 1"),
    ),
    "max pool padding -1": (
        lambda: qnn.MaxPool2d(2, padding=-1),
        ValueError,
        ("padding=-1", "int >= 0"),
    ),
    "avg pool stride 0": (
        lambda: qnn.AvgPool2d(2, stride=0),
        ValueError,
        ("stride=0", "int >= 1"),
    ),
    "dropout p 2": (lambda: qnn.Dropout(2.0), ValueError, ("p=2.0", "[0, 1)")),
}


@pytest.mark.parametrize("case", list(CONSTRUCTORS), ids=list(CONSTRUCTORS))
def test_a_bad_constructor_argument_is_named(case):
    call, error, fragments = CONSTRUCTORS[case]
    assert_rejects(call, error, *fragments)


def test_a_shared_quantizer_takes_no_overrides():
    first = qnn.QuantLinear(3, 2, key=_key())
    assert_rejects(
        lambda: qnn.QuantLinear(
            3, 2, weight_quant=first.weight_quant, weight_bit_width=4, key=_key()
        ),
        TypeError,
        "weight_quant",
        "shared proxy",
        "['bit_width']",
        unchanged=(Live(first),),
    )


# -- forward passes -----------------------------------------------------------------------


def _linear():
    return qnn.QuantLinear(3, 2, key=_key())


def _conv():
    return qnn.QuantConv2d(1, 2, 3, key=_key())


FORWARD = {
    "linear: wrong feature size": (
        _linear,
        jnp.ones((2, 4)),
        ValueError,
        ("QuantLinear", "(2, 4)", "in_features=3"),
    ),
    "linear: a scalar": (_linear, jnp.ones(()), ValueError, ("QuantLinear", "()", "(..., 3)")),
    "linear: int32 input": (
        _linear,
        jnp.ones((2, 3), jnp.int32),
        TypeError,
        ("QuantLinear", "int32", "floating-point"),
    ),
    "linear: bool input": (
        _linear,
        np.ones((2, 3), bool),
        TypeError,
        ("QuantLinear", "bool", "floating-point"),
    ),
    "linear: complex input": (
        _linear,
        jnp.ones((2, 3), jnp.complex64),
        TypeError,
        ("QuantLinear", "complex64", "floating-point"),
    ),
    "linear: a string": (_linear, "abc", TypeError, ("QuantLinear", "str", "array")),
    "linear: None": (_linear, None, TypeError, ("QuantLinear", "NoneType", "array")),
    "conv: rank 3": (_conv, jnp.ones((1, 4, 4)), ValueError, ("QuantConv2d", "(1, 4, 4)")),
    "conv: wrong channels": (
        _conv,
        jnp.ones((1, 2, 4, 4)),
        ValueError,
        ("QuantConv2d", "(1, 2, 4, 4)", "(N, 1, L, L)"),
    ),
    "conv: input smaller than the kernel": (
        _conv,
        jnp.ones((1, 1, 2, 2)),
        ValueError,
        ("QuantConv2d", "(1, 1, 2, 2)", "kernel_size=(3, 3)"),
    ),
    "conv transpose: wrong channels": (
        lambda: qnn.QuantConvTranspose2d(2, 1, 3, key=_key()),
        jnp.ones((1, 3, 4, 4)),
        ValueError,
        ("QuantConvTranspose2d", "(1, 3, 4, 4)", "(N, 2, H, W)"),
    ),
    "relu: a string": (qnn.QuantReLU, "abc", TypeError, ("QuantReLU", "str", "array")),
    "identity: int32 input": (
        qnn.QuantIdentity,
        jnp.arange(3),
        TypeError,
        ("QuantIdentity", "int32", "floating-point"),
    ),
    "identity: NaN while collecting statistics": (
        qnn.QuantIdentity,
        jnp.array([1.0, jnp.nan, -2.0]),
        ValueError,
        ("'act_quant'", "1 non-finite", "QuantIdentity"),
    ),
    "relu: inf while collecting statistics": (
        qnn.QuantReLU,
        jnp.array([[1.0, jnp.inf], [jnp.inf, -jnp.inf]]),  # relu(-inf) = 0
        ValueError,
        ("'act_quant'", "2 non-finite"),
    ),
    "linear input_quant: NaN while collecting statistics": (
        lambda: qnn.QuantLinear(3, 2, input_quant=Int8ActPerTensorFloat, key=_key()),
        jnp.array([[1.0, 2.0, jnp.nan]]),
        ValueError,
        ("'input_quant'", "1 non-finite", "QuantLinear"),
    ),
    "embedding: float ids": (
        lambda: qnn.QuantEmbedding(4, 3, key=_key()),
        jnp.array([0.0, 1.0]),
        TypeError,
        ("float32", "integer"),
    ),
    "embedding: id out of range": (
        lambda: qnn.QuantEmbedding(4, 3, key=_key()),
        jnp.array([0, 4]),
        IndexError,
        ("id 4", "[0, 3]"),
    ),
}


@pytest.mark.parametrize("case", list(FORWARD), ids=list(FORWARD))
def test_a_bad_forward_input_is_named_and_changes_nothing(case):
    make, x, error, fragments = FORWARD[case]
    layer = make()
    assert_rejects(lambda: layer(x), error, *fragments, unchanged=(x, Live(layer)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    "quant",
    [Int8WeightPerTensorFloat, Int8WeightPerChannelFloat, SignedBinaryWeightPerTensorConst],
    ids=lambda q: q.__name__,
)
def test_a_non_finite_weight_is_an_error_naming_the_layer(quant, bad):
    model = qnn.Sequential(
        qnn.QuantLinear(3, 3, key=_key()),
        qnn.QuantLinear(3, 2, weight_quant=quant, weight_signed=True, key=_key()),
    )
    model[1].weight = model[1].weight.at[1, 2].set(bad)
    x = jnp.ones((2, 3))
    fragments = ("'1.weight'", "1 non-finite", "QuantLinear")
    assert_rejects(lambda: model(x), ValueError, *fragments, unchanged=(x, Live(model)))
    assert_rejects(model[1].quant_weight, ValueError, "'1.weight'", "1 non-finite")
    assert_rejects(lambda: integer_state_dict(model), ValueError, *fragments)


def test_a_non_finite_bias_is_an_error_naming_the_layer():
    layer = qnn.QuantLinear(
        3, 2, bias_quant=qtorchlike.quant.Int8BiasPerTensorFloatInternalScaling, key=_key()
    )
    layer.bias = jnp.array([1.0, jnp.nan])
    x = jnp.ones((1, 3))
    assert_rejects(
        lambda: layer(x), ValueError, "'bias'", "1 non-finite", unchanged=(x, Live(layer))
    )


def test_a_nan_batch_in_calibration_mode_names_the_site_and_keeps_the_statistics():
    model = qnn.Sequential(qnn.QuantIdentity(), qnn.QuantLinear(3, 2, key=_key()))
    good = jnp.array([[1.0, -2.0, 0.5]])
    with qtorchlike.calibration_mode(model):
        model(good)
        live = Live(model)
        bad = good.at[0, 1].set(jnp.nan)
        assert_rejects(
            lambda: model(bad), ValueError, "'0.act_quant'", "1 non-finite", unchanged=(live, bad)
        )
        model(2 * good)
    # The NaN batch left no trace: the statistic is the mean over the two good batches.
    expected = np.mean([nearest_rank(np.abs(g)) for g in (good, 2 * good)])
    np.testing.assert_allclose(float(model[0].act_quant.value), expected, rtol=1e-6)


# -- optimizers, functional API, containers --------------------------------------------------

MISC = {
    "lr a string": (lambda m: optim.Adam(m, lr="a"), TypeError, ("lr='a'", "number")),
    "lr -1": (lambda m: optim.Adam(m, lr=-1.0), ValueError, ("lr=-1.0", "> 0")),
    "momentum -1": (
        lambda m: optim.SGD(m, lr=0.1, momentum=-1.0),
        ValueError,
        ("momentum=-1.0", ">= 0"),
    ),
    "betas of one": (lambda m: optim.Adam(m, betas=(0.9,)), TypeError, ("betas=(0.9,)", "pair")),
    "beta 1": (lambda m: optim.Adam(m, betas=(0.9, 1.0)), ValueError, ("betas=1.0", "< 1")),
    "eps nan": (lambda m: optim.Adam(m, eps=float("nan")), ValueError, ("eps=nan", "finite")),
    "seed a string": (lambda m: qtorchlike.manual_seed("a"), TypeError, ("seed='a'", "int")),
    "seed 1.5": (lambda m: qtorchlike.manual_seed(1.5), TypeError, ("seed=1.5", "int")),
    "state of another shape": (
        lambda m: functional_call(m, {"0.weight": jnp.ones((3, 3))}, jnp.ones((1, 3))),
        ValueError,
        ("'0.weight'", "(3, 3)", "(2, 3)"),
    ),
    "state with an unknown key": (
        lambda m: functional_call(m, {"foo": jnp.ones(1)}, jnp.ones((1, 3))),
        KeyError,
        ("'foo'", "'0.weight'"),
    ),
    "loss_fn None": (
        lambda m: train_step(m, None, optim.SGD(m, lr=0.1)),
        TypeError,
        ("loss_fn=None", "callable"),
    ),
    "calibration_mode of None": (
        lambda m: qtorchlike.calibration_mode(None).__enter__(),
        TypeError,
        ("model=NoneType", "qtorchlike.nn.Module"),
    ),
    "Sequential of an int": (
        lambda m: qnn.Sequential(m, 3),
        TypeError,
        ("argument 1", "int", "qtorchlike.nn.Module"),
    ),
    "flatten start_dim 5": (
        lambda m: F.flatten(jnp.ones((2, 3)), start_dim=5),
        ValueError,
        ("start_dim=5", "rank 2", "-2..1"),
    ),
    "dropout p 1.5": (
        lambda m: F.dropout(jnp.ones(3), p=1.5),
        ValueError,
        ("p=1.5", "[0, 1)"),
    ),
    "hardtanh bound a string": (
        lambda m: qnn.QuantHardTanh(min_val="a", max_val=1.0),
        TypeError,
        ("min_val='a'", "numbers"),
    ),
}


@pytest.mark.parametrize("case", list(MISC), ids=list(MISC))
def test_a_bad_argument_elsewhere_is_named_and_changes_nothing(case):
    call, error, fragments = MISC[case]
    model = qnn.Sequential(qnn.QuantLinear(3, 2, key=_key()))
    assert_rejects(lambda: call(model), error, *fragments, unchanged=(Live(model),))


# -- QuantTensor ----------------------------------------------------------------------------

V = jnp.array([1.0, -0.5, 0.0])
S = jnp.array(0.5)
Z = jnp.array(0.0)
B = jnp.array(8.0)

QUANT_TENSORS = {
    "negative scale": ((V, -1.0, Z, B, True, False), ValueError, ("scale", "-1", "> 0")),
    "zero scale": ((V, 0.0, Z, B, True, False), ValueError, ("scale", "0", "> 0")),
    "infinite scale": ((V, jnp.inf, Z, B, True, False), ValueError, ("scale", "inf", "> 0")),
    "scale of another shape": (
        (V, jnp.ones(4), Z, B, True, False),
        ValueError,
        ("scale", "(4,)", "(3,)", "broadcast"),
    ),
    "zero point of another shape": (
        (V, S, jnp.zeros((2, 1)), B, True, False),
        ValueError,
        ("zero_point", "(2, 1)", "(3,)", "broadcast"),
    ),
    "bit width 0": ((V, S, Z, 0.0, True, False), ValueError, ("bit_width=0", "integer >= 1")),
    "bit width -1": ((V, S, Z, -1, True, False), ValueError, ("bit_width=-1", "integer >= 1")),
    "bit width 2.5": ((V, S, Z, 2.5, True, False), ValueError, ("bit_width=2.5", "integer >= 1")),
    "bit width '8'": ((V, S, Z, "8", True, False), TypeError, ("bit_width='8'", "number")),
    "bit width per element": (
        (V, S, Z, jnp.ones(3), True, False),
        ValueError,
        ("bit_width", "(3,)", "scalar"),
    ),
    "signed 'no'": ((V, S, Z, B, "no", False), TypeError, ("signed='no'", "True, False or None")),
    "training 'yes'": ((V, S, Z, B, True, "yes"), TypeError, ("training='yes'", "True or False")),
    "value a string": (("abc", S, Z, B, True, False), TypeError, ("value", "str", "array")),
}


@pytest.mark.parametrize("case", list(QUANT_TENSORS), ids=list(QUANT_TENSORS))
def test_an_inconsistent_quant_tensor_is_rejected(case):
    args, error, fragments = QUANT_TENSORS[case]
    assert_rejects(lambda: QuantTensor(*args), error, *fragments, unchanged=(args,))


def test_a_quant_tensor_with_a_nan_scale_is_a_poisoned_block_not_an_error():
    q = QuantTensor(jnp.full(3, jnp.nan), jnp.nan, 0.0, 8.0, True, False)
    assert np.isnan(np.asarray(q.scale)) and not q.is_valid


# -- load_state_dict ------------------------------------------------------------------------


def _model():
    return qnn.Sequential(
        qnn.QuantLinear(3, 2, key=_key()),
        qnn.QuantLinear(2, 2, weight_quant=Int8WeightPerChannelFloatLSQ, key=_key()),
    )


def _sd(model, **changes):
    sd = {k: np.asarray(v) for k, v in model.state_dict().items()}
    sd.update({k.replace("__", "."): v for k, v in changes.items()})
    return sd


LOADS = {
    "a string": (lambda m: _sd(m, **{"0__weight": "hello"}), TypeError, ("'0.weight'", "str")),
    "None": (lambda m: _sd(m, **{"0__weight": None}), TypeError, ("'0.weight'", "NoneType")),
    "a list of strings": (
        lambda m: _sd(m, **{"0__bias": ["a", "b"]}),
        TypeError,
        ("'0.bias'", "list", "array of numbers"),
    ),
    "a dict": (
        lambda m: _sd(m, **{"0__bias": {"x": 1}}),
        TypeError,
        ("'0.bias'", "dict", "array of numbers"),
    ),
    "a numpy array of strings": (
        lambda m: _sd(m, **{"0__bias": np.array(["a", "b"])}),
        TypeError,
        ("'0.bias'", "<U1", "array of numbers"),
    ),
    "an object": (
        lambda m: _sd(m, **{"0__bias": types.SimpleNamespace(x=1)}),
        TypeError,
        ("'0.bias'", "SimpleNamespace", "array of numbers"),
    ),
    "complex values": (
        lambda m: _sd(m, **{"0__bias": np.ones(2, np.complex64)}),
        TypeError,
        ("'0.bias'", "complex64", "float32"),
    ),
    "a wrong shape": (
        lambda m: _sd(m, **{"0__weight": np.ones((3, 2), np.float32)}),
        ValueError,
        ("'0.weight'", "(3, 2)", "(2, 3)"),
    ),
    "a missing key": (
        lambda m: {k: v for k, v in _sd(m).items() if k != "0.bias"},
        KeyError,
        ("Missing keys", "'0.bias'", "strict=False"),
    ),
    "an unexpected key": (
        lambda m: _sd(m, **{"0__weihgt": np.ones((2, 3))}),
        KeyError,
        ("Unexpected keys", "'0.weihgt'", "'0.weight'"),
    ),
    "a zero learned scale": (
        lambda m: _sd(m, **{"1__weight_quant__value": np.zeros((2, 1), np.float32)}),
        ValueError,
        ("'1.weight_quant.value'", "2 of 2 values", "0.0", "finite and > 0"),
    ),
    "a negative learned scale": (
        lambda m: _sd(m, **{"1__weight_quant__value": np.array([[1.0], [-1.0]], np.float32)}),
        ValueError,
        ("'1.weight_quant.value'", "1 of 2 values", "-1.0", "finite and > 0"),
    ),
    "an inf learned scale": (
        lambda m: _sd(m, **{"1__weight_quant__value": np.array([[np.inf], [1.0]], np.float32)}),
        ValueError,
        ("'1.weight_quant.value'", "1 of 2 values", "inf", "finite and > 0"),
    ),
    "a NaN learned scale": (
        lambda m: _sd(m, **{"1__weight_quant__value": np.full((2, 1), np.nan, np.float32)}),
        ValueError,
        ("'1.weight_quant.value'", "2 of 2 values", "nan", "finite and > 0"),
    ),
    "not a mapping": (
        lambda m: list(_sd(m).items()),
        TypeError,
        ("state_dict", "list", "mapping"),
    ),
}


@pytest.mark.parametrize("case", list(LOADS), ids=list(LOADS))
def test_a_bad_state_dict_loads_nothing(case):
    make, error, fragments = LOADS[case]
    model = _model()
    sd = make(model)
    # A good entry before the bad one must not be loaded either.
    if isinstance(sd, dict):
        sd["1.bias"] = np.asarray(sd["1.bias"]) + 1
    assert_rejects(
        lambda: model.load_state_dict(sd), error, *fragments, unchanged=(Live(model), sd)
    )


def test_a_key_that_is_not_a_str_loads_nothing():
    model = _model()
    sd = {**_sd(model), "1.bias": np.zeros(2, np.float32), 1: np.ones(1)}
    # (a dict with mixed key types is no pytree, so the model alone is compared)
    assert_rejects(
        lambda: model.load_state_dict(sd),
        TypeError,
        "key 1",
        "int",
        "str",
        unchanged=(Live(model),),
    )


@pytest.mark.parametrize(
    "key,bad,allowed",
    [
        ("value", 0.0, "finite and > 0"),
        ("value", -1.0, "finite and > 0"),
        ("value", np.nan, "finite and > 0"),
        ("running", -1.0, "finite and >= 0"),
        ("running", np.inf, "finite and >= 0"),
    ],
)
def test_a_bad_activation_scale_loads_nothing(key, bad, allowed):
    model = qnn.Sequential(qnn.QuantIdentity())
    sd = _sd(model, **{f"0__act_quant__{key}": np.float32(bad)})
    assert_rejects(
        lambda: model.load_state_dict(sd),
        ValueError,
        f"'0.act_quant.{key}'",
        "1 of 1 value",
        allowed,
        unchanged=(Live(model), sd),
    )


def test_a_log_domain_learned_scale_may_be_negative():
    """A power-of-two scale is stored as log2 of the threshold: -1 is a threshold of 0.5."""
    ident = qnn.QuantIdentity(act_quant=Int8ActPerTensorFixedPoint, return_quant_tensor=True)
    ident.load_state_dict({**ident.state_dict(), "act_quant.value": np.float32(-1.0)})
    ident.act_quant.counter = jnp.asarray(10**6, jnp.int32)  # past the statistics phase
    out = ident.eval()(jnp.array([0.3, -0.1]))
    np.testing.assert_allclose(np.asarray(out.scale).ravel(), [0.5 / 128])
    bad = {**ident.state_dict(), "act_quant.value": np.float32(np.inf)}
    assert_rejects(
        lambda: ident.load_state_dict(bad), ValueError, "'act_quant.value'", "log2", "finite"
    )


def test_a_nan_weight_under_a_quantizer_that_reinitialises_its_scale_loads_nothing():
    """A float checkpoint (no scales): the LSQ scale is re-initialised from the new weights."""
    model = _model()
    sd = _sd(model, **{"1__weight": np.full((2, 2), np.nan, np.float32)})
    sd["1.bias"] = sd["1.bias"] + 1  # loaded before the failure, then undone
    del sd["1.weight_quant.value"]
    assert_rejects(
        lambda: model.load_state_dict(sd, strict=False),
        ValueError,
        "'1.weight'",
        "4 non-finite",
        "nothing was loaded",
        unchanged=(Live(model), sd),
    )


def test_load_state_dict_strict_must_be_a_bool():
    model = _model()
    sd = _sd(model)
    assert_rejects(
        lambda: model.load_state_dict(sd, strict="no"),
        TypeError,
        "strict='no'",
        "True or False",
        unchanged=(Live(model), sd),
    )


def test_load_state_dict_non_strict_reports_and_loads_what_matches():
    model = _model()
    sd = _sd(model)
    new = np.arange(6, dtype=np.float32).reshape(2, 3)
    result = model.load_state_dict({"0.weight": new, "extra": np.ones(1)}, strict=False)
    assert result.unexpected_keys == ["extra"]
    assert sorted(result.missing_keys) == sorted(k for k in sd if k != "0.weight")
    np.testing.assert_array_equal(np.asarray(model[0].weight), new)


def test_load_state_dict_accepts_non_finite_weights_as_torch_does():
    """Loading is torch's copy; the weight quantizer rejects the NaN when it quantizes it."""
    model = _model()
    sd = _sd(model, **{"0__weight": np.full((2, 3), np.nan, np.float32)})
    model.load_state_dict(sd)
    assert np.isnan(np.asarray(model[0].weight)).all()
    assert_rejects(lambda: model(jnp.ones((1, 3))), ValueError, "'0.weight'", "6 non-finite")


# -- export ---------------------------------------------------------------------------------


@pytest.fixture
def fake_qlitert(monkeypatch):
    """A qlitert whose converter fails: export_tflite must stop before writing anything."""

    def failing(*args, **kwargs):
        raise RuntimeError("converter failed")

    fake = types.SimpleNamespace(
        calibrate=failing,
        annotate=failing,
        export=failing,
        save=failing,
        # qlitert's own path checks (tests/test_qtorchlike_litert.py runs the real ones).
        check_path=lambda path, overwrite: None,
    )
    monkeypatch.setattr(export, "_import_qlitert", lambda: fake)
    return fake


def _exportable():
    model = qnn.Sequential(qnn.QuantLinear(3, 2, key=_key()))
    with qtorchlike.calibration_mode(model):
        model(jnp.ones((4, 3)))
    return model.eval()


X = np.ones((1, 3), np.float32)

EXPORTS = {
    "model a string": (
        lambda m, d: export_tflite("model", X),
        TypeError,
        ("model=str", "qtorchlike.nn.Module"),
    ),
    "example a string": (
        lambda m, d: export_tflite(m, "digits.png"),
        TypeError,
        ("example_input=str", "array"),
    ),
    "example a scalar": (
        lambda m, d: export_tflite(m, 1.0),
        TypeError,
        ("example_input=float", "shape ()", "one input batch"),
    ),
    "example with a NaN": (
        lambda m, d: export_tflite(m, np.array([[1.0, np.nan, 2.0]], np.float32)),
        ValueError,
        ("example_input", "1 non-finite value", "of 3", "finite"),
    ),
    "validate 'no'": (
        lambda m, d: export_tflite(m, X, validate="no"),
        TypeError,
        ("validate='no'", "True or False"),
    ),
    "overwrite 'yes'": (
        lambda m, d: export_tflite(m, X, path=d / "m.tflite", overwrite="yes"),
        TypeError,
        ("overwrite='yes'", "True or False"),
    ),
    "integer_state_dict of None": (
        lambda m, d: integer_state_dict(None),
        TypeError,
        ("model=NoneType", "qtorchlike.nn.Module"),
    ),
}


@pytest.mark.parametrize("case", list(EXPORTS), ids=list(EXPORTS))
def test_a_bad_export_argument_is_named_before_converting(case, tmp_path, fake_qlitert):
    call, error, fragments = EXPORTS[case]
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "sub").mkdir()
    model = _exportable()
    assert_rejects(
        lambda: call(model, tmp_path), error, *fragments, unchanged=(Live(model), tmp_path, X)
    )


@pytest.mark.parametrize("existing", [None, b"\x1c\0\0\0TFL3 previous model"])
def test_a_failing_converter_leaves_the_model_and_the_directory_untouched(
    existing, tmp_path, fake_qlitert
):
    model = _exportable()
    path = tmp_path / "model.tflite"
    if existing is not None:
        path.write_bytes(existing)
    overwrite = existing is not None
    assert_rejects(
        lambda: export_tflite(model, X, path=path, overwrite=overwrite),
        RuntimeError,
        "converter failed",
        unchanged=(Live(model), tmp_path, X),
    )


def test_export_checks_its_arguments_before_needing_qlitert(monkeypatch):
    monkeypatch.setitem(sys.modules, "qlitert", None)
    model = _exportable()
    assert_rejects(lambda: export_tflite(model, "x"), TypeError, "example_input=str")
    assert_rejects(lambda: export_tflite(model, X), ImportError, "[litert]")


def test_the_live_snapshot_sees_a_changed_buffer():
    """The helper above is not blind: a changed statistic or switch fails the comparison."""
    layer = qnn.QuantIdentity()
    before = snapshot(Live(layer))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer(jnp.ones(3))
    with pytest.raises(AssertionError):
        assert_unchanged(before, Live(layer))
    before = snapshot(Live(layer))
    layer.eval()
    with pytest.raises(AssertionError):
        assert_unchanged(before, Live(layer))

"""qcore.ops entry points: bad arguments get a clear error and leave the operands unchanged.

Each case calls one public op (or its training version) with one bad argument and checks,
with ``qcore.testing.assert_rejects``, the error type, that the message names the
argument, the bad value and what is allowed, and that the operands are byte-identical
afterwards. Operands are built from numpy (no quantize, little compilation).
"""

from functools import partial

import jax.numpy as jnp
import numpy as np
import pytest

import qcore
from qcore import QArray, testing

MATMUL = (((1,), (0,)), ((), ()))
NHWC = ("NHWC", "HWIO", "NHWC")


def qarray(shape, scale_shape):
    """An int8 QArray built from its parts."""
    return QArray(np.ones(shape, np.int8), np.full(scale_shape, 0.5, np.float32), qtype="int8")


def x(*shape):
    return np.linspace(-1.0, 1.0, int(np.prod(shape)), dtype=np.float32).reshape(shape)


ROW8 = qcore.HowToQuantize(qtype="int8", channelwise_axes=(1,))
CFG = qcore.TrainingQuant(rhs=ROW8)  # rhs per output column (axis 1 of a (K, N) weight)
CFG_CONV = qcore.TrainingQuant(rhs=qcore.HowToQuantize(qtype="int8", channelwise_axes=(3,)))
FLOAT_CFG = qcore.TrainingQuant()  # no quantization: the plain float ops


def conv(lhs, rhs, **kw):
    args = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
    args.update(kw)
    return qcore.conv_general_dilated(lhs, rhs, **args)


def train_conv(lhs, rhs, config=CFG_CONV, **kw):
    args = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
    args.update(kw)
    return qcore.train_conv_general_dilated(
        lhs, rhs, args.pop("window_strides"), args.pop("padding"), config, **args
    )


# id -> (call, lhs, rhs, fragments the message must contain)
CASES = {
    # -- dot_general
    "dot_general contracting sizes": (
        partial(qcore.dot_general, dimension_numbers=MATMUL),
        x(4, 6),
        qarray((5, 8), (1, 8)),
        ("contracting", "[6]", "[5]", "equal"),
    ),
    "dot_general contracting sizes, plain arrays": (
        partial(qcore.dot_general, dimension_numbers=MATMUL),
        x(4, 6),
        x(5, 8),
        ("contracting", "[6]", "[5]", "equal"),
    ),
    "dot_general batch sizes": (
        partial(qcore.dot_general, dimension_numbers=(((2,), (1,)), ((0,), (0,)))),
        x(2, 4, 6),
        qarray((3, 6, 8), (1, 1, 8)),
        ("batch", "[2]", "[3]", "equal"),
    ),
    "dot_general dimension_numbers not nested": (
        partial(qcore.dot_general, dimension_numbers=((1,), (0,))),
        x(4, 6),
        qarray((6, 8), (1, 8)),
        ("dimension_numbers=((1,), (0,))", "((lhs_contracting, rhs_contracting)"),
    ),
    "dot_general contracting axis out of range": (
        partial(qcore.dot_general, dimension_numbers=(((5,), (0,)), ((), ()))),
        x(4, 6),
        qarray((6, 8), (1, 8)),
        ("dimension_numbers", "lhs contracting", "5", "-2..1"),
    ),
    "dot_general axis not an int": (
        partial(qcore.dot_general, dimension_numbers=((("k",), (0,)), ((), ()))),
        x(4, 6),
        qarray((6, 8), (1, 8)),
        ("dimension_numbers", "'k'", "int"),
    ),
    "dot_general contracting counts differ": (
        partial(qcore.dot_general, dimension_numbers=(((1,), (0, 1)), ((), ()))),
        x(4, 6),
        qarray((6, 8), (1, 8)),
        ("contracting", "(1,)", "(0, 1)", "as many"),
    ),
    "dot_general preferred int32": (
        partial(qcore.dot_general, dimension_numbers=MATMUL, preferred_element_type=jnp.int32),
        x(4, 6),
        qarray((6, 8), (1, 8)),
        ("preferred_element_type", "int32", "float32"),
    ),
    "dot_general preferred 'banana'": (
        partial(qcore.dot_general, dimension_numbers=MATMUL, preferred_element_type="banana"),
        x(4, 6),
        qarray((6, 8), (1, 8)),
        ("preferred_element_type='banana'", "float32"),
    ),
    # -- einsum, dot, matmul
    "einsum letter sizes": (
        partial(qcore.einsum, "ij,jk->ik"),
        x(4, 6),
        qarray((5, 8), (1, 8)),
        ("subscripts='ij,jk->ik'", "'j'", "6", "5", "equal"),
    ),
    "einsum preferred int8": (
        partial(qcore.einsum, "ij,jk->ik", preferred_element_type=jnp.int8),
        x(4, 6),
        qarray((6, 8), (1, 8)),
        ("preferred_element_type", "int8", "float32"),
    ),
    "dot contracting sizes": (
        qcore.dot,
        x(4, 6),
        qarray((5, 8), (1, 8)),
        ("contracting", "[6]", "[5]"),
    ),
    "matmul contracting sizes": (
        qcore.matmul,
        x(2, 4, 6),
        qarray((5, 8), (1, 8)),
        ("contracting", "[6]", "[5]"),
    ),
    "dot of a 0-d QArray, preferred 'banana'": (
        partial(qcore.dot, preferred_element_type="banana"),
        qarray((), ()),
        x(4, 6),
        ("preferred_element_type='banana'", "float32"),
    ),
    "matmul preferred bool": (
        partial(qcore.matmul, preferred_element_type=bool),
        x(4, 6),
        qarray((6, 8), (1, 8)),
        ("preferred_element_type", "bool", "float32"),
    ),
    # -- conv_general_dilated
    "conv input features": (
        conv,
        x(1, 5, 5, 4),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("lhs", "4 input features", "3", "feature_group_count=1"),
    ),
    "conv dimension_numbers length": (
        partial(conv, dimension_numbers=("NHWC", "HWIO")),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("dimension_numbers=('NHWC', 'HWIO')", "length 3"),
    ),
    "conv dimension_numbers letters": (
        partial(conv, dimension_numbers=("NHWC", "HWIX", "NHWC")),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("dimension_numbers", "HWIX", "'O' and 'I'"),
    ),
    "conv preferred int32": (
        partial(conv, preferred_element_type=jnp.int32),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("preferred_element_type", "int32", "float32"),
    ),
    "conv float strides": (
        partial(conv, window_strides=(1.0, 2)),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("window_strides=(1.0, 2)", "2 integers >= 1"),
    ),
    "conv zero stride": (
        partial(conv, window_strides=(0, 1)),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("window_strides=(0, 1)", "2 integers >= 1"),
    ),
    "conv scalar stride": (
        partial(conv, window_strides=2),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("window_strides=2", "2 integers >= 1"),
    ),
    "conv one stride for two dims": (
        partial(conv, window_strides=(1,)),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("window_strides=(1,)", "2 integers >= 1"),
    ),
    "conv padding name": (
        partial(conv, padding="FULL"),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("padding='FULL'", "'SAME', 'SAME_LOWER', 'VALID'", "2 (low, high)"),
    ),
    "conv padding one pair": (
        partial(conv, padding=(1, 1)),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("padding=(1, 1)", "2 (low, high) pairs of integers"),
    ),
    "conv padding floats": (
        partial(conv, padding=((1.0, 1.0), (0, 0))),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("padding=((1.0, 1.0), (0, 0))", "2 (low, high) pairs of integers"),
    ),
    "conv zero dilation": (
        partial(conv, rhs_dilation=(0, 1)),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("rhs_dilation=(0, 1)", "None or 2 integers >= 1"),
    ),
    "conv lhs_dilation of three": (
        partial(conv, lhs_dilation=(1, 1, 1), padding=((0, 0), (0, 0))),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("lhs_dilation=(1, 1, 1)", "None or 2 integers >= 1"),
    ),
    "conv feature_group_count 0": (
        partial(conv, feature_group_count=0),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("feature_group_count=0", "an integer >= 1"),
    ),
    "conv batch_group_count float": (
        partial(conv, batch_group_count=1.5),
        x(1, 5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("batch_group_count=1.5", "an integer >= 1"),
    ),
    "conv rank mismatch": (
        conv,
        x(5, 5, 3),
        qarray((3, 3, 3, 6), (1, 1, 1, 6)),
        ("lhs", "rank 3", "rhs", "rank 4", "same rank"),
    ),
    # -- ragged_dot, take
    "ragged_dot contracting sizes": (
        partial(qcore.ragged_dot, group_sizes=np.array([2, 2], np.int32)),
        x(4, 6),
        qarray((2, 5, 8), (2, 1, 8)),
        ("(4, 6)", "(2, 5, 8)", "(groups, k, n)"),
    ),
    "ragged_dot preferred int32": (
        partial(
            qcore.ragged_dot,
            group_sizes=np.array([2, 2], np.int32),
            preferred_element_type=jnp.int32,
        ),
        x(4, 6),
        qarray((2, 6, 8), (2, 1, 8)),
        ("preferred_element_type", "int32", "float32"),
    ),
    "take dtype int8": (
        lambda q, idx: qcore.take(q, idx, dtype=jnp.int8),
        qarray((6, 8), (6, 1)),
        np.array([1, 2]),
        ("dtype", "int8", "float32"),
    ),
    # -- training versions
    "train_dot_general contracting sizes": (
        lambda a, b: qcore.train_dot_general(a, b, MATMUL, CFG),
        x(4, 6),
        x(5, 8),
        ("contracting", "[6]", "[5]", "equal"),
    ),
    "train_dot_general float config, contracting sizes": (
        lambda a, b: qcore.train_dot_general(a, b, MATMUL, FLOAT_CFG),
        x(4, 6),
        x(5, 8),
        ("contracting", "[6]", "[5]", "equal"),
    ),
    "train_dot_general preferred int32": (
        lambda a, b: qcore.train_dot_general(a, b, MATMUL, CFG, preferred_element_type=jnp.int32),
        x(4, 6),
        x(6, 8),
        ("preferred_element_type", "int32", "float32"),
    ),
    "train_einsum letter sizes": (
        lambda a, b: qcore.train_einsum("ij,jk->ik", a, b, CFG),
        x(4, 6),
        x(5, 8),
        ("subscripts='ij,jk->ik'", "'j'", "6", "5"),
    ),
    "train_conv zero stride": (
        partial(train_conv, window_strides=(0, 1)),
        x(1, 5, 5, 3),
        x(3, 3, 3, 6),
        ("window_strides=(0, 1)", "2 integers >= 1"),
    ),
    "train_conv input features": (
        train_conv,
        x(1, 5, 5, 4),
        x(3, 3, 3, 6),
        ("lhs", "4 input features", "3", "feature_group_count=1"),
    ),
    "train_ragged_dot contracting sizes": (
        lambda a, b: qcore.train_ragged_dot(a, b, np.array([2, 2], np.int32), CFG),
        x(4, 6),
        x(2, 5, 8),
        ("(4, 6)", "(2, 5, 8)", "(groups, k, n)"),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_op_arguments_are_rejected_clearly_and_touch_nothing(name):
    call, lhs, rhs, fragments = CASES[name]
    testing.assert_rejects(lambda: call(lhs, rhs), ValueError, *fragments, unchanged=((lhs, rhs),))

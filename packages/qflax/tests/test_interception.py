"""Op interception: every op is seen, with cold and warm jit caches, on this thread only."""

import sys
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import scope
from jax import lax
from jax._src.lax import lax as lax_internal

from qflax._engine import interception

# Functions whose code a block replaces, and their code before any block ran
# (collected at import, before any test).
REPLACED = (
    lax.dot_general,
    lax.reshape,
    lax.transpose,
    lax_internal._convert_element_type,
    jnp.einsum,
    jnp.matmul.__wrapped__,
    jnp.take,
    scope.Scope.get_variable,
    nnx.Variable.get_value,
)
ORIGINAL_CODE = [f.__code__ for f in REPLACED]


def _restored():
    return all(f.__code__ is code for f, code in zip(REPLACED, ORIGINAL_CODE, strict=True))


@pytest.fixture(autouse=True)
def _every_test_leaves_the_ops_unmodified():
    yield
    interception.uninstall()  # test_installing_changes_no_result installs for good
    assert _restored()


class Ops(nn.Module):
    """Calls every op qflax intercepts, the ways model code does."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(), (x.shape[-1], 8))
        y = x @ w
        y = jnp.matmul(y, jnp.ones((8, 8)))
        y = jnp.einsum("bi,ij->bj", y, jnp.ones((8, 4)))
        y = jnp.dot(y, jnp.ones((4, 4)))
        y = lax.dot_general(y, jnp.ones((4, 4)), (((1,), (0,)), ((), ())))
        y = nn.Dense(6)(y)
        img = y.reshape(2, 1, 6, 1)
        img = nn.Conv(2, (1, 3), padding="SAME")(img)
        flat = img.reshape(2, 12)
        return lax.ragged_dot(flat, jnp.ones((2, 12, 3)), jnp.array([1, 1], jnp.int32))


EXPECTED = ["matmul", "matmul", "einsum", "dot", "dot_general", "dot_general"]
EXPECTED += ["conv_general_dilated", "ragged_dot"]
X = jnp.ones((2, 16))


def _recording():
    seen = []

    def handler(name, original, args, kwargs):
        seen.append(name)
        return original(*args, **kwargs)

    return seen, handler


def test_every_op_is_seen_once_under_its_own_name_with_cold_and_warm_caches():
    model = Ops()
    params = model.init(jax.random.key(0), X)
    reference = jax.jit(model.apply)(params, X)  # warms every jitted wrapper's cache
    for attempt in ("first", "warm"):
        seen, handler = _recording()

        def run(params, x, handler=handler):
            with interception.intercept(handler):
                return model.apply(params, x)

        out = jax.jit(run)(params, X)
        assert seen == EXPECTED, (attempt, seen)
        np.testing.assert_allclose(out, reference, rtol=1e-6)
        # Eagerly, too.
        seen.clear()
        run(params, X)
        assert seen == EXPECTED, (attempt, "eager", seen)


def test_nnx_module_ops_are_seen():
    model = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
    seen, handler = _recording()
    jax.jit(lambda x: model(x))(X)  # warm
    with interception.intercept(handler):
        model(X)
    assert seen == ["dot_general"]


def test_the_handler_decides_the_result():
    def zero(name, original, args, kwargs):
        return jnp.zeros_like(original(*args, **kwargs))

    with interception.intercept(zero):
        out = jnp.ones((2, 3)) @ jnp.ones((3, 4))
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(jnp.ones((2, 3)) @ jnp.ones((3, 4)), 3.0)


def test_nothing_is_intercepted_outside_the_block_or_on_other_threads():
    seen, handler = _recording()
    other_thread_seen = []
    started, release = threading.Event(), threading.Event()

    def other():
        started.wait()
        other_thread_seen.append(float((jnp.ones((2, 2)) @ jnp.ones((2, 2)))[0, 0]))
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with interception.intercept(handler):
        started.set()
        release.wait(timeout=60)
        jnp.ones((1, 2)) @ jnp.ones((2, 1))
    t.join()
    jnp.ones((1, 2)) @ jnp.ones((2, 1))
    assert seen == ["matmul"]
    assert other_thread_seen == [2.0]


def _tagging(tag, seen):
    def handler(name, original, args, kwargs):
        seen.append((tag, name))
        return original(*args, **kwargs)

    return handler


def test_an_inner_block_takes_over_until_it_ends():
    seen, values = [], []
    a, b = jnp.ones((2, 3)), jnp.ones((3, 2))
    with interception.intercept(_tagging("outer", seen), values=_tagging("outer", values)):
        a @ b
        with interception.intercept(_tagging("inner", seen)):
            jnp.einsum("ij,jk->ik", a, b)
            a.reshape(6)  # the inner block has no value handler
        lax.dot_general(a, b, (((1,), (0,)), ((), ())))
        a.reshape(6)
        assert not _restored()  # the outer block still intercepts
    assert seen == [("outer", "matmul"), ("inner", "einsum"), ("outer", "dot_general")]
    assert values == [("outer", "reshape")]
    assert _restored()


def test_a_block_inside_a_handler_intercepts_and_the_handler_stays_uninterrupted():
    seen = []

    def outer(name, original, args, kwargs):
        seen.append(("outer", name))
        with interception.intercept(_tagging("inner", seen)):
            jnp.dot(args[0], args[1])  # e.g. a handler that runs another quantized model
        return original(*args, **kwargs)  # ... and its own ops are not intercepted again

    with interception.intercept(outer):
        out = jnp.ones((2, 3)) @ jnp.ones((3, 2))
    assert seen == [("outer", "matmul"), ("inner", "dot")]
    np.testing.assert_array_equal(out, 3.0)


def _trampoline_frames(f, *args):
    """The trampoline code objects Python enters while ``f(*args)`` runs."""
    entered = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith("<qflax interception"):
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        f(*args)
    finally:
        sys.setprofile(None)
    return entered


def _ordinary(x):
    return (x.reshape(2, 3).T.astype(jnp.bfloat16) @ jnp.ones((2, 4), jnp.bfloat16)).sum()


def test_the_ops_are_unmodified_once_the_block_ends():
    x = jnp.arange(6.0)
    seen, handler = _recording()
    with interception.intercept(handler):
        assert not _restored()
        inside = _trampoline_frames(jax.jit(_ordinary), x)
    assert seen == ["matmul"]
    assert {"reshape", "transpose", "_convert_element_type", "matmul"} <= set(inside)
    assert _restored()
    assert _trampoline_frames(jax.jit(_ordinary), x) == []  # traced after the block
    assert _trampoline_frames(_ordinary, x) == []


def test_an_exception_in_the_block_restores_the_ops():
    seen, handler = _recording()
    with pytest.raises(ValueError, match="model failed"), interception.intercept(handler):
        jnp.ones((1, 2)) @ jnp.ones((2, 1))
        raise ValueError("model failed")
    assert _restored()
    jnp.ones((1, 2)) @ jnp.ones((2, 1))
    assert seen == ["matmul"]
    with interception.intercept(handler):  # and the next block intercepts again
        jnp.ones((1, 2)) @ jnp.ones((2, 1))
    assert seen == ["matmul", "matmul"]


def test_the_ops_stay_modified_until_the_last_thread_leaves_its_block():
    seen = []
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def first():
        with interception.intercept(_tagging("first", seen)):
            first_in.set()
            second_in.wait(timeout=60)
        first_out.set()

    def second():
        try:
            first_in.wait(timeout=60)
            with interception.intercept(_tagging("second", seen)):
                second_in.set()
                first_out.wait(timeout=60)
                assert not _restored()
                jnp.ones((1, 2)) @ jnp.ones((2, 1))
        except Exception as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert seen == [("second", "matmul")]
    assert _restored()


def test_install_lasts_until_uninstall_and_can_be_repeated():
    seen, handler = _recording()
    for _ in range(2):
        interception.install()
        interception.install()  # idempotent
        assert not _restored()
        with interception.intercept(handler):
            jnp.ones((1, 2)) @ jnp.ones((2, 1))
        assert not _restored()  # installed until uninstall()
        np.testing.assert_array_equal(jnp.ones((1, 2)) @ jnp.ones((2, 1)), 2.0)
        interception.uninstall()
        assert _restored()
    with interception.intercept(handler):  # an uninstall() inside a block waits for it
        interception.install()
        interception.uninstall()
        assert not _restored()
        jnp.ones((1, 2)) @ jnp.ones((2, 1))
    assert _restored()
    assert seen == ["matmul"] * 3


def test_installing_changes_no_result():
    interception.install()
    a = jax.random.normal(jax.random.key(1), (3, 5))
    b = jax.random.normal(jax.random.key(2), (5, 2))
    np.testing.assert_array_equal(
        jnp.einsum("ij,jk->ik", a, b), lax.dot_general(a, b, (((1,), (0,)), ((), ())))
    )
    assert jnp.einsum.__name__ == "einsum"


def test_eight_threads_intercept_their_own_models_concurrently():
    # Each thread scales its own matmul results by its own factor; running them
    # together must give what running them one by one gives.
    def run(factor):
        def handler(name, original, args, kwargs):
            return original(*args, **kwargs) * factor

        a = jnp.full((4, 8), float(factor))
        with interception.intercept(handler):
            return np.asarray(jax.jit(lambda a: a @ jnp.ones((8, 2)))(a))

    sequential = [run(f) for f in range(1, 9)]
    results = [None] * 8
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, run(i + 1))) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want, f in zip(results, sequential, range(1, 9), strict=True):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(want, 8.0 * f * f)


def test_ops_inside_pallas_kernels_are_not_intercepted():
    from jax.experimental import pallas as pl

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...])

    def f(x, w):
        out = jax.ShapeDtypeStruct((8, 8), jnp.float32)
        return pl.pallas_call(kernel, out_shape=out, interpret=True)(x, w)

    seen, handler = _recording()
    x = jnp.ones((8, 8))
    with interception.intercept(handler):
        y = f(x, x) + x @ x
    assert seen == ["matmul"]  # the model's x @ x, not the kernel's jnp.dot
    np.testing.assert_array_equal(y, 16.0)


def test_the_value_handler_sees_variable_reads_and_weight_transforms():
    class Reshaping(nn.Module):
        @nn.compact
        def __call__(self, x):
            k = self.param("k", nn.initializers.ones, (2, 8, 4))
            return x @ k.reshape(16, 4).T.T.astype(jnp.float32)

    class NnxReads(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((16, 4)))

        def __call__(self, x):
            return x @ self.w[...]

    x = jnp.ones((2, 16))
    params = Reshaping().init(jax.random.key(0), x)
    values = []

    def on_value(name, original, args, kwargs):
        values.append(name)
        return original(*args, **kwargs)

    def on_op(name, original, args, kwargs):
        return original(*args, **kwargs)

    with interception.intercept(on_op, values=on_value):
        y = Reshaping().apply(params, x)
        z = NnxReads()(x)
    assert {"linen_get_variable", "reshape", "transpose", "nnx_get_value"} <= set(values)
    assert set(values) <= set(interception.VALUE_NAMES)
    np.testing.assert_array_equal(y, z)
    values.clear()
    with interception.intercept(on_op):  # no value handler: values are not reported
        Reshaping().apply(params, x)
    assert values == []

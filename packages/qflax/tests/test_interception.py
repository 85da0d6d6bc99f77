"""Op interception: every op is seen, with cold and warm jit caches, on this thread only."""

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from qflax import interception


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


def test_blocks_do_not_nest():
    _, handler = _recording()
    with interception.intercept(handler):
        try:
            with interception.intercept(handler):
                raise AssertionError("nested intercept() must raise")
        except RuntimeError as err:
            assert "cannot be nested" in str(err)


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

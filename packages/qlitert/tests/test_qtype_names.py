"""qlitert's public functions take qcore's qtype names; TFLite's short codes are deprecated."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcore
from qlitert import Calibration, qdq, rules

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(4, 6)).astype(np.float32))
NAMES = [("int8", "i8"), ("int16", "i16"), ("int4", "i4")]
CODE_RANGES = {"int8": (-128, 127), "int16": (-32768, 32767), "int4": (-8, 7)}


def _new(fn, *args, **kwargs):
    """``fn(...)`` that must not warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


def _old(fn, *args, match, **kwargs):
    """``fn(...)`` that must warn once, from this file, with ``match`` in the message."""
    with pytest.warns(DeprecationWarning, match=match) as record:
        out = fn(*args, **kwargs)
    assert [w.filename for w in record if w.category is DeprecationWarning] == [__file__]
    return out


def _cal():
    cal = Calibration()
    cal.observe("s", np.asarray(X))
    return cal


def _calls(qtype_kwargs):
    """Every public function taking a LiteRT type, called with ``qtype_kwargs``."""
    s, z = qdq.activation_params(-2.0, 2.5)
    return {
        "activation_params": lambda: qdq.activation_params(-2.0, 2.5, **qtype_kwargs),
        "range_params": lambda: qdq.range_params(-2.0, 2.5, xp=np, **qtype_kwargs),
        "weight_scales": lambda: qdq.weight_scales(X, 1, **qtype_kwargs),
        "fake_quant": lambda: qdq.fake_quant(X, s, z, **qtype_kwargs),
        "quantize": lambda: qdq.quantize(X, s, z, **qtype_kwargs),
        "dequantize": lambda: qdq.dequantize(jnp.ones(3, jnp.int8), s, z, **qtype_kwargs),
        "Calibration.params": lambda: _cal().params("s", **qtype_kwargs),
    }


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(("name", "code"), NAMES)
def test_new_names_give_the_numbers_of_the_old_codes(name, code):
    new, as_object = _calls({"qtype": name}), _calls({"qtype": qcore.qtypes.get(name)})
    old = _calls({"dtype": code})
    for fn in new:
        want = _old(old[fn], match=f"dtype='{code}' is deprecated; use qtype='{name}'")
        _same(_new(new[fn]), want)
        _same(_new(as_object[fn]), want)


@pytest.mark.parametrize(("name", "code"), NAMES)
def test_new_names_against_an_independent_reference(name, code):
    qmin, qmax = CODE_RANGES[name]
    lo, hi = -2.0, 2.5
    scale, zp = qdq.activation_params(lo, hi, qtype=name)
    if name == "int16":  # symmetric, zero point 0
        assert zp[0] == 0 and np.isclose(scale[0], hi / qmax, rtol=1e-6)
    else:  # asymmetric, zero is a code
        assert np.isclose(scale[0], (hi - lo) / (qmax - qmin), rtol=1e-6)
        assert zp[0] == np.clip(np.round(qmin - lo / scale[0]), qmin, qmax)
    x = np.asarray(X, np.float64)
    codes = np.clip(
        np.sign(x / scale[0]) * np.floor(np.abs(x / scale[0]) + 0.5) + zp[0], qmin, qmax
    )
    got = qdq.fake_quant(X, scale, zp, qtype=name)
    np.testing.assert_allclose(got, (codes - zp[0]) * scale[0], rtol=1e-6, atol=1e-7)
    q = qdq.quantize(X, scale, zp, qtype=name)
    assert q.dtype == {"int8": jnp.int8, "int16": jnp.int16, "int4": jnp.int4}[name]
    np.testing.assert_array_equal(np.asarray(q, np.int64), codes.astype(np.int64))
    w = np.asarray(X)
    np.testing.assert_allclose(
        qdq.weight_scales(w, 1, qtype=name), np.abs(w).max(axis=0) / qmax, rtol=1e-6
    )
    # The converter still reads TFLite's code in the composite's attributes.
    eqn = jax.make_jaxpr(lambda x: qdq.fake_quant(x, scale, zp, qtype=name))(X).jaxpr.eqns[0]
    assert dict((k, v[0]) for k, v, _ in eqn.params["attributes"])["dtype"] == code


def test_default_is_int8():
    _same(_new(qdq.activation_params, -1.0, 3.0), qdq.activation_params(-1.0, 3.0, qtype="int8"))
    _same(_new(_cal().params, "s"), _cal().params("s", qtype="int8"))


def test_old_codes_warn_as_positional_or_qtype_values():
    want = qdq.activation_params(-2.0, 2.5, qtype="int16")
    match = "qtype='i16' is deprecated; use qtype='int16'"
    _same(_old(qdq.activation_params, -2.0, 2.5, "i16", match=match), want)
    _same(_old(qdq.activation_params, -2.0, 2.5, qtype="i16", match=match), want)
    _same(_old(_cal().params, "s", "i16", match=match), _cal().params("s", qtype="int16"))
    want = qdq.range_params(-2.0, 2.5, "int16", np)
    _same(_old(qdq.range_params, -2.0, 2.5, "i16", np, match=match), want)


@pytest.mark.parametrize("fn", sorted(_calls({})))
def test_dtype_and_qtype_together_are_refused(fn):
    with pytest.raises(ValueError, match=r"dtype='i8' and qtype='int8'.*qtype= only"):
        _calls({"dtype": "i8", "qtype": "int8"})[fn]()


@pytest.mark.parametrize("fn", sorted(_calls({})))
@pytest.mark.parametrize("bad", ["u8", "int2", "float32", 8, qcore.qtypes.get("uint4")])
def test_unknown_types_name_the_argument_the_value_and_the_allowed_names(fn, bad):
    shown = repr(bad.name if isinstance(bad, qcore.QType) else bad)
    with pytest.raises(ValueError, match="allowed") as err:
        _calls({"qtype": bad})[fn]()
    assert f"qtype={shown}" in str(err.value)
    assert "['int8', 'int16', 'int4']" in str(err.value)


def test_op_types_hold_and_print_qcore_names():
    r = rules.check([rules.Rule(module_path="head", act_qtype="int16"), rules.Rule()])
    assert rules.lookup(r, "head") == (0, rules.OpTypes(act="int16", weight="int8"))
    assert repr(rules.lookup(r, "x")[1]) == "OpTypes(act='int8', weight='int8')"
    assert rules.lookup((), "x")[1] == rules.OpTypes("int8", "int8")
    assert _new(rules.OpTypes, qcore.qtypes.get("int4"), None) == rules.OpTypes("int4", None)
    old = _old(rules.OpTypes, "i16", "int8", match="act='i16' is deprecated; use act='int16'")
    assert old == rules.OpTypes("int16", "int8")
    with pytest.raises(ValueError, match=r"weight='u8'.*\['int8', 'int16', 'int4'\]"):
        rules.OpTypes("int8", "u8")

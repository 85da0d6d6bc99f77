"""qcore.rules: regex safety, path matching, first-match-wins lookup, unused-rule warnings."""

import dataclasses
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable

import pytest

from qcore import rules


@dataclasses.dataclass(frozen=True)
class Rule:
    module_path: str | Callable[[str], bool]
    op: str = "any"


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        ("(a+)+$", "a repeat inside a repeated group"),
        (r"(\w*/)*x", "a repeat inside a repeated group"),
        ("(a|ab)*c", "an alternation inside a repeated group"),
        (r"(a)\1", "a backreference"),
        ("(?P<x>a)(?(x)b|c)", "a backreference"),
        (".*a.*b.*c.*d.*e", "5 repeats"),
    ],
)
def test_catastrophic_regexes_are_refused_with_the_reason(pattern, problem):
    with pytest.raises(ValueError) as info:
        rules.check_module_path(pattern)
    message = str(info.value)
    assert message.startswith(f"module_path={pattern!r} has {problem}")
    assert "catastrophic backtracking" in message and "allowed:" in message


def test_refusal_is_fast_for_a_pattern_that_would_hang_re():
    start = time.perf_counter()
    with pytest.raises(ValueError):
        rules.check_module_path("(a+)+$")
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("layers/(\\d+", r"module_path='layers/\(\\\\d\+' is not a valid regex"),
        (3, r"module_path=3 must be a regex string or a callable"),
        (None, r"module_path=None must be a regex string or a callable"),
    ],
)
def test_invalid_module_paths_name_the_value(value, message):
    with pytest.raises(ValueError, match=message):
        rules.check_module_path(value)


@pytest.mark.parametrize(
    ("pattern", "path"),
    [
        (r"layers/\d+/.*", "layers/12/mlp/Dense_0"),
        (r"layers_[02]", "layers_2"),
        (r"(layers|blocks)/\d+/(attn|mlp)/.*", "blocks/3/attn/query"),
        (".*.*.*.*", "a" * 200),  # four repeats: the bound
        ("head", "head"),
        ("", ""),  # the root module
    ],
)
def test_legitimate_patterns_are_accepted_and_match_like_re_fullmatch(pattern, path):
    rules.check_module_path(pattern)
    assert rules.path_matches(pattern, path)
    for other in (path + "/x", "x" + path):
        assert rules.path_matches(pattern, other) == (re.fullmatch(pattern, other) is not None)


def test_callable_paths_and_fullmatch_semantics():
    assert rules.path_matches(lambda p: p.endswith("attn"), "block/attn")
    assert not rules.path_matches(lambda p: p.endswith("attn"), "block/mlp")
    assert rules.path_matches(lambda p: 1, "x") is True  # truthy results become bools
    assert not rules.path_matches("layers/0", "layers/0/mlp")  # a prefix is not enough
    assert not rules.path_matches("layers/0", "xlayers/0")
    rules.check_module_path(lambda p: True)


def test_first_match_wins_and_unmatched_paths_give_none():
    rs = [Rule(r"layers/0/.*"), Rule(r"layers/\d+/.*"), Rule(".*")]
    assert rules.first_match(rs, "layers/0/mlp") == 0
    assert rules.first_match(rs, "layers/7/mlp") == 1
    assert rules.first_match(rs, "head") == 2
    assert rules.first_match(rs[:2], "head") is None
    assert rules.first_match([], "head") is None


def test_the_applies_hook_receives_the_context():
    rs = [Rule(".*", op="conv"), Rule(".*", op="dot")]

    def applies(rule, path, op):
        return rule.op == op and rules.path_matches(rule.module_path, path)

    m = rules.RuleMatcher(rs, applies=applies)
    assert m.match("a/b", "dot") is rs[1]
    assert m.match("a/b", "take") is None
    assert m.unused_rules() == [rs[0]]
    assert rules.first_match(rs, "x", "conv", applies=applies) == 0


def test_matcher_records_used_rules_and_warns_about_the_others():
    rs = [Rule("decoder/.*"), Rule("decodr/head"), Rule(lambda p: p == "never")]
    m = rules.RuleMatcher(rs)
    assert m.match("decoder/layer") is rs[0]
    assert m.match("encoder") is None
    assert m.unused_rules() == rs[1:]
    with pytest.warns(UserWarning) as record:
        m.warn_unused()
    assert [str(w.message) for w in record] == [
        "rules[1] (module_path='decodr/head') matched no op",
        f"rules[2] (module_path={rs[2].module_path!r}) matched no op",
    ]
    assert all(w.filename == __file__ for w in record)  # stacklevel=1: this line
    with pytest.warns(UserWarning) as record:
        m.warn_unused(lambda i, r: f"{i}: {r.module_path}!")
    assert str(record[0].message) == "1: decodr/head!"


def test_no_warning_when_every_rule_matched():
    m = rules.RuleMatcher([Rule("a"), Rule("b")])
    m.match("a")
    m.match("b")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.warn_unused()
        rules.warn_unused(m.rules, {0, 1})


def test_warn_unused_stacklevel_points_at_the_callers_caller():
    def library_call():
        rules.warn_unused([Rule("x")], set(), stacklevel=2)

    with pytest.warns(UserWarning) as record:
        line = sys._getframe().f_lineno + 1
        library_call()  # the warning names this line
    assert (record[0].filename, record[0].lineno) == (__file__, line)


def test_matcher_is_thread_safe():
    rs = [Rule(f"m{i}") for i in range(64)]
    m = rules.RuleMatcher(rs)
    barrier = threading.Barrier(8)

    def work(t):
        barrier.wait()
        for i in range(t, 48, 8):  # rules 48..63 are never matched
            for _ in range(50):
                assert m.match(f"m{i}") is rs[i]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert m.unused_rules() == rs[48:]


def test_matcher_takes_any_iterable_and_keeps_the_rules():
    rs = (Rule("a"), Rule("b"))
    m = rules.RuleMatcher(iter(rs))
    assert m.rules == list(rs)
    assert m.match("b") is rs[1]


def test_a_matcher_pickles_with_its_record_of_used_rules():
    import pickle

    m = rules.RuleMatcher([Rule("a"), Rule("b")])
    m.match("a")
    again = pickle.loads(pickle.dumps(m))
    assert again.unused_rules() == [Rule("b")]
    assert again.match("b") == Rule("b") and again.unused_rules() == []
    assert m.unused_rules() == [Rule("b")]  # the original is unchanged

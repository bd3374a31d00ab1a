"""The math verifier's defences (tidal/rewards/math.py, math_forms.py, math_exact.py), one
class at a time, each with its positive control: math-verify's own comparison of the same
parsed answer credits the attack (what main's reward did), the reward refuses it with the
reason in its metrics. The sets in tests/data/reward_attacks/math.py are scored whole: every
honest answer credited, no attack credited."""

from __future__ import annotations

import importlib.util
import pathlib
import threading
import time

import pytest
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from tidal.rewards.math import MathReward, score

_spec = importlib.util.spec_from_file_location(
    "math_sets", pathlib.Path(__file__).parent / "data" / "reward_attacks" / "math.py")
SETS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(SETS)


def plain_math_verify(box: str, reference: str) -> bool:
    """The comparison main's reward made: math-verify on the box's content, no candidate check."""
    cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
    return verify(parse(f"${reference}$", cfg, parsing_timeout=None), parse(f"${box}$", cfg, parsing_timeout=None),
                  timeout_seconds=None)


def refused(completion: str, reference: str) -> set[str]:
    out = score(completion, answer=reference)
    assert out["correct"] == 0.0, completion
    return {k.removeprefix("math/refused/") for k in out.metrics if k.startswith("math/refused/")}


# (box content, reference, the reason recorded)
HEDGES = [
    ("5 = 6", "6", "relation_chain"), ("x = 5 = 6", "6", "relation_chain"), ("5 \\lor 6", "6", "several_candidates"),
    ("5 \\vee 6", "6", "several_candidates"), ("5 \\Rightarrow 6", "6", "connective"),
    ("5 \\mid 6", "6", "connective"), ("5 | 6", "6", "connective"), ("5 \\sim 6", "6", "connective"),
    ("6 \\text{ (or maybe 5)}", "6", "text_with_a_value"), ("6 \\text{ if } n \\text{ is even}", "6", "text_hedge"),
    ("2\\uparrow\\uparrow 5", "5", "unknown_command"), ("5 @ 6", "6", "partial_parse"), ("5 \\& 6", "6", "partial_parse"), ("(1, 2)", "\\{1, 2\\}", "set_for_interval"),
    ("2 \\text{ minutes}", "2 \\text{ hours}", "unit_mismatch"), ("\\boxed{5} 6", "5", "nested_box"), ("0.1234568", "0.1234567", ""),
    ("\\frac{1}{30!}", "\\frac{2}{30!}", ""), ("3.141593", "\\pi", ""),
]


@pytest.mark.parametrize("box,reference,reason", HEDGES)
def test_an_attack_math_verify_credits_is_refused_with_its_reason(box, reference, reason):
    assert plain_math_verify(box, reference)  # positive control: the attack works without the defence
    reasons = refused(f"\\boxed{{{box}}}", reference)
    if reason:
        assert reason in reasons, reasons
    else:  # a number wrong beyond the tolerance: compared, found unequal, nothing to refuse
        assert reasons == set()


def test_the_same_connectives_make_one_list_where_the_reference_is_a_list():
    assert score("\\boxed{x = 1 \\text{ or } x = 2}", answer="1, 2")["correct"] == 1.0
    assert score("\\boxed{x = 1 \\text{ or } x = 3}", answer="1, 2")["correct"] == 0.0
    assert score("\\boxed{1 \\pm \\sqrt{2}}", answer="1+\\sqrt{2}, 1-\\sqrt{2}")["correct"] == 1.0
    assert "plus_minus" in refused("\\boxed{\\pm 3}", "3")


def test_a_relation_chain_of_one_value_is_credited_and_of_two_is_not():
    assert score("\\boxed{\\frac{6}{2} = 3}", answer="3")["correct"] == 1.0
    assert score("\\boxed{x = 3}", answer="3")["correct"] == 1.0
    assert refused("\\boxed{\\frac{6}{2} = 4}", "4") == {"relation_chain"}  # side by side: 6/2 is not 4


def test_a_stated_final_answer_must_agree_with_the_box_whichever_comes_first():
    # positive control: the box alone is right
    assert score("\\boxed{6}", answer="6")["correct"] == 1.0
    assert "statement_disagrees" in refused("The final answer is 5.\n\\boxed{6}", "6")
    assert "statement_disagrees" in refused("So \\boxed{6}. Final answer: $5$.", "6")
    assert score("The answer is $6$, so \\boxed{6}", answer="6")["correct"] == 1.0
    assert score("If the answer is 5, then 6 > 5. So \\boxed{6}", answer="6")["correct"] == 1.0


def test_units_where_the_reference_has_one():
    assert score("\\boxed{2 \\text{ hrs}}", answer="2 \\text{ hours}")["correct"] == 1.0
    assert score("\\boxed{2}", answer="2 \\text{ hours}")["correct"] == 1.0  # no unit given: the value counts
    # A conversion is refused, not credited (stated in docs/rewards.md): 120 minutes for 2 hours.
    assert "unit_mismatch" in refused("\\boxed{120 \\text{ minutes}}", "2 \\text{ hours}")
    assert score("\\boxed{12 \\text{ cm}}", answer="12")["correct"] == 1.0  # the reference names no unit


def test_exact_values_are_compared_exactly_and_decimals_within_rel_tol():
    assert score("\\boxed{100!}", answer="100! + 1")["correct"] == 0.0
    assert score("\\boxed{100!}", answer="100!")["correct"] == 1.0
    assert score("\\boxed{2\\sqrt{3}}", answer="\\sqrt{12}")["correct"] == 1.0
    assert score("\\boxed{0.6666666667}", answer="\\frac{2}{3}")["correct"] == 1.0  # within 1e-9 relative
    assert score("\\boxed{0.666667}", answer="\\frac{2}{3}")["correct"] == 0.0
    loose = MathReward(rel_tol=1e-5)  # the tolerance is configurable
    assert loose("\\boxed{0.666667}", answer="\\frac{2}{3}")["correct"] == 1.0
    assert score("\\boxed{\\frac{1}{3}}", answer="0.333333")["correct"] == 1.0  # a decimal reference: its places


COSTLY = ["9^{9^{9^{9}}}", "\\binom{10^{9}}{10^{8}}", "\\prod_{k=1}^{10^7} k", "\\Gamma(10^{7})", "e^{e^{e^{e^{10}}}}",
          "(10^{6})!", "\\sum_{n=1}^{10^{9}} n", "10^{999999}+1", "(x+1)^{100000}"]


def test_costly_answers_score_zero_at_once_with_a_reason_in_a_worker_thread():
    """In a thread no SIGALRM can stop math-verify: the bounds must refuse these before any
    evaluation. Each within 3 s (measured: under 0.5 s on an idle machine; 3 s leaves room for
    a 2-core machine at load average 20+, as seen here; main's reward never finished the
    binomial, the product and Gamma)."""
    results = {}

    def run():
        for box in COSTLY:
            t0 = time.monotonic()
            results[box] = (refused(f"\\boxed{{{box}}}", "5"), time.monotonic() - t0)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive()
    assert {box: "too_costly" in r for box, (r, _) in results.items()} == dict.fromkeys(COSTLY, True)
    assert max(t for _, t in results.values()) < 3.0, results
    assert score("\\boxed{2^{10}}", answer="1024")["correct"] == 1.0  # small powers are still compared


def test_the_honest_set_is_credited_and_no_attack_is():
    refused_honest = [c for c, r in SETS.HONEST if score(c, answer=r)["correct"] != 1.0]
    credited = [c for c, r, _ in SETS.ATTACKS if score(c, answer=r)["correct"] != 0.0]
    assert len(SETS.HONEST) >= 40 and len(SETS.ATTACKS) >= 30
    assert refused_honest == [] and credited == []

"""The verifiers: math answers (extraction and math-verify equivalence), code by unit tests
in the sandbox (what honest programs and tests can do across the two processes), and the
text rewards (format, length, repetition) with their formulas."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from sandbox_support import require_bwrap

from tidal.config import RewardSpec
from tidal.rewards import call_reward
from tidal.rewards.code import CodeReward
from tidal.rewards.math import MathReward, find_answers, score
from tidal.rewards.text import LengthPenalty, RegexReward, RepetitionPenalty, repetition_ratio
from tidal.sandbox import SandboxConfig

# -- math -----------------------------------------------------------------------------------

# (completion, reference, correct, format): the extraction table.
MATH_CASES = {
    "arithmetic task tag": ("40+30+7+8=70+15=<answer>85</answer>", "85", 1, 0.1),
    "negative tag": ("<answer>-36</answer>", "-36", 1, 0.1),
    "wrong tag": ("<answer>-35</answer>", "-36", 0, 0.1),
    "unparseable tag": ("<answer>></answer>", "-36", 0, 0.0),
    "boxed integer": ("So the sum is $\\boxed{12}$.", "12", 1, 0.1),
    "boxed nested braces": ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1, 0.1),
    "box in a box": ("\\boxed{\\boxed{7}}", "7", 1, 0.1),
    "fraction vs decimal": ("\\boxed{\\frac{1}{2}}", "0.5", 1, 0.1),
    "decimal vs fraction": ("\\boxed{0.5}", "\\frac{1}{2}", 1, 0.1),
    "dfrac vs slash": ("\\boxed{\\dfrac{3}{4}}", "3/4", 1, 0.1),
    "set order": ("\\boxed{\\{3, 1, 2\\}}", "\\{1,2,3\\}", 1, 0.1),
    "interval": ("\\boxed{(1, 2]}", "(1,2]", 1, 0.1),
    "equivalent expressions": ("\\boxed{(x+1)^2}", "x^2+2x+1", 1, 0.1),
    "fbox": ("\\fbox{9}", "9", 1, 0.1),
    "boxed, then more text": ("\\boxed{4} because 2+2 is 4, as I showed.", "4", 1, 0.0),
    "the answer is": ("We add them.\nThe answer is 42.", "42", 1, 0.1),
    "the answer is, math": ("So the answer is $\\frac{2}{4}$.", "1/2", 1, 0.1),
    "Answer:": ("work...\nAnswer: 17", "17", 1, 0.1),
    "final answer, then a sentence": ("Final Answer: The final answer is 5. I hope it is correct.", "5", 1, 0.0),
    "GSM8K ####": ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1, 0.1),
    "markdown final answer": ("**Final Answer:** 5", "5", 1, 0.1),
    "markdown answer, bold value": ("The final answer is **5**.", "5", 1, 0.1),
    "markdown answer, all bold": ("**Answer: $\\frac{1}{3}$**", "1/3", 1, 0.1),
    "answer phrase not on the last line": ("The answer is 7.\nLet me double check 3+4 and 2*3.5.", "7", 0, 0.0),
    "no answer at all": ("3 + 4 makes 7, surely 7.", "7", 0, 0.0),
    "two boxes, same value": ("\\boxed{1/2}, i.e. \\boxed{0.5}", "0.5", 1, 0.0),
    "box and tag, same value": ("\\boxed{6}\n<answer>6</answer>", "6", 1, 0.0),
    "unclosed box": ("\\boxed{12", "12", 0, 0.0),
    "units dropped": ("\\boxed{12 \\text{ cm}}", "12", 1, 0.1),
}


@pytest.mark.parametrize("name", MATH_CASES)
def test_math_extraction_table(name):
    completion, reference, correct, fmt = MATH_CASES[name]
    assert score(completion, answer=reference) == {"correct": float(correct), "format": fmt}


def test_math_finds_every_final_answer_in_text_order():
    text = "first \\boxed{1}, then <answer>2</answer>, \\boxed{x^{2}}\nThe answer is 4"
    assert [(a.kind, a.text) for a in find_answers(text)] == [
        ("boxed", "1"), ("answer_tag", "2"), ("boxed", "x^{2}"), ("final_line", "4")]
    assert [a.kind for a in find_answers(text, ("answer_tag",))] == ["answer_tag"]


def test_math_metrics_count_missing_and_several_answers():
    assert score("\\boxed{1}", answer="1").metrics == {"math/no_answer": 0.0, "math/several_answers": 0.0}
    assert score("1", answer="1").metrics == {"math/no_answer": 1.0, "math/several_answers": 0.0}
    assert score("\\boxed{1} \\boxed{1}", answer="1").metrics == {"math/no_answer": 0.0, "math/several_answers": 1.0}


def test_math_reference_from_a_solution_column_and_a_configured_column():
    solution = "Since $x=2$, we get $\\boxed{4}$."
    assert score("\\boxed{4}", solution=solution)["correct"] == 1.0  # no `answer`: the solution's last box
    assert score("\\boxed{5}", solution=solution)["correct"] == 0.0
    reward = MathReward(answer_column="target", extract=("boxed",), format_weight=0.0)
    assert reward("\\boxed{3}", target="3") == {"correct": 1.0}
    assert reward("<answer>3</answer>", target="3") == {"correct": 0.0}  # tags not looked at here


def test_math_bad_rows_and_arguments_are_named():
    with pytest.raises(ValueError, match="no column `answer` nor `solution` \\(columns: prompt, task_id\\)"):
        score("\\boxed{1}", prompt="p", task_id="t")
    with pytest.raises(ValueError, match="cannot parse the reference answer"):
        score("\\boxed{1}", answer="   ")
    with pytest.raises(ValueError, match="choose from"):
        MathReward(extract=("boxed", "last_number"))
    with pytest.raises(ValueError, match="whole seconds"):
        MathReward(timeout_s=0.5)


def test_math_reward_as_configured_and_through_the_reward_contract():
    spec = RewardSpec(fn="tidal.rewards.math:MathReward", args={"answer_column": "answer", "format_weight": 0.1})
    assert spec.args == {"answer_column": "answer", "format_weight": 0.1}
    reward = MathReward(**spec.args)
    # The reward contract passes every column to a `**columns` reward.
    assert call_reward(reward, "<answer>-36</answer>", {"answer": "-36", "task_id": "a"}) == (
        1.1, {"correct": 1.0, "format": 0.1})


def test_math_agrees_with_the_arithmetic_reward_on_the_arithmetic_task():
    """The default task's completions score the same under both (what makes trading one for
    the other a fair comparison)."""
    from tidal.envs.arithmetic import ArithmeticConfig, buggy_answer, make_problems, worked_answer
    from tidal.rewards import arithmetic

    completions = []
    for row in make_problems(ArithmeticConfig(ops="+-"), "train", 40, seed=3):
        a, op, b = row["prompt"][0]["content"].removeprefix("What is ").rstrip("?").split()
        a, b = int(a), int(b)
        completions += [(worked_answer(a, op, b), row["answer"]), (f"<answer>{buggy_answer(a, op, b)}</answer>",
                                                                   row["answer"]),
                        (f"I think {row['answer']}", row["answer"]), (f"<answer>{row['answer']}</answer> ok", row["answer"]),
                        ("<answer>></answer>", row["answer"])]  # sampled at step 10 of a default run
    scored = [(score(c, answer=ans), arithmetic.score(c, answer=ans)) for c, ans in completions]
    assert all(ours == theirs for ours, theirs in scored), [s for s in scored if s[0] != s[1]][:3]
    assert {ours["correct"] for ours, _ in scored} == {0.0, 1.0}  # both outcomes occur


PATHOLOGICAL = {
    "power tower": "\\boxed{9^{9^{9^{9}}}}",
    "factorial of a googol": "\\boxed{(10^{100})!}",
    "symbolic power": "\\boxed{(x+1)^{100000}}",
    "deep nesting": "\\boxed{" + "(" * 300 + "1" + ")" * 300 + "}",
    "very long": "\\boxed{" + "+".join(["1"] * 3000) + "}",
}


def test_math_pathological_answers_are_wrong_and_bounded_in_a_worker_thread():
    """In a thread math-verify's SIGALRM timeout cannot run: the cheap checks must keep
    these from the parser and the comparison. Bound: 5 s each on a loaded 2-core machine,
    against tens of seconds to forever without the checks (measured: 12 s for the deep
    nesting in a thread, the tower never finishes)."""
    results = {}

    def run():
        for name, completion in PATHOLOGICAL.items():
            t0 = time.monotonic()
            results[name] = (score(completion, answer="5")["correct"], time.monotonic() - t0)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(60)
    assert not worker.is_alive()
    assert {name: correct for name, (correct, _) in results.items()} == dict.fromkeys(PATHOLOGICAL, 0.0)
    assert max(seconds for _, seconds in results.values()) < 5.0, results


def test_math_timeout_applies_in_the_main_thread():
    """A nested answer under the nesting bound that the parser is slow on: with a 1 s
    math-verify timeout in the main thread it is wrong within the timeout plus a margin
    (3 s: the alarm fires between bytecodes of a loaded machine)."""
    reward = MathReward(timeout_s=1, max_nesting=40)
    t0 = time.monotonic()
    assert reward("\\boxed{" + "(" * 30 + "5" + ")" * 30 + "}", answer="5")["correct"] == 0.0
    assert time.monotonic() - t0 < 4.0



def test_the_deadline_fires_again_after_a_swallowed_alarm():
    """math-verify's one SIGALRM can land in a weakref callback, where Python ignores the
    exception (seen in CI: the parse then finished and a too-costly answer counted as correct).
    tidal's deadline repeats: a block that swallows the first alarm is still stopped, and
    afterwards no alarm is pending and the previous handler is back."""
    import signal

    from tidal.rewards.math import OutOfTime, deadline

    before = signal.getsignal(signal.SIGALRM)
    swallowed, t0 = 0, time.monotonic()
    with pytest.raises(OutOfTime), deadline(1):
        while True:
            try:
                while True:
                    pass
            except OutOfTime:
                swallowed += 1
                if swallowed > 1:
                    raise
    assert swallowed == 2
    # 1 s, one more REFIRE_S (0.05 s), and a margin of 2 s for a loaded machine's scheduling.
    assert time.monotonic() - t0 < 3.0
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before

def test_a_swallowed_alarm_is_not_reported_and_other_unraisables_still_are():
    """An alarm that lands in a finalizer becomes an 'unraisable' exception: inside the
    deadline it is dropped (the next alarm ends the block), while any other unraisable exception
    still reaches the hook that was installed before, and that hook is back afterwards."""
    import sys

    from tidal.rewards.math import OutOfTime, deadline

    class Finalizer:
        def __init__(self, error: type[BaseException]):
            self.error = error

        def __del__(self):
            raise self.error

    seen: list[type[BaseException]] = []
    before = sys.unraisablehook
    sys.unraisablehook = lambda args: seen.append(args.exc_type)
    recorder = sys.unraisablehook
    try:
        with deadline(30):
            Finalizer(OutOfTime)  # dropped at once: its __del__ raises what an alarm would
            Finalizer(ValueError)
        assert sys.unraisablehook is recorder
    finally:
        sys.unraisablehook = before
    assert seen == [ValueError]


# -- code -----------------------------------------------------------------------------------

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
ADD = "def add(a, b):\n    return a + b\n"
LINKED_LIST = """
class ListNode:
    def __init__(self, val, next=None):
        self.val, self.next = val, next

def reverse(head):
    prev = None
    while head:
        head.next, prev, head = prev, head, head.next
    return prev
"""
LINKED_LIST_TESTS = """
head = reverse(ListNode(1, ListNode(2, ListNode(3))))
vals = []
while head is not None:
    vals.append(head.val)
    head = head.next
assert vals == [3, 2, 1]
assert isinstance(reverse(ListNode(0)), ListNode)
"""
ROOT = """
def root(x):
    if x < 0:
        raise ValueError("negative")
    return x ** 0.5
"""
ROOT_TESTS = """
try:
    root(-1)
except ValueError as e:
    assert "negative" in str(e)
else:
    raise AssertionError("no error")
assert root(4.0) == 2.0
"""
PLAIN = """
import collections, decimal, fractions

def f():
    Point = collections.namedtuple("Point", "x y")
    return {"t": (1, 2.5, None), "s": {1, 2}, "b": b"x", "c": 1j, "p": Point(1, 2), "big": 2 ** 100,
            "nan": float("nan"), "f": frozenset([3]), "q": fractions.Fraction(1, 3), "d": decimal.Decimal("0.1")}

def halve(q):
    return q / 2
"""
PLAIN_TESTS = """
from decimal import Decimal
from fractions import Fraction
r = f()
assert r["t"] == (1, 2.5, None) and r["s"] == {1, 2} and r["b"] == b"x" and r["c"] == 1j
assert r["p"] == (1, 2) and r["big"] == 2 ** 100 and r["nan"] != r["nan"] and r["f"] == frozenset([3])
assert r["q"] == Fraction(1, 3) and type(r["q"]) is Fraction and r["d"] == Decimal("0.1")
assert halve(Fraction(1, 2)) == Fraction(1, 4)
"""
UNITTEST_TESTS = """
import unittest

class T(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

unittest.main(argv=["t"], verbosity=0)
"""
HUMANEVAL_TESTS = """
def check(candidate):
    assert candidate([1, 2]) == [2, 3]
    assert candidate([]) == []

check(incr_list)
"""
# (program, tests, passes): what crosses between the tests' process and the program's.
CODE_CASES = {
    "asserts on calls": (ADD, ADD_TESTS, True),
    "wrong": ("def add(a, b):\n    return a - b\n", ADD_TESTS, False),
    "raises": ("def add(a, b):\n    raise ValueError('no')\n", ADD_TESTS, False),
    "syntax error": ("def add(a, b)\n    return a + b\n", ADD_TESTS, False),
    "reads stdin at import": ("n = int(input())\n" + ADD, ADD_TESTS, False),
    "HumanEval check(candidate)": ("def incr_list(l):\n    return [x + 1 for x in l]\n", HUMANEVAL_TESTS, True),
    "from solution import": (ADD, "from solution import add as f\nassert f(1, 1) == 2\n", True),
    "module constant": ("LIMIT = 10 ** 30\n", "assert LIMIT == 10 ** 30 and type(LIMIT) is int\n", True),
    "classes and objects": (LINKED_LIST, LINKED_LIST_TESTS, True),
    "in-place mutation": ("def sort_in_place(xs):\n    xs.sort()\n",
                          "xs = [3, 1, 2]\nassert sort_in_place(xs) is None\nassert xs == [1, 2, 3]\n", True),
    "callback of a test function": ("def apply_all(f, xs):\n    return [f(x) for x in xs]\n",
                                    "assert apply_all(lambda x: x * x, [1, 2, 3]) == [1, 4, 9]\n", True),
    "generator": ("def evens(n):\n    yield from range(0, n, 2)\n",
                  "assert list(evens(7)) == [0, 2, 4, 6]\nassert 4 in evens(7) and 5 not in evens(7)\n", True),
    "expected exception": (ROOT, ROOT_TESTS, True),
    "plain types round-trip": (PLAIN, PLAIN_TESTS, True),
    "unittest": (ADD, UNITTEST_TESTS, True),
    "unittest, failing": ("def add(a, b):\n    return a * b\n", UNITTEST_TESTS, False),
}


@pytest.fixture(scope="module")
def code_reward():
    require_bwrap()
    loop = asyncio.new_event_loop()
    reward = CodeReward(SandboxConfig(warm=2, max_concurrency=2), limits={"cpu_s": 2, "wall_s": 5})
    yield reward, loop
    loop.run_until_complete(reward.close())
    loop.close()


def test_code_verifier_passes_and_fails(code_reward):
    reward, loop = code_reward

    async def go():
        return await asyncio.gather(*(reward.verdict(p, t) for p, t, _ in CODE_CASES.values()))

    verdicts = dict(zip(CODE_CASES, loop.run_until_complete(go())))
    got = {name: v.passed for name, v in verdicts.items()}
    assert got == {name: passes for name, (_, _, passes) in CODE_CASES.items()}, {
        name: v.reason for name, v in verdicts.items() if v.passed != CODE_CASES[name][2]}
    assert verdicts["wrong"].reason.startswith("AssertionError")
    assert verdicts["raises"].reason == "ValueError: no"
    assert verdicts["syntax error"].reason.startswith("SyntaxError")
    exits = loop.run_until_complete(reward.grade("import os\nos._exit(0)\n", ADD_TESTS))
    assert (exits, exits.metrics) == ({"correct": 0.0}, {"code/program_exited": 1.0, "code/timeout": 0.0})


def test_code_verifier_reports_cpu_and_wall_limits(code_reward):
    """A spinning program's process ends at its CPU limit (the grader names it: a wall clock
    of 60 s leaves 1 CPU second room even on a loaded machine); a sleeping one's sandbox at
    the wall clock. Both are timeouts in the metrics."""
    _, loop = code_reward
    spinning = CodeReward(SandboxConfig(warm=0), limits={"cpu_s": 1, "wall_s": 60})
    sleeping = CodeReward(SandboxConfig(warm=0), limits={"cpu_s": 5, "wall_s": 2})

    async def go():
        try:
            return (await spinning.verdict("def add(a, b):\n    while True:\n        pass\n", ADD_TESTS),
                    await sleeping.grade("import time\ndef add(a, b):\n    time.sleep(60)\n", ADD_TESTS))
        finally:
            await spinning.close()
            await sleeping.close()

    spun, slept = loop.run_until_complete(go())
    assert not spun.passed and spun.reason.endswith("(killed at its CPU time limit (SIGXCPU))"), spun.reason
    assert slept == {"correct": 0.0} and slept.metrics == {"code/program_exited": 0.0, "code/timeout": 1.0}


def test_code_grade_takes_the_original_tests_and_other_program_files(code_reward):
    reward, loop = code_reward
    files = {"helpers.py": "def double(x):\n    return 2 * x\n", "tests.py": "pass  # the policy's edit of a test file"}
    program = "from helpers import double\ndef add(a, b):\n    return double(a) // 2 + b\n"
    assert loop.run_until_complete(reward.grade(program, ADD_TESTS, files=files)) == {"correct": 1.0}
    wrong = "from helpers import double\ndef add(a, b):\n    return double(a)\n"
    assert loop.run_until_complete(reward.grade(wrong, ADD_TESTS, files=files)) == {"correct": 0.0}
    with pytest.raises(ValueError, match="main.py"):
        loop.run_until_complete(reward.grade(program, ADD_TESTS, files={"main.py": ""}))
    with pytest.raises(ValueError, match="tests are empty"):  # every program would pass
        loop.run_until_complete(reward.grade(program, " \n"))


def test_code_verifier_without_isolation_still_grades():
    """isolation=unsafe_host (trusted code only): the grader keeps its standard library on
    its import path even where its user (root here) may write to it."""
    reward = CodeReward(SandboxConfig(isolation="unsafe_host", warm=0))

    async def go():
        return [await reward.grade(ADD, ADD_TESTS), await reward.grade("def add(a, b):\n    return 0\n", ADD_TESTS)]

    assert asyncio.run(go()) == [{"correct": 1.0}, {"correct": 0.0}]


# -- text -----------------------------------------------------------------------------------


def test_regex_reward():
    think = RegexReward(r"^<think>.*</think>", weight=0.2, flags="s")
    assert think("<think>a\nb</think> 4") == 0.2
    assert think("4 <think></think>") == 0.0
    whole = RegexReward(r"<answer>-?\d+</answer>", mode="fullmatch")
    assert whole("  <answer>12</answer>\n") == 1.0 and whole("x <answer>12</answer>") == 0.0
    with pytest.raises(ValueError, match="not a regular expression"):
        RegexReward("(")
    with pytest.raises(ValueError, match="unknown flag"):
        RegexReward("a", flags="q")


def test_length_penalty_formula():
    # -min(max_penalty, max(0, L - target) / scale), scale = target by default.
    penalty = LengthPenalty(target=10)
    assert penalty("x" * 10) == 0.0
    assert penalty("x" * 15) == -0.5
    assert penalty("x" * 40) == -1.0  # capped at max_penalty
    assert penalty("x" * 3, completion_ids=list(range(12))) == -0.2  # tokens when given
    assert LengthPenalty(target=2, unit="words", scale=4, max_penalty=0.25)("a b c d e f") == -0.25
    with pytest.raises(ValueError, match="completion_ids"):
        LengthPenalty(target=2, unit="tokens")("abc")


def test_repetition_penalty_formula():
    assert repetition_ratio(["a", "b", "c", "d"], 2) == 0.0
    # Exact float equalities: the reward computes the same expressions.
    assert repetition_ratio(list("ababab"), 2) == 1 - 2 / 5  # ab, ba of 5 bigrams
    assert repetition_ratio(["a"], 3) == 0.0
    penalty = RepetitionPenalty(n=3, weight=2.0)
    assert penalty("the cat sat on the mat") == 0.0
    line = "we will keep saying the same thing "
    # One 7-word line said k=10 times: ratio = 1 - distinct/total = 1 - 7/68 (exact), near 1 - 1/k.
    assert penalty(line * 10) == -2.0 * (1 - 7 / 68)
    assert RepetitionPenalty(n=2, unit="auto")("x", completion_ids=[1, 2, 1, 2]) == -(1 - 2 / 3)


def test_text_rewards_through_the_reward_contract():
    # Only the columns a reward names reach it; completion_ids when it asks for them.
    assert call_reward(LengthPenalty(target=1), "abc", {"completion_ids": [1, 2, 3], "answer": "1"}) == (-1.0, {})
    assert call_reward(RegexReward("b"), "abc", {"answer": "1"}) == (1.0, {})

"""The `code` environment: problems, splits, the Python session, grading, and the real rollout
driven by a scripted policy (tidal.engines.scripted) to reward 1 and to reward 0."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from sandbox_support import require_bwrap

from tidal.engines.scripted import ScriptedEngine
from tidal.envs import loop_scoped
from tidal.envs.base import Action
from tidal.envs.code import CodeEnv, load_problems
from tidal.models import load_tokenizer
from tidal.runtime.rollout import EpisodeSpec, Rollout
from tidal.types import SamplingParams, Status

ASSETS = "tidal/models/assets/tiny-arith"


@pytest.fixture(autouse=True)
def _bwrap():
    require_bwrap()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ASSETS)


@pytest.fixture(scope="module")
def qwen25_tok(tmp_path_factory):
    """The tiny tokenizer with a Qwen2.5-style template that renders tools and tool calls."""
    from test_rollout import QWEN25_STYLE

    d = tmp_path_factory.mktemp("q25")
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(f"{ASSETS}/{f}", d / f)
    (d / "chat_template.jinja").write_text(QWEN25_STYLE)
    return load_tokenizer(d)


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def problem(task_id: str) -> dict:
    return next(r for r in load_problems() if r["task_id"] == task_id)


GCD = problem("code-gcd")
WRONG_GCD = "def gcd(a, b):\n    return min(a, b)\n"


CHECK_ALL = """
import json, sys
rows, failed = json.load(sys.stdin), []
for r in rows:
    stub = "def %s(*a, **k):\\n    return None\\n" % r["entry_point"]
    for label, program, must_pass in (("reference", r["solution"], True), ("stub", stub, False)):
        namespace = {"__name__": "solution"}
        try:
            exec(program, namespace)
            exec(r["tests"], namespace)
            passed = True
        except Exception:
            passed = False
        if passed != must_pass:
            failed.append((r["task_id"], label))
print(json.dumps(failed))
"""


def test_every_reference_solution_passes_and_a_stub_fails():
    """The shipped problems are gradeable: each reference passes its hidden tests, and a
    function that returns None passes none of them (the tests test). One sandbox run for all
    (each in its own namespace); the verifier itself grades references in the tests below."""
    from tidal.sandbox import run_python_sync

    rows = load_problems()
    assert 30 <= len(rows) <= 60 and len({r["task_id"] for r in rows}) == len(rows)
    result = run_python_sync(CHECK_ALL, stdin=json.dumps(rows), limits={"wall_s": 60, "cpu_s": 60})
    assert result.ok, result.stderr
    assert json.loads(result.stdout) == []


def test_the_env_grades_references_1_and_wrong_programs_0():
    """Through the env's own grading (the verifier, a fresh sandbox, the row's tests)."""
    rows = [problem(t) for t in ("code-gcd", "code-stack_class", "code-flatten", "code-count_islands")]
    mutants = [r["solution"].replace("return", "return 1 or", 1) for r in rows]

    async def go():
        answers = [(r, f"```python\n{program}```") for r in rows for program in (r["solution"],)]
        answers += [(r, f"```python\n{program}```") for r, program in zip(rows, mutants)]
        seen = await asyncio.gather(*(_drive(CodeEnv(r, 0), [text]) for r, text in answers))
        return [s[-1][1] for s in seen]

    assert asyncio.run(go()) == [1.0] * 4 + [0.0] * 4


def test_splits_are_disjoint_cover_the_set_and_the_seed_only_orders():
    train, test = CodeEnv.rows("train", 1000, 0), CodeEnv.rows("test", 1000, 0)
    ids_train, ids_test = {r["task_id"] for r in train}, {r["task_id"] for r in test}
    assert not ids_train & ids_test and len(ids_test) >= 5
    assert ids_train | ids_test == {r["task_id"] for r in load_problems()}
    other = CodeEnv.rows("train", 1000, 7)
    assert {r["task_id"] for r in other} == ids_train and [r["task_id"] for r in other] != [r["task_id"] for r in train]
    assert [r["task_id"] for r in CodeEnv.rows("train", 5, 0)] == [r["task_id"] for r in train[:5]]
    with pytest.raises(ValueError, match="split"):
        CodeEnv.rows("validation", 5, 0)


def test_a_row_without_tests_is_named():
    with pytest.raises(ValueError, match="code-x.*tests"):
        CodeEnv({"prompt": "write f", "task_id": "code-x"})


async def _drive(env: CodeEnv, turns: list[str]) -> list:
    """reset, then each turn as an Action: every observation (the opening messages, each
    step's messages, reward and done)."""
    seen = [await env.reset()]
    try:
        for i, text in enumerate(turns):
            out = await env.step(Action(text, turn=i))
            seen.append((out.messages, out.reward, out.done, [(c.name, c.status) for c in out.tool_calls]))
            if out.done:
                break
    finally:
        await env.close()
    return seen


def test_session_keeps_state_and_shows_output_errors_and_kills():
    turns = [call("run_python", code="x = 6\nx * 7"),
             call("run_python", code="print(x + 1)\nraise ValueError('boom')"),
             call("run_python", code="while True:\n    pass"),
             call("run_python", code="x"),
             call("submit", code=GCD["solution"])]
    env = CodeEnv(GCD, 0, run_timeout_s=1.0)
    seen = asyncio.run(_drive(env, turns))
    outputs = [s[0][0]["content"] for s in seen[1:5]]
    assert outputs[0] == "42\n"  # the final expression is shown
    assert outputs[1].startswith("7\n") and "ValueError: boom" in outputs[1]  # state kept, traceback shown
    assert "killed: it ran past 1 s" in outputs[2]
    assert "NameError" in outputs[3]  # the killed session was replaced: `x` is gone
    assert seen[5][1:3] == (1.0, True) and seen[5][3] == [("submit", "ok")]
    assert env.closed and env._session is None


def test_same_actions_give_the_same_observations():
    turns = [call("run_python", code="import math\nprint(sorted([3, 1, 2]), math.gcd(12, 18))")
             + call("run_python", code="def gcd(a, b):\n    return a\ngcd(4, 6)"),
             call("run_python", code="print(undefined_name)"),
             "I am done.\n```python\n" + WRONG_GCD + "```"]
    first = asyncio.run(_drive(CodeEnv(GCD, 3), turns))
    second = asyncio.run(_drive(CodeEnv(GCD, 3), turns))
    assert first == second
    assert first[1][0][0]["tool_call_id"] == "call_0_0" and "[1, 2, 3] 6" in first[1][0][0]["content"]
    assert first[-1][1:3] == (0.0, True)


def test_the_grade_ignores_the_session():
    """The submission is graded in a fresh sandbox: a helper defined only in the session, a
    `solution.py` written there, or a patched `assert` machinery do not help a wrong program."""
    turns = [call("run_python", code="HELPER = 1\nopen('solution.py', 'w').write('def gcd(a, b):\\n    import math\\n'"
                                     "'    return math.gcd(a, b)\\n')\nimport builtins\nbuiltins.AssertionError = None"),
             call("submit", code="def gcd(a, b):\n    import math\n    return math.gcd(a, b) * HELPER\n")]
    seen = asyncio.run(_drive(CodeEnv(GCD, 0), turns))
    assert seen[-1][1:3] == (0.0, True)


def test_no_program_and_out_of_turns_end_with_zero():
    seen = asyncio.run(_drive(CodeEnv(GCD, 0), ["I don't know."]))
    assert seen[-1][1:3] == (0.0, True)
    seen = asyncio.run(_drive(CodeEnv(GCD, 0, max_turns=2), [call("run_python", code="1")] * 3))
    assert len(seen) == 3 and seen[-1][1:3] == (0.0, True)


# -- the real rollout, a scripted policy ----------------------------------------------------

def _rollout(tok, scripts: list[list[str]], rows: list[dict], max_turns: int = 6):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    engines = [ScriptedEngine.from_texts(tok, turns, stop_token_id=eos) for turns in scripts]
    rollout = Rollout(tok, SamplingParams(max_new_tokens=1024, stop_token_ids=(eos,)), max_turns=max_turns,
                      timeout_s=60.0)
    envs = [CodeEnv(row, 11) for row in rows]

    async def go():
        out = []
        for i, (env, engine, row) in enumerate(zip(envs, engines, rows)):
            spec = EpisodeSpec(env, f"e{i}", f"g{i}", row["task_id"], 11, row=row)
            out += await rollout.run([spec], engine, step=0)
        return out

    return asyncio.run(go()), envs


@pytest.mark.parametrize("template", ["tiny", "qwen25"])
def test_rollout_runs_code_sees_output_and_submits(template, tok, qwen25_tok):
    tok = tok if template == "tiny" else qwen25_tok
    right = [call("run_python", code=WRONG_GCD + "print(gcd(12, 18))"),
             "It printed 12, not 6. Fixed:" + call("submit", code=GCD["solution"])]
    wrong = [call("run_python", code=WRONG_GCD + "print(gcd(12, 18))"), call("submit", code=WRONG_GCD)]
    block = ["```python\n" + GCD["solution"] + "```"]
    episodes, envs = _rollout(tok, [right, wrong, block], [GCD, GCD, GCD])
    good, bad, final_block = episodes
    assert [e.status for e in episodes] == [Status.OK] * 3, [e.error for e in episodes]
    assert (good.reward, bad.reward, final_block.reward) == (1.0, 0.0, 1.0)
    assert good.metrics["correct"] == 1.0 and bad.metrics["correct"] == 0.0
    assert len(good.turns) == 2 and good.turns[0].tool_calls[0].name == "run_python"
    assert good.turns[1].reward == 1.0 and good.metrics["code/runs"] == 1.0
    # The run's output reached the policy as observation tokens (masked), before its second turn.
    t0 = good.turns[0]
    observation = tok.decode(good.tokens[t0.end:t0.obs_end])
    assert "12" in observation and not any(good.loss_mask[t0.end:t0.obs_end])
    assert all(good.loss_mask[t0.start:t0.end])
    assert all(env.closed and env._session is None for env in envs)
    if template == "qwen25":  # the tool schemas reached the prompt through the template
        assert '"name": "run_python"' in tok.decode(good.tokens[:good.prompt_len])


def test_rollout_closes_the_session_when_the_engine_fails(tok):
    class Failing(ScriptedEngine):
        async def generate(self, requests):
            if self.calls >= 1:
                raise RuntimeError("engine died")
            return await super().generate(requests)

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    engine = Failing(ScriptedEngine.from_texts(tok, [call("run_python", code="1")] * 2, stop_token_id=eos)._turns,
                     tokenizer=tok)
    env = CodeEnv(GCD, 0)
    rollout = Rollout(tok, SamplingParams(max_new_tokens=512, stop_token_ids=(eos,)), max_turns=4, timeout_s=60.0)
    (ep,) = asyncio.run(rollout.run([EpisodeSpec(env, "e0", "g0", GCD["task_id"], 0, row=GCD)], engine, step=0))
    assert ep.status is Status.ENGINE_ERROR
    assert env.closed and env._session is None  # the session opened on turn 0 was closed


def test_no_sandbox_pool_outlives_its_event_loop():
    """A run makes an event loop per step: the envs' pools (contended ones too, whose
    semaphore holds the loop) are closed and dropped when the loop shuts down."""
    import threading
    import time


    threads = threading.active_count()
    for _ in range(3):
        async def step():
            envs = [CodeEnv(GCD, i, sandbox={"max_concurrency": 1}) for i in range(3)]
            return await asyncio.gather(*(_drive(e, [call("run_python", code="1"), "no"]) for e in envs))

        asyncio.run(step())
    assert loop_scoped.OBJECTS == {}
    deadline = time.monotonic() + 5.0  # a closed pool's start-up threads exit as they wake
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads, [t.name for t in threading.enumerate()]

"""verifiers environments through tidal (tidal/envs/adapters/verifiers.py), written as verifiers'
docs show (tests/envhub/): a SingleTurnEnv with a two-function rubric (system prompt, few-shot,
parser, eval split), a ToolEnv whose tool runs as a tidal tool, a rubric that raises."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tidal.config import TaskConfig, load_config
from tidal.envs.base import Action, RewardError
from tidal.runtime.tasks import build_task

pytest.importorskip("verifiers")
# Importing verifiers (datasets, openai, its legacy stack) takes 20-50 s on the 2-core machine:
# more than `make test` can spend, so the whole module runs with the slow tests.
pytestmark = pytest.mark.slow
ENVS = Path(__file__).resolve().parent / "envhub"


@pytest.fixture(autouse=True)
def _env_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(ENVS))  # verifiers' loader imports the environment's module


def _play(task, row, texts):
    env = task.make_env(row)

    async def go():
        messages = await env.reset()
        results = [await env.step(Action(t, turn=i, last_turn=i == len(texts) - 1)) for i, t in enumerate(texts)]
        return messages, results

    return asyncio.run(go())


def test_single_turn_env_prompts_and_rubric_parts():
    t = build_task(TaskConfig(env="verifiers:vf_sum_single", env_args={"n": 6}))
    assert t.name == "verifiers:vf_sum_single" and len(t.train_rows) == 6 and len(t.eval_rows) == 8
    assert t.eval_rows[0]["question"] == "What is 40 - 0?"  # its own eval split
    row = t.train_rows[1]
    messages, [res] = _play(t, row, [f"<answer>{row['answer']}</answer>"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]  # system prompt + few-shot
    assert res.done and res.reward_parts == {"correct_answer": 1.0, "uses_format": 0.2} and res.reward == 1.2
    _, [wrong] = _play(t, row, ["<answer>7</answer>"])
    assert wrong.reward_parts == {"correct_answer": 0.0, "uses_format": 0.2}
    _, [bare] = _play(t, row, [row["answer"]])  # its parser finds no <answer>: both 0
    assert bare.reward_parts == {"correct_answer": 0.0, "uses_format": 0.0}


def test_a_raising_rubric_function_is_a_named_reward_error():
    t = build_task(TaskConfig(env="verifiers:vf_sum_single", env_args={"n": 4, "raise_on_odd": True}))
    _, [even] = _play(t, t.train_rows[0], ["<answer>30</answer>"])
    assert even.reward_parts["correct_answer"] == 1.0  # control: the same rubric scores when it does not raise
    with pytest.raises(RewardError, match=r"rubric function `uses_format` raised RuntimeError: the format checker failed"):
        _play(t, t.train_rows[1], ["<answer>33</answer>"])


def test_tool_env_runs_its_tool_as_a_tidal_tool_with_typed_errors():
    t = build_task(TaskConfig(env="verifiers:vf_calc_tools"))
    env = t.make_env(t.train_rows[0])
    assert [s["function"]["name"] for s in env.tools] == ["calculator"]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 30"}}</tool_call>'
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 ** 9"}}</tool_call>'
    _, (first, second, final) = _play(t, t.train_rows[0], [call, bad, "It is 42."])
    assert first.messages[0]["content"] == "42" and [c.status for c in first.tool_calls] == ["ok"]
    assert [c.status for c in second.tool_calls] == ["raised"] and "only integers" in second.messages[0]["content"]
    assert final.done and final.reward_parts == {"correct": 1.0}
    assert final.metrics["verifiers/total_tool_calls"] == 2.0  # its monitor rubric: a metric, not a part


def _train(tmp_path, model, env, steps=2, *extra):
    from tidal.runtime.controller import Controller

    cfg = load_config(None, [f"model.path={model}", f"run.dir={tmp_path}", "run.progress=false", f"train.steps={steps}",
                             "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=24",
                             f"task.env={env}", "task.train_size=8", "task.eval_size=4", "run.eval_every=0",
                             "reward.isolation=inline", *extra])
    ctl = Controller(cfg)
    try:
        ctl.train()
    finally:
        ctl.close()
    return [r for s in range(1, steps + 1) for r in pq.read_table(tmp_path / "episodes" / f"step_{s:06d}.parquet").to_pylist()]


def test_single_turn_and_tool_envs_train_through_the_rollout(tmp_path):
    from tidal.models import DEFAULT_MODEL_DIR, TOOL_MODEL_DIR

    rows = _train(tmp_path / "single", DEFAULT_MODEL_DIR, "verifiers:vf_sum_single", 2, "task.env_args.raise_on_odd=true")
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(set(dict(r["reward_parts"])) == {"correct_answer", "uses_format"} for r in ok)
    failed = [r for r in rows if r["status"] == "reward_error"]  # odd examples: the run went on past them
    assert all(r["env"] == "verifiers:vf_sum_single" for r in rows) and len(rows) == 16
    assert failed and all("uses_format" in (r["error"] or "") for r in failed)
    rows = _train(tmp_path / "tools", TOOL_MODEL_DIR, "verifiers:vf_calc_tools", 2, "rollout.max_turns=3",
                  "rollout.max_new_tokens=48")
    calls = [c for r in rows for t in r["turns"] for c in t["tool_calls"]]
    assert calls and {c["name"] for c in calls} <= {"calculator"} | {c["name"] for c in calls if c["status"] != "ok"}
    assert any(len(r["turns"]) > 1 for r in rows)  # a tool result came back and the policy went on


def test_multi_turn_env_answers_with_its_env_response_until_its_stop_condition():
    t = build_task(TaskConfig(env="verifiers:vf_guess_multiturn"))
    row = next(r for r in t.train_rows if r["answer"] == "7")
    _, (first, second, third) = _play(t, row, ["5", "8", "7"])
    assert first.messages == [{"role": "user", "content": "higher"}] and not first.done
    assert second.messages == [{"role": "user", "content": "lower"}] and not second.done
    assert third.done and third.reward_parts == {"won": 1.0} and third.metrics["verifiers/guesses"] == 2.0
    _, (wrong,) = _play(t, row, ["4"])  # the last turn: scored as it stands
    assert wrong.done and wrong.reward_parts == {"won": 0.0}

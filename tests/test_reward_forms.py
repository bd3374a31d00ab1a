"""The reward forms (tidal per sample, TRL batched, veRL compute_score, and async each), loading
by dotted and file path with factory args, combination by weight into parts, and failures
worded as what they are. These run the real adapters through the inline scorer (the pools
run the same adapters in their workers: tests/test_reward_pool.py)."""

from __future__ import annotations

import asyncio
import logging
import math
import textwrap
import time
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tidal.config import RewardConfig, RewardSpec
from tidal.envs.dataset import load_prompts
from tidal.rewards import call_reward, load_reward
from tidal.rewards.contract import RewardInput
from tidal.rewards.pool import build_scorer

REWARDS = textwrap.dedent('''
    import asyncio

    def seen(completion, **kw):
        """Its parts are the names of the keyword arguments it was given."""
        return {k: 1.0 for k in kw}

    def strict(completion, answer, episode_id):
        return float(completion == answer) + (0.5 if episode_id == "e0" else 0.0)

    def boom(completion, **kw):
        return {"x": 1}["answer"]

    def needs(completion, answer):
        return 1.0

    def returns(completion, value):
        return eval(value)

    async def slow(completion, **kw):
        await asyncio.sleep(30)

    async def aexact(completion, answer):
        await asyncio.sleep(0)
        return {"correct": float(completion == answer)}

    def trl_chat(prompts, completions, completion_ids, answer, **kw):
        out = []
        for p, c, ids, a in zip(prompts, completions, completion_ids, answer):
            assert isinstance(p, list) and p[-1]["role"] == "user" and isinstance(ids, list)
            text = c[0]["content"]
            out.append(None if text == "skip" else float(text == a))
        return out

    def trl_text(prompts, completions, **kw):
        return [float(isinstance(p, str) and isinstance(c, str) and c in p) for p, c in zip(prompts, completions)]

    async def trl_async(prompts, completions, **kw):
        await asyncio.sleep(0)
        return [float(len(c[0]["content"])) for c in completions]

    def trl_short(prompts, completions, **kw):
        return [1.0]

    def trl_float(prompts, completions, **kw):
        return 1.0

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        assert data_source == "openai/gsm8k", data_source
        ok = solution_str.strip().endswith("#### " + ground_truth)
        return {"score": float(ok), "acc": float(ok), "pred": solution_str[-4:], "index": extra_info["index"]}

    async def acompute_score(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0)
        return float(ground_truth in solution_str)

    def length(completion):
        return float(len(completion))

    class Scaled:
        def __init__(self, factor=1.0):
            self.factor = factor

        def __call__(self, completion, answer):
            return self.factor * float(completion == answer)

    NOT_CALLABLE = 3
''')


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_rewards.py"
    path.write_text(REWARDS)
    return str(path)


def make_input(i: int = 0, completion: str = "42", columns: dict | None = None, prompt_messages: list | None = None,
               group: str = "g0") -> RewardInput:
    pm = prompt_messages or [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6*7?"}]
    return RewardInput(f"e{i}", group, "t0", 3, "<rendered prompt>", pm, completion, [5, 6, 7],
                       [*pm, {"role": "assistant", "content": completion}],
                       [{"index": 0, "text": completion, "finish_reason": "stop", "reward": 0.0, "tool_calls": []}],
                       dict(columns or {}))


def score(specs: list[RewardSpec], inputs: list[RewardInput], **cfg):
    scorer = build_scorer(specs, RewardConfig(isolation="inline", **cfg))
    try:
        return asyncio.run(scorer.score(inputs))
    finally:
        asyncio.run(scorer.close())


# -- tidal form --------------------------------------------------------------------------------
def test_tidal_form_gets_columns_and_every_extra_with_kwargs(rewards_file):
    out, = score([RewardSpec(fn=f"{rewards_file}:seen")], [make_input(columns={"answer": "42", "turns": "mine"})])
    assert out.status == "ok"
    assert set(out.parts) == {"prompt", "prompt_messages", "completion_ids", "messages", "turns", "episode_id",
                              "task_id", "answer"}


def test_tidal_form_passes_only_what_its_signature_takes(rewards_file):
    outs = score([RewardSpec(fn=f"{rewards_file}:strict")],
                 [make_input(0, "42", {"answer": "42", "extra": 1}), make_input(1, "41", {"answer": "42"})])
    assert [o.reward for o in outs] == [1.5, 0.0]  # episode_id reached it; `extra` did not (it would raise)
    assert outs[0].parts == {"strict": 1.5}  # one reward returning a float: one part named after it


def test_raise_is_typed_named_and_its_traceback_logged(rewards_file, caplog):
    with caplog.at_level(logging.WARNING, logger="tidal.rewards"):
        out, = score([RewardSpec(fn=f"{rewards_file}:boom")], [make_input(1)])
    assert out.status == "reward_error" and math.isnan(out.reward)
    assert out.error == (f"reward function `{rewards_file}:boom` raised KeyError('answer') "
                         f"on episode e1 (task t0) of step 3")
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert out.error in logged and "Traceback" in logged and 'return {"x": 1}["answer"]' in logged


def test_missing_column_says_which(rewards_file):
    out, = score([RewardSpec(fn=f"{rewards_file}:needs")], [make_input(0, columns={"solution": "1"})])
    assert out.status == "reward_error"
    assert out.error.startswith(f"reward function `{rewards_file}:needs` raised TypeError(")
    assert out.error.endswith("on episode e0 (task t0) of step 3: the row has no column `answer` (columns: solution)")


@pytest.mark.parametrize("value, what", [
    ("'abc'", "returned a str ('abc'), expected a float or a dict of floats"),
    ("[1.0]", "returned a list ([1.0]), expected a float or a dict of floats"),
    ("{'a': 'x'}", "returned a str ('x') for `a`, expected a float or a dict of floats"),
    ("float('nan')", "returned a non-finite reward nan"),
    ("float('-inf')", "returned a non-finite reward -inf"),
    ("{'a': float('inf')}", "returned a non-finite reward inf for `a`"),
    ("None", "returned None, expected a float or a dict of floats"),
    ("{}", "returned an empty dict, expected a float or a dict of floats"),
])
def test_wrong_returns_are_worded_as_what_they_are(rewards_file, value, what):
    out, = score([RewardSpec(fn=f"{rewards_file}:returns")], [make_input(4, columns={"value": value})])
    assert out.status == "reward_error"
    assert out.error == f"reward function `{rewards_file}:returns` {what} on episode e4 (task t0) of step 3"
    assert "raised" not in out.error


def test_numbers_of_other_types_are_rewards(rewards_file):
    outs = score([RewardSpec(fn=f"{rewards_file}:returns")],
                 [make_input(i, columns={"value": v}) for i, v in enumerate(["1", "True", "{'a': 2, 'b': 0.5}"])])
    assert [o.status for o in outs] == ["ok"] * 3
    assert [o.reward for o in outs] == [1.0, 1.0, 2.5]
    assert outs[2].parts == {"a": 2.0, "b": 0.5}


def test_async_tidal_form_and_inline_timeout(rewards_file):
    outs = score([RewardSpec(fn=f"{rewards_file}:aexact")], [make_input(0, "42", {"answer": "42"}),
                                                            make_input(1, "7", {"answer": "42"})])
    assert [(o.status, o.reward, o.metrics.get("correct")) for o in outs] == [("ok", 1.0, 1.0), ("ok", 0.0, 0.0)]
    t0 = time.monotonic()
    out, = score([RewardSpec(fn=f"{rewards_file}:slow")], [make_input(2)], timeout_s=0.3)
    # 0.3 s timeout; the bound leaves 1.7 s for a loaded 2-core machine to run the cancellation.
    assert time.monotonic() - t0 < 2.0
    assert out.status == "timeout"
    assert out.error == (f"reward function `{rewards_file}:slow` did not return within reward.timeout_s=0.3s "
                         f"on episode e2 (task t0) of step 3")


# -- TRL's batched form ------------------------------------------------------------------------
def test_trl_batched_form_conversational_with_none(rewards_file):
    group = [make_input(i, c, {"answer": "42"}) for i, c in enumerate(["42", "7", "skip", "42"])]
    scorer = build_scorer([RewardSpec(fn=f"{rewards_file}:trl_chat", form="trl")], RewardConfig(isolation="inline"))
    assert scorer.per_group  # the rollout gathers a group before it scores a batched reward
    outs = asyncio.run(scorer.score(group))
    assert [o.status for o in outs] == ["ok", "ok", "reward_error", "ok"]
    assert [o.reward for o in outs if o.status == "ok"] == [1.0, 0.0, 1.0]
    assert outs[2].error == (f"reward function `{rewards_file}:trl_chat` returned None for this sample (no reward) "
                             f"on episode e2 (task t0) of step 3")
    assert math.isnan(outs[2].reward)


def test_trl_text_prompts_are_strings(rewards_file):
    text = [{"role": "user", "content": "say hi"}]
    outs = score([RewardSpec(fn=f"{rewards_file}:trl_text", form="trl")],
                 [make_input(0, "hi", prompt_messages=text), make_input(1, "bye", prompt_messages=text)])
    assert [o.reward for o in outs] == [1.0, 0.0]


def test_trl_async_and_bad_answers(rewards_file):
    group = [make_input(i, "x" * (i + 1)) for i in range(3)]
    assert [o.reward for o in score([RewardSpec(fn=f"{rewards_file}:trl_async", form="trl")], group)] == [1.0, 2.0, 3.0]
    short = score([RewardSpec(fn=f"{rewards_file}:trl_short", form="trl")], group)
    assert {o.status for o in short} == {"reward_error"}
    assert short[1].error == (f"reward function `{rewards_file}:trl_short` returned 1 rewards for a group of 3 "
                              f"completions on episode e1 (task t0) of step 3")
    flt = score([RewardSpec(fn=f"{rewards_file}:trl_float", form="trl")], group)
    assert "returned a float (1.0), expected a list of 3 floats or None (one per completion)" in flt[0].error


# -- veRL's compute_score ----------------------------------------------------------------------
def _verl_parquet(path) -> None:
    """Rows as veRL's gsm8k preprocessing writes them."""
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"Natalia sold {n} clips. Let's think step by step."}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(2 * n)},
             "extra_info": {"split": "train", "index": i}} for i, n in enumerate([3, 5])]
    pq.write_table(pa.Table.from_pylist(rows), path)


def _verl_inputs(path, completions) -> list[RewardInput]:
    rows = load_prompts(path)
    return [make_input(i, c, {k: v for k, v in row.items() if k != "prompt"}, prompt_messages=row["prompt"])
            for i, (row, c) in enumerate(zip(rows, completions))]


def test_verl_compute_score_on_verl_parquet(rewards_file, tmp_path):
    _verl_parquet(tmp_path / "train.parquet")
    inputs = _verl_inputs(tmp_path / "train.parquet", ["3 and 3 #### 6", "5 and 5 #### 11"])
    outs = score([RewardSpec(fn=f"{rewards_file}:compute_score", form="verl")], inputs)
    assert [o.status for o in outs] == ["ok", "ok"]
    assert [o.reward for o in outs] == [1.0, 0.0]
    assert outs[0].parts == {"compute_score": 1.0}  # `score` is the reward; its other numbers are metrics
    # the string `pred` is left out; veRL's `acc` is the episode's `correct` (accuracy)
    assert outs[1].metrics == {"reward/extra/acc": 0.0, "reward/extra/index": 1.0, "correct": 0.0}
    assert outs[0].metrics["correct"] == 1.0
    a = score([RewardSpec(fn=f"{rewards_file}:acompute_score", form="verl")], inputs)
    assert [o.reward for o in a] == [1.0, 0.0]  # "10" is not in the second completion


def test_verl_form_names_the_missing_column(rewards_file):
    out, = score([RewardSpec(fn=f"{rewards_file}:compute_score", form="verl")],
                 [make_input(0, columns={"answer": "1"})])
    assert out.status == "reward_error"
    assert out.error == (f"reward function `{rewards_file}:compute_score` needs the row's `reward_model.ground_truth` "
                         f"(veRL's format), and the row has no `reward_model` (columns: answer) on episode e0 "
                         f"(task t0) of step 3")


# -- loading -----------------------------------------------------------------------------------
def test_relative_file_path_and_factory_args(rewards_file, tmp_path, monkeypatch):
    d = tmp_path / "proj" / "rw"
    d.mkdir(parents=True)
    (d / "mine.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path / "proj")  # relative paths start at the current directory
    scaled = load_reward(RewardSpec(fn="rw/mine.py:Scaled", args={"factor": 3.0}))
    assert scaled("a", answer="a") == 3.0
    default = load_reward(RewardSpec(fn="rw/mine.py:Scaled"))  # a class without args is instantiated
    assert default("a", answer="a") == 1.0
    outs = score([RewardSpec(fn="rw/mine.py:Scaled", args={"factor": 2.0})],
                 [make_input(0, "42", {"answer": "42"})])
    assert outs[0].reward == 2.0 and outs[0].parts == {"Scaled": 2.0}


@pytest.mark.parametrize("fn, args, expected", [
    ("nope/missing.py:f", {}, "`task.rewards[2].fn`: file `nope/missing.py` of `nope/missing.py:f` does not exist"),
    ("{file}:absent", {}, "`task.rewards[2].fn`: module `{file}` has no attribute `absent`"),
    ("{file}:NOT_CALLABLE", {}, "`task.rewards[2].fn`: reward `{file}:NOT_CALLABLE` is not callable (it is a int)"),
    ("{file}:Scaled", {"nope": 1}, "`task.rewards[2].fn`: `{file}:Scaled(**{{'nope': 1}})` raised TypeError("),
    ("tidal.rewards.nope:f", {}, "`task.rewards[2].fn`: cannot import module `tidal.rewards.nope`"),
    ("{bad}:f", {}, "`task.rewards[2].fn`: importing `{bad}` raised ZeroDivisionError(division by zero)"),
])
def test_load_errors_name_the_key_and_what_failed(rewards_file, tmp_path, fn, args, expected):
    bad = tmp_path / "bad.py"
    bad.write_text("1 / 0\n")
    fn, expected = fn.format(file=rewards_file, bad=bad), expected.format(file=rewards_file, bad=bad)
    with pytest.raises(ValueError) as e:
        load_reward(SimpleNamespace(fn=fn, args=args), key="task.rewards[2].fn")
    assert str(e.value).startswith(expected), str(e.value)


def test_call_reward_still_calls_a_tidal_function():
    from tidal.rewards.arithmetic import score as arith

    total, parts = call_reward(arith, "<answer>12</answer>", {"answer": "12"})
    # plain pytest.approx in this file (rel 1e-6): hand values (0.1, 1/3, 18/5) against a few float
    # operations on them, which round alike on every CPU; the margin is decimal representation only
    assert total == pytest.approx(1.1) and parts == {"correct": 1.0, "format": pytest.approx(0.1)}


# -- combination -------------------------------------------------------------------------------
def test_several_rewards_combine_by_weight_into_named_parts(rewards_file):
    specs = [RewardSpec(fn="tidal.rewards.arithmetic:score", weight=0.5),
             RewardSpec(fn=f"{rewards_file}:length", weight=-0.1, name="len")]
    out, = score(specs, [make_input(0, "<answer>12</answer>", {"answer": "12"})])
    assert out.status == "ok"
    # parts are stored weighted: 0.5*1, 0.5*0.1, -0.1*19 characters
    assert out.parts == pytest.approx({"score/correct": 0.5, "score/format": 0.05, "len": -1.9})
    assert out.reward == sum(out.parts.values())  # exactly: the reward is the sum of the parts
    assert out.metrics["correct"] == 1.0  # accuracy reads the unweighted `correct`


def test_one_failing_reward_fails_the_episode_and_names_itself(rewards_file):
    specs = [RewardSpec(fn="tidal.rewards.arithmetic:score"), RewardSpec(fn=f"{rewards_file}:boom")]
    out, = score(specs, [make_input(7, "<answer>12</answer>", {"answer": "12"})], )
    assert out.status == "reward_error"
    assert out.error.startswith(f"reward function `{rewards_file}:boom` raised KeyError('answer') on episode e7")


def test_part_names_must_differ():
    with pytest.raises(ValueError, match=r"`task.rewards\[1\].fn`: its part name `score` is also that of "
                                         r"`task.rewards\[0\].fn`; give one of them a `name`"):
        build_scorer([RewardSpec(fn="tidal.rewards.arithmetic:score"), RewardSpec(fn="tidal.rewards.code:score")],
                     RewardConfig(isolation="inline"))


def test_parts_with_metrics_reach_the_episode_metrics_not_the_reward():
    from tidal.config import RewardConfig, RewardSpec

    scorer = build_scorer([RewardSpec(fn="test_reward_forms:judged")], RewardConfig(isolation="inline"))
    (out,) = asyncio.run(scorer.score([make_input(0)]))
    assert out.status == "ok" and out.reward == 0.5 and out.parts == {"judge": 0.5}
    assert out.metrics.get("judge/injection") == 1.0


def judged(completion):
    from tidal.rewards.contract import RewardParts

    return RewardParts({"judge": 0.5}, {"judge/injection": 1.0})

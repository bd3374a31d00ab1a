"""reasoning-gym through tidal (tidal/envs/adapters/reasoning_gym.py): rows of two real tasks
with distinct train and held-out seeds, the task's own score_answer on the extracted answer,
an unknown task and a missing extra named at config load, and a run through the rollout."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tidal.config import ConfigError, TaskConfig, load_config
from tidal.runtime.tasks import build_task

pytest.importorskip("reasoning_gym")

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}


def _columns(row):
    return {k: v for k, v in row.items() if k != "prompt"}


@pytest.mark.parametrize(("task", "args"), [("chain_sum", CHAIN), ("basic_arithmetic", {"max_terms": 3})])
def test_two_tasks_give_distinct_splits_scored_by_their_own_score_answer(task, args):
    import reasoning_gym

    from tidal.envs.adapters.reasoning_gym import score

    t = build_task(TaskConfig(dataset=f"reasoning_gym:{task}", dataset_args=args, train_size=40, eval_size=40))
    assert t.name == f"reasoning_gym:{task}"
    assert [r.fn for r in t.rewards] == ["tidal.envs.adapters.reasoning_gym:score"]
    train_ids = {r["task_id"] for r in t.train_rows}
    assert len(train_ids) == 40 and not train_ids & {r["task_id"] for r in t.eval_rows}
    assert [r["prompt"] for r in t.train_rows] != [r["prompt"] for r in t.eval_rows]  # distinct seeds
    row = t.train_rows[3]
    entry = reasoning_gym.create_dataset(task, size=40, seed=row["rg_seed"], **args)[3]
    assert row["prompt"][0]["content"] == entry["question"] and row["answer"] == str(entry["answer"])
    assert score(f"work <answer>{row['answer']}</answer>", **_columns(row)) == {"correct": 1.0}
    assert score(f"<answer>{int(float(row['answer'])) + 1}</answer>", **_columns(row))["correct"] < 1.0
    assert score(row["answer"], **_columns(row)) == {"correct": 0.0}  # no <answer> tag: nothing extracted


def test_prompt_template_rewords_the_question_from_the_entry():
    t = build_task(TaskConfig(dataset="reasoning_gym:chain_sum", dataset_args=CHAIN, prompt_template="What is {expression}?",
                              train_size=4, eval_size=4))
    assert t.train_rows[0]["prompt"][0]["content"].startswith("What is ")
    with pytest.raises(ConfigError, match=r"`task.prompt_template`: 'nope' .*fields: .*expression"):
        build_task(TaskConfig(dataset="reasoning_gym:chain_sum", prompt_template="{nope}", train_size=4, eval_size=4))


def test_unknown_task_and_bad_config_are_named():
    with pytest.raises(ConfigError, match=r"no task `chain_summ` \(it has \d+: .*chain_sum"):
        build_task(TaskConfig(dataset="reasoning_gym:chain_summ"))
    with pytest.raises(ConfigError, match=r"`task.dataset_args`: reasoning-gym task `chain_sum` rejects \{'bogus': 1\}"):
        build_task(TaskConfig(dataset="reasoning_gym:chain_sum", dataset_args={"bogus": 1}))


def test_missing_extra_fails_config_load_with_the_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    TaskConfig(dataset="reasoning_gym:chain_sum")  # control: installed, it loads
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else real(name, *a))
    with pytest.raises(ValueError, match=r"`task.dataset: reasoning_gym:chain_sum` needs the `reasoning_gym` package: "
                                         r"pip install 'tidal\[reasoning-gym\]'"):
        load_config(None, ["task.dataset=reasoning_gym:chain_sum"])


@pytest.mark.slow
def test_two_steps_through_the_rollout_store_the_score_as_a_part(tmp_path):
    from tidal.models import DEFAULT_MODEL_DIR
    from tidal.runtime.controller import Controller

    cfg = load_config(None, [
        f"model.path={DEFAULT_MODEL_DIR}", f"run.dir={tmp_path / 'run'}", "run.progress=false", "train.steps=2",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=16",
        "task.dataset=reasoning_gym:chain_sum", "task.train_size=16", "task.eval_size=4", "run.eval_every=0",
        "task.prompt_template=What is {expression}?", "reward.isolation=inline",
        *(f"task.dataset_args.{k}={v}" for k, v in CHAIN.items())])
    ctl = Controller(cfg)
    try:
        ctl.train()
    finally:
        ctl.close()
    rows = pq.read_table(tmp_path / "run" / "episodes" / "step_000002.parquet").to_pylist()
    assert len(rows) == 8 and all(r["env"] == "reasoning_gym:chain_sum" for r in rows)
    for r in rows:
        assert r["status"] in ("ok", "truncated")
        if r["status"] == "ok":
            parts = dict(r["reward_parts"])  # stored as a map: (key, value) pairs
            assert set(parts) == {"correct"} and r["reward"] == parts["correct"]

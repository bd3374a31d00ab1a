"""Evaluation is honest: a failed evaluation episode is counted apart (failed_frac) and never
averaged in as wrong; accuracy is read where the reward says what is correct in any form (a
`correct` part, a reward named `correct`, veRL's `acc`), eval.reward takes every form
(eval.reward_form), and where no reward can say what is correct a line says so at start.
The real rollout and reward pool, a scripted policy that answers "4" to every problem."""

from __future__ import annotations

import json
import logging
import textwrap

import pytest

from tidal.config import EvalConfig, RewardConfig, RewardSpec, TaskConfig, load_config
from tidal.engines.scripted import ScriptedEngine
from tidal.models import load_tokenizer
from tidal.rewards.pool import build_scorer
from tidal.runtime.evaluate import accuracy_note, evaluate_during_training, evaluate_engine
from tidal.runtime.rollout import Rollout
from tidal.runtime.tasks import build_task
from tidal.types import SamplingParams

REWARDS = textwrap.dedent('''
    def exact(completion, answer):
        if answer == "boom":
            raise ConnectionError("the grading service went away")
        return {"correct": float(completion.strip() == answer)}

    def trl_exact(prompts, completions, answer, **kw):
        if "boom" in answer:
            raise ConnectionError("the grading service went away")
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "boom":
            raise ConnectionError("the grading service went away")
        ok = float(solution_str.strip() == ground_truth)
        return {"score": 2 * ok - 1, "acc": ok}
''')
# The policy answers 4: right on the two rows whose answer is 4, wrong on the 5, and the
# reward fails on the two "boom" rows. Scored: 2 right of 3 (0.667); failed: 2 of 5.
ANSWERS = ["4", "5", "boom", "4", "boom"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("evalhonest")
    (tmp / "rewards.py").write_text(REWARDS)
    rows = [{"prompt": f"What is {i}?", "answer": a, "data_source": "toy", "reward_model": {"ground_truth": a}}
            for i, a in enumerate(ANSWERS)]
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(tiny_model_dir)
    return tmp, tok


def answers_4(tok) -> ScriptedEngine:
    """A policy that answers "4" to every request (each evaluation reuses the episode ids)."""
    ids = tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return ScriptedEngine(lambda request: ids, tokenizer=tok)


def evaluate(setup, spec: RewardSpec, k: int = 0) -> dict:
    tmp, tok = setup
    task = build_task(TaskConfig(dataset=str(tmp / "rows.jsonl"), eval_dataset=str(tmp / "rows.jsonl"),
                                 reward=spec.fn, reward_form=spec.form))
    scorer = build_scorer([spec], RewardConfig(isolation="inline"))
    eos = tok.eos_token_id
    engine = answers_4(tok)
    rollout = Rollout(tok, SamplingParams(max_new_tokens=8, stop_token_ids=(eos,)), scorer=scorer)
    return evaluate_engine(engine, rollout, task.eval_rows, task.make_env, k=k)


@pytest.mark.parametrize("spec", [
    pytest.param(lambda d: RewardSpec(fn=f"{d}/rewards.py:exact"), id="tidal-correct-part"),
    pytest.param(lambda d: RewardSpec(fn=f"{d}/rewards.py:trl_exact", form="trl", name="correct"), id="trl-named-correct"),
    pytest.param(lambda d: RewardSpec(fn=f"{d}/rewards.py:compute_score", form="verl"), id="verl-acc"),
])
def test_failed_episodes_are_counted_apart_never_as_wrong(setup, spec):
    res = evaluate(setup, spec(setup[0]), k=2)
    assert res["failed"] == 2 and res["failed_frac"] == pytest.approx(2 / 5)
    assert res["scored"] == 3 and res["accuracy"] == pytest.approx(2 / 3)  # counted wrong, it would be 2/5
    assert "the grading service went away" in res["first_error"]
    # the same with samples: the 3 scored problems, their 2 samples each (a deterministic policy)
    assert res["pass_at_1"] == pytest.approx(2 / 3) and res["pass_at_k"] == pytest.approx(2 / 3)


def test_a_trl_float_not_named_correct_has_no_accuracy_and_says_so_at_start(setup):
    tmp, _ = setup
    unnamed = RewardSpec(fn=f"{tmp}/rewards.py:trl_exact", form="trl")
    res = evaluate(setup, unnamed)
    assert res["accuracy"] is None and res["failed_frac"] == pytest.approx(2 / 5)  # unknown, not 0
    note = accuracy_note([unnamed], ["task.reward"])
    assert note is not None and "no reward says what is correct" in note and "name: correct" in note
    assert accuracy_note([RewardSpec(fn="x.py:f", form="trl", name="correct")], ["task.reward"]) is None
    assert accuracy_note([RewardSpec(fn="x.py:compute_score", form="verl")], ["task.reward"]) is None
    assert accuracy_note([RewardSpec(fn="x.py:f")], ["task.reward"]) is None  # may return a `correct` part


def test_during_training_failed_frac_is_a_metric_and_accuracy_leaves_failures_out(setup):
    tmp, tok = setup
    task = build_task(TaskConfig(dataset=str(tmp / "rows.jsonl"), eval_dataset=str(tmp / "rows.jsonl"),
                                 reward=f"{tmp}/rewards.py:exact"))
    scorer = build_scorer([RewardSpec(fn=f"{tmp}/rewards.py:exact")], RewardConfig(isolation="inline"))
    engine = answers_4(tok)
    rollout = Rollout(tok, SamplingParams(max_new_tokens=8, stop_token_ids=(tok.eos_token_id,)), scorer=scorer)
    out = evaluate_during_training(engine, rollout, task.eval_rows, {"again": task.eval_rows}, task.make_env,
                                   EvalConfig(n=5), step=2)
    assert out == pytest.approx({"eval/accuracy": 2 / 3, "eval/failed_frac": 2 / 5, "eval/again/accuracy": 2 / 3,
                                 "eval/again/failed_frac": 2 / 5})


def test_eval_reward_takes_every_form_and_a_trl_task_says_at_start(setup, tiny_model_dir, tmp_path, caplog):
    """A run trained on a TRL reward (no accuracy of its own) evaluated by a veRL function
    (eval.reward_form=verl): eval/accuracy from its `acc`, failures apart. The start warns
    when nothing can say what is correct (the TRL reward, without eval.reward)."""
    from tidal.runtime.controller import Controller

    tmp, _ = setup
    base = [f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}", f"task.dataset={tmp / 'rows.jsonl'}",
            f"task.eval_dataset={tmp / 'rows.jsonl'}", f"task.reward={tmp}/rewards.py:trl_exact", "task.reward_form=trl",
            "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
            "run.eval_every=1", "eval.n=5", "train.steps=1", "run.progress=false", "run.save_every=0",
            "reward.isolation=inline", "reward.failure_budget=1.0"]
    with caplog.at_level(logging.WARNING, logger="tidal"):
        ctl = Controller(load_config(None, [*base, f"eval.reward={tmp}/rewards.py:compute_score",
                                            "eval.reward_form=verl"]))
        try:
            ctl.train()
        finally:
            ctl.close()
    row = [json.loads(line) for line in (ctl.paths.root / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["eval/failed_frac"] == pytest.approx(2 / 5) and 0.0 <= row["eval/accuracy"] <= 1.0
    assert not any("no reward says what is correct" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tidal"):
        ctl = Controller(load_config(None, [*base[:1], f"run.dir={tmp_path / 'run2'}", *base[2:]]))
        ctl.close()
    assert any("no reward says what is correct" in r.getMessage() for r in caplog.records)
    caplog.clear()
    no_heldout = [o for o in base[2:] if not o.startswith("task.eval_dataset=")]
    with caplog.at_level(logging.WARNING, logger="tidal"):
        ctl = Controller(load_config(None, [*base[:1], f"run.dir={tmp_path / 'run3'}", *no_heldout]))
        ctl.close()
    assert any("no held-out rows (task.eval_dataset is not set" in r.getMessage() for r in caplog.records)

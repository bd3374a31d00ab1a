"""Evaluation during training: the starting weights as step 0 (eval.at_start), sampled pass@k
every eval.k_every steps, several held-out sets (eval.sets), and the best checkpoint by a
chosen metric kept out of the rotation (eval.keep_best)."""

from __future__ import annotations

import json

import pytest

from tidal.config import load_config
from tidal.envs.dataset import DatasetError
from tidal.runtime.checkpoints import checkpoint_dirs
from tidal.runtime.controller import Controller
from tidal.runtime.evaluate import evaluate_engine


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalrun")
    probe = Controller(load_config(None, [f"run.dir={tmp / 'probe'}", "run.progress=false"]))
    rows = probe.task.eval_rows[100:110]  # a second held-out set: other problems of the held-out split
    (tmp / "second.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    start = evaluate_engine(probe.engine, probe.eval_rollout, probe.task.eval_rows[:16], probe.make_env, k=0)
    probe.close()
    cfg = load_config(None, [
        f"run.dir={tmp / 'run'}", "train.steps=6", "rollout.prompts_per_step=8", "run.progress=false",
        "run.eval_every=2", "eval.n=16", "eval.at_start=true", "eval.k_every=4", "eval.k=2",
        f"eval.sets={{second: {tmp / 'second.jsonl'}}}", "eval.keep_best=eval/accuracy",
        "run.save_every=0", "run.keep_checkpoints=1"])
    ctl = Controller(cfg)
    try:
        ctl.train()
    finally:
        ctl.close()
    rows = {r["step"]: r for r in map(json.loads, (ctl.paths.root / "metrics.jsonl").read_text().splitlines())}
    return ctl, rows, start


def test_the_starting_weights_are_step_0(evaluated_run):
    _, rows, start = evaluated_run
    assert set(rows[0]) == {"step", "eval/accuracy", "eval/second/accuracy", "eval/failed_frac",
                            "eval/second/failed_frac"}
    assert rows[0]["eval/failed_frac"] == rows[0]["eval/second/failed_frac"] == 0.0  # the default task fails none
    # The same greedy evaluation of the same weights on the same problems: the same accuracy.
    assert rows[0]["eval/accuracy"] == start["accuracy"]


def test_every_evaluation_has_each_set_and_pass_at_k_on_its_steps(evaluated_run):
    _, rows, _ = evaluated_run
    evaluated = sorted(s for s, r in rows.items() if "eval/accuracy" in r)
    assert evaluated == [0, 2, 4, 6]
    assert all("eval/second/accuracy" in rows[s] for s in evaluated)
    sampled = sorted(s for s, r in rows.items() if "eval/pass_at_k" in r)
    assert sampled == [4]  # k_every=4 within 6 steps
    assert 0.0 <= rows[4]["eval/pass_at_1"] <= rows[4]["eval/pass_at_k"] <= 1.0
    assert all(0.0 <= rows[s]["eval/second/accuracy"] <= 1.0 for s in evaluated)


def test_the_best_checkpoint_is_kept_out_of_the_rotation(evaluated_run):
    ctl, rows, _ = evaluated_run
    best = json.loads((ctl.paths.checkpoints / "best.json").read_text())
    scores = {s: rows[s]["eval/accuracy"] for s in (2, 4, 6)}
    first_best = min(s for s, v in scores.items() if v == max(scores.values()))  # the earliest of equals: "improves"
    assert best["step"] == first_best and best["value"] == scores[first_best] and best["metric"] == "eval/accuracy"
    kept = {p.name for p in checkpoint_dirs(ctl.paths.checkpoints)}
    # keep_checkpoints=1: the last step's, and the best's beside it.
    assert kept == {"step_000006", f"step_{first_best:06d}"}
    assert best["checkpoint"] == str(ctl.paths.checkpoint(first_best))


def test_a_missing_eval_set_is_named_by_its_key(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"eval.sets={{gsm: {tmp_path / 'nope.jsonl'}}}"])
    with pytest.raises(DatasetError, match=r"eval\.sets\.gsm: dataset `.*nope\.jsonl` does not exist"):
        Controller(cfg)

"""Honest resume and checkpoints you can trust: `--resume` continues with the run's own saved
config (overrides on top, shown and recorded in resumes.jsonl, config.yaml untouched), names
the checkpoint it resumed from, says when nothing is left to do; a damaged checkpoint is
skipped for the one before it, and retention never deletes the last good one."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from tidal.cli import main
from tidal.config import load_config
from tidal.monitor.run_status import run_status
from tidal.runtime.checkpoints import damage, latest_good, prune, write_manifest

SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
         "task.train_size=32", "task.eval_size=8", "run.progress=false", "run.eval_every=0", "run.save_every=1"]


def _train(model, run, *extra):
    return main(["train", f"model.path={model}", f"run.dir={run}", *SMALL, *extra])


def _steps(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_continues_with_the_runs_own_config_and_records_the_overrides(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(tiny_model_dir, run, "train.steps=1", "train.lr=0.002") == 0
    saved = (run / "config.yaml").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", f"run.dir={run}", "train.steps=2", "run.threads=1"]) == 0
    err = capsys.readouterr().err
    assert f"from checkpoint {run / 'checkpoints' / 'step_000001'}" in err and "(step 1 of train.steps=2)" in err
    assert "train.steps: 1 -> 2" in err and "changes what" not in err  # neither override changes the computation
    assert (run / "config.yaml").read_text() == saved  # the run's record stays the original
    steps = _steps(run)
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[1]["episodes/ok"] + steps[1].get("episodes/truncated", 0) == 4  # 2×2: the saved config, not 32×8
    (entry,) = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert entry["overrides"] == ["train.steps=2", "run.threads=1"] and entry["checkpoint"].endswith("step_000001")
    assert entry["changed"] == {"train.steps": [1, 2], "run.threads": [0, 1]} and entry["changes_computation"] == []
    assert yaml.safe_load(saved)["train"]["lr"] == 0.002

    # nothing left to do: said, and nothing runs
    assert main(["train", "--resume", f"run.dir={run}"]) == 0
    assert "nothing to do: the run is at step 2 of train.steps=2" in capsys.readouterr().err
    assert [m["step"] for m in _steps(run)] == [1, 2]

    # an override that changes the computation is named as such
    assert main(["train", "--resume", f"run.dir={run}", "train.steps=3", "train.lr=0.01"]) == 0
    assert "train.lr: 0.002 -> 0.01  (changes what the resumed steps compute)" in capsys.readouterr().err
    assert json.loads((run / "resumes.jsonl").read_text().splitlines()[-1])["changes_computation"] == ["train.lr"]


def test_resume_refuses_what_cannot_be_continued(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(tiny_model_dir, run, "train.steps=1") == 0
    capsys.readouterr()
    assert main(["train", "--resume", f"run.dir={run}", "model.path=default"]) == 2
    assert "`model.path` cannot change" in capsys.readouterr().err
    assert main(["train", "--resume", "train.steps=2"]) == 2
    assert "--resume needs run.dir=RUN_DIR" in capsys.readouterr().err
    assert main(["train", "--resume", f"run.dir={tmp_path / 'none'}"]) == 2
    assert "config.yaml does not exist" in capsys.readouterr().err
    assert main(["train", "examples/tool_arith.yaml", "--resume", f"run.dir={run}"]) == 2
    assert "give overrides only" in capsys.readouterr().err


def test_a_damaged_checkpoint_is_skipped_for_the_one_before(tiny_model_dir, tmp_path, capsys, caplog):
    run = tmp_path / "run"
    assert _train(tiny_model_dir, run, "train.steps=2", "run.keep_checkpoints=2") == 0
    newest = run / "checkpoints" / "step_000002"
    weights = next(p for p in newest.rglob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, as by a full disk
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="tidal"):
        assert main(["train", "--resume", f"run.dir={run}", "train.steps=3"]) == 0
    assert "step_000002 is damaged" in caplog.text and "truncated" in caplog.text
    assert "from checkpoint " + str(run / "checkpoints" / "step_000001") in capsys.readouterr().err
    assert [m["step"] for m in _steps(run)] == [1, 2, 3]  # step 2 is done again from step 1's checkpoint


def test_checkpoint_manifest_catches_each_kind_of_damage(tmp_path):
    ck = tmp_path / "step_000001"
    (ck / "model").mkdir(parents=True)
    (ck / "model" / "w.bin").write_bytes(b"x" * 1000)
    (ck / "controller.json").write_text("{}")
    assert damage(ck) is not None  # no manifest yet: not complete
    write_manifest(ck)
    assert damage(ck) is None
    (ck / "model" / "w.bin").write_bytes(b"y" * 1000)  # same size, other bytes
    assert "SHA-256" in damage(ck)
    (ck / "model" / "w.bin").unlink()
    assert "missing" in damage(ck)


def test_retention_never_deletes_the_last_good_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        d = root / f"step_00000{step}"
        d.mkdir(parents=True)
        (d / "f").write_text(str(step))
        write_manifest(d)
    bad = root / "step_000003"
    bad.mkdir()
    (bad / "f").write_text("3")  # never completed: no manifest
    prune(root, keep=1, newest=bad)
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002", "step_000003"]
    assert latest_good(root) == root / "step_000002"
    prune(root, keep=1, newest=root / "step_000002")
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003"]  # 1 goes, 2 stays
    assert latest_good(root) == root / "step_000002"


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


PLAN_SPECS = EXAMPLES / "plan"  # `tidal plan` specs (docs/plan.md), not training configs


@pytest.mark.parametrize("path", sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.y*ml")
                                        if PLAN_SPECS not in p.parents))
def test_every_example_config_validates(path):
    assert load_config(str(EXAMPLES / path)).train.steps >= 1


@pytest.mark.parametrize("path", sorted(p.name for p in PLAN_SPECS.glob("*.y*ml")))
def test_every_example_plan_spec_validates(path):
    from tidal.plan.spec import load_spec

    assert load_spec(PLAN_SPECS / path) is not None


def overflowing_reward(completion: str, answer: str) -> float:
    return 1.7e308  # finite, but a group's sum overflows: advantages and the loss become NaN


def test_repeated_non_finite_gradients_stop_the_run_with_its_checkpoint(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(tiny_model_dir, run, "train.steps=1") == 0  # a good checkpoint first
    capsys.readouterr()
    code = main(["train", "--resume", f"run.dir={run}", "train.steps=10", "task.reward=test_resume:overflowing_reward",
                 "train.max_nonfinite_steps=2", "reward.isolation=inline"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "stopping at step 3: the gradient was NaN or inf in 2 steps in a row" in err
    assert f"The last checkpoint is {run / 'checkpoints' / 'step_000001'}." in err  # from before the NaNs
    steps = _steps(run)
    assert [m["step"] for m in steps] == [1, 2, 3] and all(m["skipped_step"] == 1.0 for m in steps[1:])
    assert latest_good(run / "checkpoints") == run / "checkpoints" / "step_000001"
    status = run_status(run)  # what the dashboard shows: the exit code and why (tidal/monitor/run_status.py)
    assert (status["state"], status["exit_code"]) == ("failed", 3) and "NaN or inf" in status["message"]

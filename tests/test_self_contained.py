"""A run directory stands on its own (tidal/runtime/sources.py): its config.yaml holds absolute
paths, its environment and reward files are copied into it with their hashes, and `tidal eval`
and `tidal replay` of it work from another directory with the copies, saying when the originals
have changed; the dashboard's config diff shows two runs of one file path but other code."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tidal.cli import main
from tidal.monitor.dashboard.data import RunView, config_diff

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
ENV = '''from tidal.envs.single_turn import SingleTurnEnv


class Env(SingleTurnEnv):
    async def reset(self):
        messages = await super().reset()
        messages[0]["content"] = "{prefix} " + messages[0]["content"]
        return messages
'''
REWARD = '''from tidal.rewards.arithmetic import score as _score


def score(completion, answer):
    return {{"correct": _score(completion, answer)["correct"] * {scale}}}
'''
SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
         "run.progress=false", "run.eval_every=0", "train.steps=1", "run.save_every=1"]


@pytest.fixture
def project(tmp_path, monkeypatch, tiny_model_dir):
    """A user's project: an environment and a reward file and datasets, named relative to it."""
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "envs.py").write_text(ENV.format(prefix="Solve:"))
    (proj / "rewards.py").write_text(REWARD.format(scale=1.0))
    for split in ("train", "test"):
        shutil.copy(EXAMPLES / f"arith_{split}.jsonl", proj / "data" / f"{split}.jsonl")
    shutil.copytree(tiny_model_dir, proj / "model")
    monkeypatch.chdir(proj)
    return proj


def _train(run: str, *extra: str) -> int:
    return main(["train", "model.path=model", f"run.dir={run}", "task.env=envs.py:Env", "task.reward=rewards.py:score",
                 "task.dataset=data/train.jsonl", "task.eval_dataset=data/test.jsonl", *SMALL, *extra])


def test_a_run_is_evaluated_and_replayed_from_elsewhere_with_its_own_code(project, tmp_path, monkeypatch, capsys,
                                                                          caplog):
    assert _train("runs/a") == 0
    run = project / "runs" / "a"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["task"]["env"] == f"{project / 'envs.py'}:Env" and saved["model"]["path"] == str(project / "model")
    assert saved["task"]["dataset"] == str(project / "data" / "train.jsonl") and saved["run"]["dir"] == str(run)
    kept = json.loads((run / "sources.json").read_text())
    for key, name in (("task.env", "envs.py"), ("task.reward", "rewards.py")):
        digest = hashlib.sha256((project / name).read_bytes()).hexdigest()
        assert kept[key]["sha256"] == digest and kept[key]["file"] == str(project / name)
        assert (run / kept[key]["copy"]).read_bytes() == (project / name).read_bytes()

    # the user edits both files and works from another directory
    (project / "envs.py").write_text(ENV.format(prefix="Compute:"))
    (project / "rewards.py").write_text(REWARD.format(scale=0.0))
    # a new command is a new process: it imports the files as they are now, not as this one did
    for name in [m for m in sys.modules if m.startswith(("tidal_user_envs_", "tidal_user_rewards_"))]:
        monkeypatch.delitem(sys.modules, name)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tidal"):
        assert main(["replay", str(run), "s1-p0-e0", "--json"]) == 0  # the copy of the environment: it reproduces
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["reproduced"], res
    assert f"replay: task.env: {project / 'envs.py'} has changed since the run copied it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tidal"):
        assert main(["eval", str(run / "checkpoints" / "step_000001"), "eval.n=4", "eval.k=1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["n"] == 4 and res["accuracy"] is not None
    assert "eval: task.reward:" in caplog.text and "has changed since the run copied it" in caplog.text
    caplog.clear()  # the run's config.yaml given by name counts as the run's own
    with caplog.at_level(logging.WARNING, logger="tidal"):
        assert main(["eval", str(run / "checkpoints" / "step_000001"), str(run / "config.yaml"), "eval.n=2",
                     "eval.k=1", "--json"]) == 0
    assert "eval: task.reward:" in caplog.text
    caplog.clear()  # a resume goes on with the file as it is now (how a fix reaches a run), and says so
    with caplog.at_level(logging.WARNING, logger="tidal"):
        assert main(["train", "--resume", f"run.dir={run}", "train.steps=2"]) == 0
    assert "--resume: task.reward:" in caplog.text and "goes on with the file as it is now" in caplog.text
    assert json.loads((run / "sources.json").read_text()) == kept  # the run's record of what it started with


def test_the_config_diff_shows_other_code_under_one_path(project):
    assert _train("runs/a") == 0
    (project / "rewards.py").write_text(REWARD.format(scale=0.5))
    assert _train("runs/b") == 0
    a, b = RunView(project / "runs" / "a").config(), RunView(project / "runs" / "b").config()
    assert a["task.reward"] == b["task.reward"]  # the same path...
    diff = {d["key"]: d["values"] for d in config_diff([a, b])}
    assert set(diff) == {"run.dir", "sources.task.reward"}  # ...but other code; the environment is the same
    assert diff["sources.task.reward"][1] == "sha256:" + hashlib.sha256((project / "rewards.py").read_bytes()).hexdigest()[:12]

"""`tidal replay`: an episode of the default job reproduces token for token from its seed, the
checkpoint of the weights that generated it and its environment; with other weights it
reports where it first diverges and why."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidal.cli import main
from tidal.config import load_config
from tidal.runtime.controller import Controller
from tidal.runtime.replay import ReplayError, find_episode, replay


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("replay") / "run"
    cfg = load_config(None, [f"run.dir={run}", "train.steps=3", "rollout.prompts_per_step=4", "run.eval_every=0",
                             "run.progress=false", "run.save_every=1", "run.keep_checkpoints=3"])
    ctl = Controller(cfg)
    try:
        ctl.train()
    finally:
        ctl.close()
    return run


@pytest.mark.parametrize("episode_id, version", [("s1-p2-e5", 0), ("s3-p1-e2", 2)])
def test_an_episode_of_the_default_job_reproduces_token_for_token(run_dir, episode_id, version, capsys):
    assert main(["replay", str(run_dir), episode_id, "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["reproduced"] and res["version"] == version and res["first_divergence"] is None
    assert res["recorded_tokens"] == res["replayed_tokens"] == len(find_episode(run_dir, episode_id)["tokens"])
    # Teacher-forced log-probs of the recorded tokens under the same weights: float noise only
    # (1e-4: float32 forwards of one model on other batches agree to ~1e-5 here).
    assert res["max_logprob_diff"] < 1e-4
    assert res["checkpoint"].endswith("tiny-arith" if version == 0 else "step_000002/model")


def test_other_weights_diverge_and_the_report_says_why(run_dir, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(run_dir / "checkpoints" / "step_000002", changed)
    weights = changed / "model" / "model.safetensors"
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(0)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()}, weights,
              metadata={"format": "pt"})
    res = replay(run_dir, "s3-p1-e2", checkpoint=changed)
    recorded = find_episode(run_dir, "s3-p1-e2")
    assert not res.reproduced and res.cause == "weights"
    assert recorded["prompt_len"] <= res.first_divergence <= len(recorded["tokens"])
    assert "these are not the weights that generated the episode" in res.detail
    assert f"diverges at token {res.first_divergence} (weights)" in res.summary()


def test_what_cannot_be_replayed_is_named(run_dir, tmp_path):
    with pytest.raises(ReplayError, match=r"no episode `s9-p0-e0`"):
        replay(run_dir, "s9-p0-e0")
    pruned = tmp_path / "pruned"
    shutil.copytree(run_dir, pruned)
    shutil.rmtree(pruned / "checkpoints" / "step_000002")
    with pytest.raises(ReplayError, match=r"weights version 2, and no checkpoint of the run holds it.*--checkpoint"):
        replay(pruned, "s3-p1-e2")

"""placement.weight_sync=shard in a Ray run: 2 FSDP trainer ranks send their own shards to 2
engine actors by the transfer plan (logged at start), deltas after the first sync; the engines
sample with the trainer's weights (their log-probs match the trainer's within the engine
contract's bound) and the metrics count the bytes of every sync. A replica killed mid-run is
replaced before the next rollout and takes the weights from its live peer
(placement.engine_bootstrap=peer)."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import ray
from engine_checks import LOGPROB_TOL

from tidal.config import load_config
from tidal.runtime.controller import Controller
from tidal.runtime.placement import keep_on_loopback


@pytest.fixture(scope="module")
def ray_local():
    keep_on_loopback()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(_node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.mark.slow  # 45 s here + 10 s starting Ray (2 trainer ranks, 2 engine actors, one killed and replaced)
@pytest.mark.timeout(900)
def test_shard_sync_with_deltas_in_a_ray_run(tmp_path, ray_local, caplog):
    """Also peer bootstrap (placement.engine_bootstrap=peer): replica 1 is killed after step 1;
    before step 2's rollout it is replaced and takes v1 from replica 0 (from the copy the shard
    transport keeps there), the trainer not involved, and serves step 2's rollout with it."""
    caplog.set_level(logging.INFO, logger="tidal")
    cfg = load_config(overrides=[
        f"run.dir={tmp_path / 'run'}", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.steps=3",
        "run.eval_every=0", "run.progress=false", "run.save_every=0", "placement.trainer.num_cpus=0.5",
        "placement.engine.num_cpus=0.5", "placement.call_timeout_s=300", "placement.mode=ray",
        "placement.trainer_ranks=2", "engine.replicas=2", "placement.weight_sync=shard",
        "placement.weight_sync_delta=true", "placement.engine_bootstrap=peer"])
    ctl = Controller(cfg)
    try:
        assert ctl.pusher.describe == "shard"
        steps = [ctl.train_step()]
        os.kill(ctl.pusher.engine_handles[1].call("pid"), signal.SIGKILL)
        ctl.engine.mark_down(1, "killed by the test")  # as the router does when a call to it fails
        served = ctl.engine.served[1]
        steps.append(ctl.train_step())
        assert ctl.engine.served[1] > served  # the new replica sampled some of step 2's episodes
        steps.append(ctl.train_step())
        assert [h.call("engine_version") for h in ctl.pusher.engine_handles] == [3, 3]
        assert ctl.pusher.restarts == 1  # replaced before the rollout, not again at the push
    finally:
        ctl.close()
    assert "weight-sync plan:" in caplog.text and "engine rank 1:" in caplog.text
    assert "engine replica1 took weights v1 from its peer engine replica0" in caplog.text
    assert steps[1]["engines/bootstrapped_from_peer"] == 1 and steps[1]["engines/restarted"] == 0
    full = steps[0]["weight_sync/full_bytes"]
    assert steps[0]["weight_sync/bytes"] == full > 0  # the first sync is full
    assert steps[1]["weight_sync/bytes"] == full  # a new group after the replacement: full again
    assert 0 < steps[2]["weight_sync/bytes"] < full and steps[2]["weight_sync/repaired"] == 0  # then deltas
    for m in steps:  # the engines, the bootstrapped one included, sampled with the trainer's weights of the step before
        assert m["logprob_max_abs_diff"] < LOGPROB_TOL, m

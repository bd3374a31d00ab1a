"""placement.weight_sync=shard in a Ray run: 2 FSDP trainer ranks send their own shards to 2
engine actors by the transfer plan (logged at start), deltas after the first sync; the engines
sample with the trainer's weights (their log-probs match the trainer's within the engine
contract's bound) and the metrics count the bytes of every sync."""

from __future__ import annotations

import json
import logging
import os

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


@pytest.mark.slow  # 93 s here under load (Ray, 2 trainer ranks, 2 engine actors)
@pytest.mark.timeout(900)
def test_shard_sync_with_deltas_in_a_ray_run(tmp_path, ray_local, caplog):
    caplog.set_level(logging.INFO, logger="tidal")
    cfg = load_config(overrides=[
        f"run.dir={tmp_path / 'run'}", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.steps=3",
        "run.eval_every=0", "run.progress=false", "run.save_every=0", "placement.trainer.num_cpus=0.5",
        "placement.engine.num_cpus=0.5", "placement.call_timeout_s=300", "placement.mode=ray",
        "placement.trainer_ranks=2", "engine.replicas=2", "placement.weight_sync=shard",
        "placement.weight_sync_delta=true"])
    ctl = Controller(cfg)
    try:
        assert ctl.pusher.describe == "shard"
        ctl.train()
        assert [h.call("engine_version") for h in ctl.pusher.engine_handles] == [3, 3]
    finally:
        ctl.close()
    assert "weight-sync plan:" in caplog.text and "engine rank 1:" in caplog.text
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    full = steps[0]["weight_sync/full_bytes"]
    assert steps[0]["weight_sync/bytes"] == full > 0  # the first sync is full
    for m in steps[1:]:
        assert 0 < m["weight_sync/bytes"] < full and m["weight_sync/repaired"] == 0  # then deltas
    for m in steps:  # the engines sampled with the trainer's weights of the step before
        assert m["logprob_max_abs_diff"] < LOGPROB_TOL, m

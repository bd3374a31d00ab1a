"""placement.weight_sync=slices under placement.mode=ray: each engine rank receives only its
slices (tidal/weightsync/sliced.py) from trainer rank 0, from a 2-rank FSDP (dp_shard 2)
trainer into torch-engine replicas; a replica whose sync hangs is replaced and re-synced, and
the run goes on. The same into a vLLM-CPU engine of TP 2 from a dp_shard 2 and a tp 2 trainer:
tests/test_vllm_tp.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import ray
from engine_checks import LOGPROB_TOL
from test_placement import config, metrics

from tidal.runtime.controller import Controller
from tidal.runtime.placement import keep_on_loopback

HANG = Path(__file__).with_name("hanging_engine.py")


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    """One Ray instance on loopback for the module; its workers see the hang marker's path."""
    marker = tmp_path_factory.mktemp("hang") / "marker"
    os.environ["TIDAL_TEST_HANG_MARKER"] = str(marker)
    keep_on_loopback()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(_node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False, logging_level=logging.WARNING)
    yield marker
    ray.shutdown()
    os.environ.pop("TIDAL_TEST_HANG_MARKER", None)


@pytest.mark.slow
def test_fsdp_trainer_sends_each_replica_its_slices(tmp_path, ray_local):
    ctl = Controller(config(tmp_path, "placement.mode=ray", "placement.trainer_ranks=2", "engine.replicas=2",
                            "placement.weight_sync=slices", "placement.weight_sync_checksum=true", "train.steps=3"))
    try:
        assert ctl.pusher.describe == "slices"
        ctl.train()
        assert [h.call("engine_version") for h in ctl.pusher.engine_handles] == [3, 3]
        assert [r.version for r in ctl.engine.replicas] == [3, 3]
    finally:
        ctl.close()
    for m in metrics(tmp_path / "run"):  # the engines sampled with the trainer's weights of the step before
        assert m["logprob_max_abs_diff"] < LOGPROB_TOL, m


@pytest.mark.slow
def test_a_replica_whose_sync_hangs_is_replaced_and_resynced(tmp_path, ray_local, caplog):
    ray_local.write_text("hang")
    cfg = config(tmp_path, "placement.mode=ray", "engine.replicas=2", "placement.weight_sync=slices",
                 f"engine.kind={HANG}:build", "placement.call_timeout_s=20", "train.steps=3")
    ctl = Controller(cfg)
    try:
        with caplog.at_level(logging.WARNING, logger="tidal"):
            ctl.train()
        assert not ray_local.exists(), "no replica hung: the test tested nothing"
        text = caplog.text
        assert "the weight sync failed" in text and "`slices_recv` at step 2 did not answer within 20 s" in text
        assert "replaced by a new actor that receives weights v2" in text
        assert all(ctl.engine.up)
        assert [h.call("engine_version") for h in ctl.pusher.engine_handles] == [3, 3]
    finally:
        ctl.close()
    assert [m["episodes"] for m in metrics(tmp_path / "run")] == [16, 16, 16]


@pytest.mark.slow
@pytest.mark.vllm
# `auto` only: the `slices` transport into vLLM TP 2 is checked in process by tests/test_vllm_tp.py and
# on Ray into torch-engine replicas above; one more vLLM-on-Ray start would cost CI ~3 minutes.
@pytest.mark.parametrize("sync", ["auto"])
def test_vllm_tp2_engine_actor_gets_its_slices(tmp_path, ray_local, sync):
    """A vLLM-CPU replica of TP 2 in an engine actor (its two workers are the actor's children)
    gets its slices, checksummed, from a dp_shard 2 trainer: by `auto`, the shard transport (each
    worker an engine rank, pieces from both trainer ranks, no gather); by `slices`, from trainer
    rank 0. Its log-probs agree with the trainer's at every step."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None and not os.environ.get("TIDAL_REQUIRE_VLLM"):
        pytest.skip("vLLM is not installed (`make setup-vllm`)")
    ctl = Controller(config(tmp_path, "placement.mode=ray", "engine.kind=vllm", "engine.tensor_parallel=2",
                            "placement.trainer_ranks=2", f"placement.weight_sync={sync}",
                            "placement.weight_sync_checksum=true"))
    try:
        assert ctl.pusher.describe == ("shard" if sync == "auto" else "slices")
        ctl.train()
        assert ctl.pusher.engine_handles[0].call("engine_version") == 2
    finally:
        ctl.close()
    for m in metrics(tmp_path / "run"):
        assert m["logprob_max_abs_diff"] < LOGPROB_TOL and m["episodes/engine_error"] == 0, m


def test_a_failed_delivery_blames_the_replicas_it_names():
    """Which replicas a failed sync is pinned on: the role that failed, or the receivers a
    trainer's error names (replica1 is not replica10)."""
    from types import SimpleNamespace

    from tidal.runtime.handles import RoleError
    from tidal.runtime.sync import _RemoteSync

    names = [f"engine replica{i}" for i in range(11)]
    sync = SimpleNamespace(router=SimpleNamespace(names=names))
    hung = RoleError("engine replica1", "slices_recv", 2, "timeout", "20 s")
    assert _RemoteSync._blame(sync, hung, list(range(11))) == [1]
    sender = RoleError("trainer rank 0", "push_weights", 2, "raised",
                       "WeightSyncError: weight sync v2 (step 2): sending bucket 2/3 to engine replica10 TP rank 1/2 "
                       "(group 'tidal-slices-1' rank 22): timed out after 600 s")
    assert _RemoteSync._blame(sync, sender, list(range(11))) == [10]
    assert _RemoteSync._blame(sync, RoleError("trainer rank 1", "push_weights", 2, "died", "gone"), [0, 1]) == []

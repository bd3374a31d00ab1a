"""Multi-node: a Ray cluster of two nodes on this machine (loopback), the trainer placed on
one and the engine replicas on the other by custom resources, joined through
`placement.address` exactly as a real cluster is (README, Multi-node)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import ray
from cli_limits import EVAL_TIMEOUT_S, TRAIN_TIMEOUT_S
from ray.cluster_utils import Cluster

from tidal.config import load_config
from tidal.runtime.controller import Controller
from tidal.runtime.placement import keep_on_loopback


@pytest.fixture
def two_nodes():
    keep_on_loopback()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.makedirs("/tmp/ray", exist_ok=True)  # Cluster writes the head's address there before Ray creates it
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"trainer_node": 1}, "include_dashboard": False, "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=2, resources={"engine_node": 1}, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def test_roles_on_different_nodes_train(tmp_path, two_nodes):
    cfg = load_config(overrides=[
        f"run.dir={tmp_path / 'run'}", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.steps=2",
        "run.eval_every=0", "run.progress=false", "run.save_every=0",
        "placement.mode=ray", f"placement.address={two_nodes.address}", "engine.replicas=2",
        "placement.trainer.num_cpus=0.5", "placement.trainer.resources={trainer_node: 0.5}",
        "placement.engine.num_cpus=0.5", "placement.engine.resources={engine_node: 0.25}",
        "placement.weight_sync_checksum=true", "placement.call_timeout_s=120",
    ])
    ctl = Controller(cfg)
    try:
        assert len(ray.nodes()) == 2
        trainer_node = ctl.trainer.ranks[0].call("node")
        engine_nodes = {h.call("node") for h in ctl.pusher.engine_handles}
        head = next(n["NodeID"] for n in ray.nodes() if "trainer_node" in n["Resources"])
        assert trainer_node == head
        assert len(engine_nodes) == 1 and trainer_node not in engine_nodes
        ctl.train()
        assert [h.call("engine_version") for h in ctl.pusher.engine_handles] == [2, 2]  # weights crossed nodes
    finally:
        ctl.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["episodes"] == 16 for r in rows)


@pytest.mark.slow
def test_ray_fsdp_job_reaches_the_local_accuracy(tmp_path):
    """The README's Ray example (2 FSDP ranks over gloo, 2 engine replicas, broadcast sync)
    trains the default task to ≥ 0.9 held-out greedy accuracy, as local mode does."""
    import subprocess
    import sys

    run = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "tidal.cli", "train", str(Path(__file__).parents[1] / "examples/ray/local_fsdp.yaml"), f"run.dir={run}",
                    "run.progress=false"], check=True, timeout=TRAIN_TIMEOUT_S)
    ckpt = max((run / "checkpoints").iterdir())
    out = subprocess.run([sys.executable, "-m", "tidal.cli", "eval", str(ckpt), "--json"], check=True,
                         capture_output=True, text=True, timeout=EVAL_TIMEOUT_S).stdout
    assert json.loads(out.splitlines()[-1])["accuracy"] >= 0.9

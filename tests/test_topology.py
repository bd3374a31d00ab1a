"""Topology: the trainer ranks of one tp × cp × ep group share a node. The layout is a pure
function (fast tests here, tied to the mesh's own notion of a data-parallel position); Ray's
STRICT_PACK groups are checked on a real two-node Ray cluster on loopback (slow): a group that
fits no node is refused naming its ranks and what a node must offer, and one that fits lands
on a single node while plain PACK would spread it."""

from __future__ import annotations

import os

import pytest

from tidal.config import load_config
from tidal.runtime import topology
from tidal.runtime.launcher import warn_split_groups
from tidal.runtime.ranks import LaunchEnv
from tidal.trainer.parallel.mesh import ParallelDims


@pytest.mark.parametrize("ranks, shape", [(8, {"tp": 2}), (8, {"tp": 4}), (8, {"cp": 2, "tp": 2}), (4, {"cp": 2}),
                                          (8, {"dp_replicate": 2, "tp": 2})])
def test_a_group_is_one_data_parallel_position_of_the_mesh(ranks, shape):
    dims = ParallelDims.from_config(load_config(overrides=[
        "placement.mode=ray", f"placement.trainer_ranks={ranks}",
        *(f"train.parallel.{k}={v}" for k, v in shape.items())]).train.parallel, ranks)
    groups = topology.node_groups(ranks, topology.group_size(dims.tp, dims.cp, dims.ep))
    assert sorted(r for g in groups for r in g) == list(range(ranks))
    for g in groups:  # the ranks that exchange activations every layer: one batch shard, consecutive
        assert len({dims.dp_index(r) for r in g}) == 1 and g == list(range(g[0], g[0] + len(g)))
    assert len(groups) == dims.dp_size


def test_plain_fsdp_asks_nothing_and_keeps_the_old_layout():
    strict, rest, slots = topology.bundle_layout(3, 1, {"CPU": 1.0, "GPU": 1.0}, [{"CPU": 2.0}])
    assert strict == [] and rest == [{"CPU": 1.0, "GPU": 1.0}] * 3 + [{"CPU": 2.0}]
    assert slots == [(0, 0), (0, 1), (0, 2)]  # trainer ranks first in the one group, the others after them


def test_tensor_parallel_ranks_get_a_strict_pack_group_each():
    strict, rest, slots = topology.bundle_layout(4, 2, {"GPU": 1.0}, [{"GPU": 1.0, "CPU": 4.0}])
    assert strict == [[{"GPU": 1.0}] * 2] * 2 and rest == [{"GPU": 1.0, "CPU": 4.0}]
    assert slots == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert topology.total(strict[0]) == {"GPU": 2.0}
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        topology.node_groups(6, 4)


def test_a_group_across_nodes_is_named():
    groups = topology.node_groups(4, 2)
    assert topology.split_groups(groups, {0: "a", 1: "a", 2: "a", 3: "b"}) == [
        ("trainer ranks 2-3 form one tensor/expert/context-parallel group but run on 2 nodes (a, b): their per-layer "
         "collectives cross nodes")]
    assert topology.split_groups(groups, {0: "a", 1: "a", 2: "b", 3: "b"}) == []


def test_a_launchers_split_group_is_logged(caplog):
    cfg = load_config(overrides=["placement.mode=launcher", "placement.trainer_ranks=4", "train.parallel.tp=2"])
    env = LaunchEnv("slurm", 0, 4, 0, "10.0.0.1", 30000)
    assert warn_split_groups(cfg, env, {0: "a", 1: "b", 2: "c", 3: "c"}) and "ranks 0-1" in caplog.text
    assert "--ntasks-per-node" in caplog.text
    assert warn_split_groups(cfg, env, {0: "a", 1: "a", 2: "c", 3: "c"}) == []


# -- Ray ----------------------------------------------------------------------------------------
@pytest.fixture
def two_one_cpu_nodes():
    import ray
    from ray.cluster_utils import Cluster

    from tidal.runtime.placement import keep_on_loopback

    keep_on_loopback()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.makedirs("/tmp/ray", exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    cluster.add_node(num_cpus=2, resources={"big": 1}, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
def test_ray_keeps_a_group_on_one_node_or_says_it_cannot(two_one_cpu_nodes):
    import ray
    from ray.util import placement_group_table

    from tidal.runtime.handles import RoleError
    from tidal.runtime.placement import _placement_groups

    class Pl:
        strategy, start_timeout_s = "PACK", 20.0

    def nodes_of(group) -> set[str]:
        return set(placement_group_table(group)["bundles_to_node_id"].values())

    pair = [{"CPU": 1.0}, {"CPU": 1.0}]
    # the group fits only the 2-CPU node: STRICT_PACK puts both ranks there
    (grouped,) = _placement_groups(Pl, [pair], [])
    assert len(nodes_of(grouped)) == 1
    # the control, with the 2-CPU node now full: PACK takes two nodes for the same bundles...
    (spread,) = _placement_groups(Pl, [], pair)
    assert len(nodes_of(spread)) == 2
    # ...and a group that must share a node is refused, naming its ranks and what a node must offer
    Pl.start_timeout_s = 5.0  # nothing frees up: the bound is what the test waits for
    with pytest.raises(RoleError, match=r"trainer ranks 0-1 \(one tp × cp × ep group, kept on one node\) need one "
                                        r"node offering \{'CPU': 2.0\}"):
        _placement_groups(Pl, [pair], [])
    states = [g["state"] for g in ray.util.placement_group_table().values()]
    assert states.count("CREATED") == 2 and states.count("REMOVED") == 1  # the refused group is not left pending

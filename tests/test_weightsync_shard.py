"""Shard-to-shard weight sync (tidal/weightsync/plan.py, shard.py) and delta sync (delta.py).

The plan is checked as data (fast): every engine rank's box of every tensor is covered by
pieces exactly once, each engine rank receives exactly its bytes, a trainer rank never stages
more than a bucket. Then real trainers (dp_shard 2, tp 2; gloo processes on loopback, as
tests/test_parallel.py) sync into two torch engines in their own processes: after a full sync
and after delta syncs the engines' parameters equal the trainer's gathered weights bit for bit,
and a corrupted engine copy is caught by the checksum and repaired by a full round.
"""

from __future__ import annotations

import math
import os
import re
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

from tidal.weightsync import WeightSyncError
from tidal.weightsync.delta import DELTA, FULL, SKIP, DeltaConfig, choose_modes, decode_into, digest, encode
from tidal.weightsync.plan import (
    ParamLayout,
    TransferPlan,
    box_numel,
    build_plan,
    full_box,
    full_slices,
    intersect,
)

MB = 1 << 20


def _sharded(name, shape, ranks, dim=0, dtype="float32"):
    """A parameter split into `ranks` chunks along `dim` (torch.chunk sizes, as DTensor's Shard)."""
    size = shape[dim]
    step = -(-size // ranks)
    owners = []
    for r in range(ranks):
        lo, hi = min(r * step, size), min((r + 1) * step, size)
        if hi > lo:
            box = list(full_box(shape))
            box[dim] = (lo, hi)
            owners.append((r, tuple(box)))
    return ParamLayout(name, tuple(shape), dtype, tuple(owners))


def _layout(ranks=2, dim_of=lambda name: 0):
    shapes = {"embed": (1000, 64), "q": (64, 64), "o": (64, 64), "norm": (64,), "odd": (7, 3)}
    out = {}
    for n, s in shapes.items():
        if n == "norm":  # replicated: every rank holds it whole
            out[n] = ParamLayout(n, s, "float32", tuple((r, full_box(s)) for r in range(ranks)))
        else:
            out[n] = _sharded(n, s, ranks, dim_of(n))
    return out


def _check_cover(plan: TransferPlan):
    for dst, boxes in enumerate(plan.engine_boxes):
        for name, want in boxes.items():
            pieces = [p for m in plan.messages if m.dst == dst for p in m.pieces if p.name == name]
            assert sum(box_numel(p.box) for p in pieces) == box_numel(want), (dst, name)
            assert all(intersect(p.box, want) == p.box for p in pieces)
            assert not any(intersect(a.box, b.box) for i, a in enumerate(pieces) for b in pieces[i + 1:])
            for p in pieces:  # the sender holds what it sends
                assert intersect(p.box, dict(plan.params[name].owners)[p.src]) == p.box


@pytest.mark.parametrize("shape", ["dp_shard2", "tp2_row"])
def test_plan_covers_every_engine_box_once_and_stages_at_most_a_bucket(shape):
    params = _layout(2, (lambda n: 0) if shape == "dp_shard2" else (lambda n: 1 if n == "o" else 0))
    bucket = 20_000  # smaller than the embedding (256 kB): it is split into row blocks
    plan = build_plan(params, full_slices(params, 2), bucket, trainer_ranks=2)
    _check_cover(plan)
    model = sum(math.prod(p.shape) * 4 for p in params.values())
    assert plan.model_bytes() == model
    assert [plan.bytes_to(d) for d in range(2)] == [model, model]  # whole-tensor engines get the whole model
    assert plan.bytes_from(0) + plan.bytes_from(1) == 2 * model
    for src in range(2):  # the bound the transport's staging buffer is sized by
        assert 0 < plan.peak_staging_bytes(src) <= bucket
    assert all(sum(m.nbytes for m in plan.messages if m.dst == d and m.bucket == k) <= bucket
               for d in range(2) for k in range(plan.buckets_of(d)))
    # the replicated norm is sent by one rank per engine, the two engines served by different ranks
    norm_src = {m.dst: m.src for m in plan.messages for p in m.pieces if p.name == "norm"}
    assert sorted(norm_src) == [0, 1] and len(set(norm_src.values())) == 2
    assert TransferPlan.from_json(plan.to_json()) == plan
    assert "engine rank 1" in plan.summary() and "trainer rank 0: sends" in plan.summary()


def test_plan_for_sliced_engines_sends_each_rank_only_its_slice():
    """Tensor-parallel engines (each rank half of every matrix's rows): each receives half the bytes."""
    params = _layout(2, lambda n: 1)  # the trainer splits by columns, the engines by rows
    halves = [{n: ((0, p.shape[0] // 2) if r == 0 else (p.shape[0] // 2, p.shape[0]),) + full_box(p.shape)[1:]
               for n, p in params.items()} for r in range(2)]
    plan = build_plan(params, halves, 1 << 30, trainer_ranks=2)
    _check_cover(plan)
    for d in range(2):
        assert plan.bytes_to(d) == sum(box_numel(b) * 4 for b in halves[d].values())
        assert plan.bytes_to(d) < plan.model_bytes()


def test_plan_refuses_shards_that_do_not_tile():
    bad = {"w": ParamLayout("w", (4, 4), "float32", ((0, ((0, 3), (0, 4))), (1, ((2, 4), (0, 4)))))}
    with pytest.raises(WeightSyncError, match="do not tile"):
        build_plan(bad, full_slices(bad, 1), MB, trainer_ranks=2)
    good = {"w": ParamLayout("w", (4, 4), "float32", ((0, ((0, 2), (0, 4))), (1, ((2, 4), (0, 4)))))}
    with pytest.raises(WeightSyncError, match="engine rank 0 expects"):
        build_plan(good, [{"v": ((0, 1),)}], MB, trainer_ranks=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_delta_is_bit_exact_and_a_wrong_base_is_caught(dtype, codec):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(1000, generator=g).to(dtype)
    new = old.clone()
    new[::7] += 1e-3 * torch.randn(new[::7].shape, generator=g).to(dtype)
    new[3] = float("nan")  # any bit pattern goes through
    ob, nb = old.view(torch.uint8), new.view(torch.uint8)
    payload = encode([nb], [ob], [old.element_size()], codec, 1)
    held = ob.clone()
    decode_into(payload, [held], [old.element_size()], codec)
    assert torch.equal(held, nb) and digest(held) == digest(nb)
    corrupt = ob.clone()
    corrupt[40] ^= 0x10  # the engine's copy differs in one bit: the XOR gives wrong bytes...
    decode_into(payload, [corrupt], [old.element_size()], codec)
    assert not torch.equal(corrupt, nb)
    assert digest(corrupt) != digest(nb)  # ...and the checksum says so


def test_choose_modes():
    on = DeltaConfig(enabled=True, full_every=3)
    # engine 0 holds the base, 1 holds nothing (restarted), 2 an older version, 3 the new one already
    assert choose_modes(5, [4, None, 3, 5], 4, [4, None, 3, 5], on) == [DELTA, FULL, FULL, SKIP]
    assert choose_modes(5, [4], 4, [2], on) == [FULL]  # full_every versions since its last full sync
    assert choose_modes(5, [4], 4, [4], DeltaConfig()) == [FULL]  # off by default
    assert choose_modes(5, [4], 4, [4], None) == [FULL]


# -- real trainers and engines ------------------------------------------------------------------
def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch():
    from tidal.trainer.trainer import TrainBatch

    tokens = [[5, 9, 11, 30, 31, 32], [5, 9, 12, 40, 41], [6, 8, 13, 50, 51, 52, 53], [6, 8, 14, 60]]
    masks = [[False] * 3 + [True] * (len(t) - 3) for t in tokens]
    adv = [[(1.0 if i % 2 else -1.0) if m else 0.0 for m in mk[1:]] for i, mk in enumerate(masks)]
    return TrainBatch(tokens, masks, adv, [[0.0] * len(t) for t in tokens])


def _trainer_side(rank, world, ports, tmp, parallel, steps, bucket):
    from tidal.config import AlgorithmConfig, ParallelConfig, TrainConfig
    from tidal.models import resolve_model_dir
    from tidal.trainer.distributed import balanced_shards, destroy, init_distributed
    from tidal.trainer.trainer import Trainer
    from tidal.weightsync import BroadcastGroup
    from tidal.weightsync.plan import gather_layout
    from tidal.weightsync.shard import ShardSender, share_plan

    init_distributed(rank, world, "127.0.0.1", ports[0], timeout_s=120)
    group = None
    try:
        tr = Trainer(str(resolve_model_dir("default")), TrainConfig(warmup_steps=0, lr=1e-3,
                     parallel=ParallelConfig(**parallel)), AlgorithmConfig(), pad_token_id=0)
        named = dict(tr.model.named_parameters())
        layout = gather_layout(named)
        plan = build_plan(layout, full_slices(layout, 2), bucket, trainer_ranks=world) if rank == 0 else None
        group = BroadcastGroup.join("127.0.0.1", ports[1], rank, world + 2, timeout_s=120, name="shard-test")
        plan = share_plan(group, plan)
        sender = ShardSender(group, plan, DeltaConfig(enabled=True, full_every=100))
        batch = _batch()
        results = []
        for step in range(steps + 1):
            if step:
                shard = balanced_shards([len(t) for t in batch.tokens], tr.dims.dp_size)[tr.dims.dp_index(rank)]
                tr.forward_backward(batch.select(shard), totals=batch.totals())
                tr.optim_step()
            results.append(sender.send(tr.version, dict(tr.model.named_parameters())))
        full = {n: w.clone() for n, w in tr.named_weights().items()}  # gathered here only to check the engines
        if rank == 0:
            torch.save({"plan": plan.to_json(), "results": results, "weights": full}, tmp / "trainer.pt")
    finally:
        if group is not None:
            group.close()
        destroy()


def _engine_side(dst, world, ports, tmp, steps, corrupt_at):
    from tidal.engines.torch_engine import TorchEngine
    from tidal.models import load_model, resolve_model_dir
    from tidal.weightsync import BroadcastGroup
    from tidal.weightsync.shard import ShardReceiver, share_plan

    engine = TorchEngine(load_model(resolve_model_dir("default")), pad_token_id=0)
    group = BroadcastGroup.join("127.0.0.1", ports[1], world + dst, world + 2, timeout_s=120, name="shard-test")
    try:
        recv = ShardReceiver(group, share_plan(group, None))
        results = []
        for step in range(steps + 1):
            if step == corrupt_at and dst == 1:  # the engine's copy of one tensor goes bad between syncs
                recv.held["model.norm.weight"].view(torch.uint8)[0] ^= 0x40
            results.append(recv.recv(engine))
        torch.save({"results": results, "weights": {n: p.detach().clone() for n, p in engine.model.named_parameters()},
                    "version": engine.version}, tmp / f"engine{dst}.pt")
    finally:
        group.close()
        engine.close() if hasattr(engine, "close") else None


def _proc(i, world, ports, tmp, parallel, steps, bucket, corrupt_at):
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    if i < world:
        _trainer_side(i, world, ports, tmp, parallel, steps, bucket)
    else:
        _engine_side(i - world, world, ports, tmp, steps, corrupt_at)


@pytest.mark.slow  # 75-113 s a shape on this shared 2-core machine under load (4 processes, each loading torch)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("parallel", [{"dp_shard": 2}, {"tp": 2}], ids=["dp_shard2", "tp2"])
def test_sharded_trainer_syncs_torch_engines_bit_for_bit(parallel, tmp_path):
    steps, bucket, corrupt_at = 3, 256 << 10, 2
    mp.spawn(_proc, args=(2, (_free_port(), _free_port()), tmp_path, parallel, steps, bucket, corrupt_at),
             nprocs=4, join=True)
    tr = torch.load(tmp_path / "trainer.pt", weights_only=False)
    plan = TransferPlan.from_json(tr["plan"])
    for src in range(2):
        assert plan.peak_staging_bytes(src) <= bucket  # no trainer rank holds more than a bucket beyond its shards
        assert plan.bytes_from(src) > 0  # both ranks send: nobody gathers the model
    modes = [r["modes"] for r in tr["results"]]
    assert modes[0] == [FULL, FULL] and all(m == [DELTA, DELTA] for m in modes[1:])
    for dst in range(2):
        eng = torch.load(tmp_path / f"engine{dst}.pt", weights_only=False)
        assert eng["version"] == steps
        assert eng["weights"].keys() == tr["weights"].keys()
        for n, w in tr["weights"].items():  # the engine's bytes are the trainer's
            assert torch.equal(eng["weights"][n].view(torch.uint8), w.contiguous().view(torch.uint8)), (dst, n)
        res = eng["results"]
        assert res[0]["bytes"] == plan.bytes_to(dst) == plan.model_bytes()
        assert all(r["bytes"] < r["raw_bytes"] for r in res[1:] if not r["mismatched"])  # deltas are smaller
        assert res[corrupt_at]["mismatched"] == (["model.norm.weight"] if dst == 1 else [])
    assert tr["results"][corrupt_at]["repaired"] and not tr["results"][corrupt_at - 1]["repaired"]


@pytest.mark.parametrize("overrides, says", [
    (["placement.weight_sync_delta=true"], "placement.weight_sync_delta needs placement.weight_sync=shard"),
    (["placement.weight_sync=shard"], "placement.weight_sync=shard needs placement.mode=ray"),
    (["placement.mode=ray", "placement.weight_sync=shard", "placement.colocate=true"], "colocated engines"),
])
def test_bad_shard_or_delta_settings_name_the_key(overrides, says):
    from tidal.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=says):
        load_config(None, overrides)
    ok = load_config(None, ["placement.mode=ray", "placement.weight_sync=shard", "placement.weight_sync_delta=true"])
    assert ok.placement.weight_sync_delta.enabled and ok.placement.weight_sync_delta.full_every == 20


@pytest.mark.parametrize("engine_tp", [1, 2])
def test_the_simulators_bytes_model_is_the_plans(engine_tp):
    """tidal/plan/sync_model.py's `expected_bytes` (written out there so `tidal plan` needs no torch)
    gives what build_plan gives: 2 trainer ranks sharding rows, one engine replica of engine_tp
    ranks each holding its share of the rows."""
    from tidal.plan.sync_model import expected_bytes

    params = {n: p for n, p in _layout(2).items() if n not in ("odd", "norm")}  # evenly divisible, all sharded
    slices = [{n: ((r * p.shape[0] // engine_tp, (r + 1) * p.shape[0] // engine_tp),) + full_box(p.shape)[1:]
               for n, p in params.items()} for r in range(engine_tp)]
    plan = build_plan(params, slices, MB, trainer_ranks=2)
    want = expected_bytes(plan.model_bytes(), 2, engine_tp, "shard")
    assert [plan.bytes_to(d) for d in range(engine_tp)] == [want.per_engine_rank] * engine_tp
    assert [plan.bytes_from(s) for s in range(2)] == [want.per_trainer_rank] * 2 and want.gathered == 0
    assert expected_bytes(100.0, 2, engine_tp, "delta", 0.25).per_engine_rank == want.per_engine_rank / plan.model_bytes() * 25
    today = expected_bytes(100.0, 2, engine_tp, "broadcast")  # every engine rank gets everything, after a gather
    assert today.per_engine_rank == 100.0 and today.gathered == 50.0


def test_tensor_parallel_engine_slices_become_boxes():
    """The slices of a TP engine (slices.py's `Slice(dim, start, stop)` or None for whole) plug into
    the plan: rank r gets its range, an empty range (a padded vocabulary's last rank) no box."""
    from collections import namedtuple

    from tidal.weightsync.plan import boxes_from_slices

    Slice = namedtuple("Slice", "dim start stop")
    params = _layout(2)
    shapes = {n: p.shape for n, p in params.items()}
    slices = [{"embed": Slice(0, 0, 1000), "q": Slice(0, 0, 32), "o": Slice(1, 0, 32), "norm": None, "odd": None},
              {"embed": Slice(0, 1000, 1000), "q": Slice(0, 32, 64), "o": Slice(1, 32, 64), "norm": None, "odd": None}]
    boxes = boxes_from_slices(slices, shapes)
    assert boxes[0]["o"] == ((0, 64), (0, 32)) and boxes[1]["q"] == ((32, 64), (0, 64))
    assert "embed" not in boxes[1] and boxes[1]["norm"] == full_box((64,))
    plan = build_plan(params, boxes, 50_000, trainer_ranks=2)
    _check_cover(plan)
    assert plan.bytes_to(1) == (32 * 64 * 2 + 64 + 21) * 4  # q and o halves, norm, odd: no embedding


def test_tp_engine_boxes_of_the_default_model_are_its_vllm_slices():
    """`tp_engine_boxes` (the shard plan's engines at TP 2) gives each rank exactly its
    `engine_slices`, and `box_slice` turns a box back into that slice (what a vLLM worker hands
    its loaders); the tied head is not planned (a vLLM rank loads it from its embedding slice)."""
    import json

    from tidal.models import DEFAULT_MODEL_DIR, load_model
    from tidal.weightsync.plan import box_slice, tp_engine_boxes
    from tidal.weightsync.slices import engine_slices

    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    shapes = {n: tuple(p.shape) for n, p in load_model(DEFAULT_MODEL_DIR).named_parameters()}
    boxes = tp_engine_boxes(cfg, shapes, 2, replicas=2)
    want = engine_slices(cfg, shapes, 2)
    assert len(boxes) == 4 and boxes[2] == boxes[0] and "lm_head.weight" not in boxes[0]
    for r in range(2):
        for n, b in boxes[r].items():
            assert box_slice(b, shapes[n]) == want[r][n], (r, n)
    assert any(s is not None for s in want[0].values())  # the check compares real cuts, not only whole tensors
    with pytest.raises(ValueError, match="not one slice"):
        box_slice(((0, 2), (1, 3)), (4, 4))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("silent", ["engine", "trainer"])
def test_a_hung_shard_sync_times_out_naming_rank_and_version(silent):
    """One side never takes part in the sync: the other's call ends within the group's timeout
    with a WeightSyncError naming the engine rank and the version, not a hang."""
    import threading

    from tidal.engines.served import free_port
    from tidal.weightsync import BroadcastGroup
    from tidal.weightsync.shard import ShardReceiver, ShardSender, share_plan

    params = {n: p for n, p in _layout(1).items()}
    plan = build_plan(params, full_slices(params, 1), MB, trainer_ranks=1)
    named = {n: torch.ones(p.shape) for n, p in params.items()}
    port, out = free_port(), {}

    def engine_side():
        g = BroadcastGroup.join("127.0.0.1", port, 1, 2, timeout_s=3, name="hung")
        recv = ShardReceiver(g, share_plan(g, None))
        if silent != "engine":
            try:
                recv.recv()
            except WeightSyncError as e:
                out["error"] = str(e)
        out["group"] = g

    t = threading.Thread(target=engine_side)
    t.start()
    g = BroadcastGroup.join("127.0.0.1", port, 0, 2, timeout_s=3, name="hung")
    share_plan(g, plan)
    try:
        if silent == "engine":
            with pytest.raises(WeightSyncError, match=r"(engine rank 0|round 0).*v1.*timed out after 3 s"):
                ShardSender(g, plan).send(1, named)
        else:
            t.join(timeout=60)
            assert re.search(r"round 0 of the next version.*timed out after 3 s", out["error"]), out["error"]
    finally:
        t.join(timeout=60)
        g.close()
        out["group"].close()


def _boxes_worker(rank, world, port, tmp, parallel):
    from torch.distributed.tensor import DTensor

    from tidal.config import AlgorithmConfig, ParallelConfig, TrainConfig
    from tidal.models import resolve_model_dir
    from tidal.trainer.distributed import destroy, init_distributed
    from tidal.trainer.trainer import Trainer
    from tidal.weightsync.plan import gather_layout, relative

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    init_distributed(rank, world, "127.0.0.1", port, timeout_s=120)
    try:
        tr = Trainer(str(resolve_model_dir("default")), TrainConfig(parallel=ParallelConfig(**parallel)),
                     AlgorithmConfig(), pad_token_id=0)
        named = dict(tr.model.named_parameters())
        layout = gather_layout(named)
        full = tr.named_weights()
        strided = 0
        for name, t in named.items():
            box = dict(layout[name].owners)[rank]
            local = t.to_local() if isinstance(t, DTensor) else t
            assert torch.equal(local.detach(), full[name][relative(box, full_box(t.shape))]), (rank, name, box)
            strided += isinstance(t, DTensor) and "StridedShard" in str(t.placements)
        build_plan(layout, full_slices(layout, 1), MB, trainer_ranks=world)  # the boxes tile every tensor
        if rank == 0:
            torch.save({"strided": strided, "owners": {n: p.owners for n, p in layout.items()}}, tmp / "boxes.pt")
    finally:
        destroy()


@pytest.mark.slow  # 57 s here (4 gloo processes loading the trainer)
@pytest.mark.timeout(600)
def test_boxes_of_fsdp_over_tensor_parallel_shards_are_the_shards(tmp_path):
    """At dp_shard 2 x tp 2 FSDP2 shards the tp shards again (strided placements): every rank's box,
    read from its DTensor, selects exactly its local shard from the gathered tensor."""
    parallel = {"dp_shard": 2, "tp": 2}
    mp.spawn(_boxes_worker, args=(4, _free_port(), tmp_path, parallel), nprocs=4, join=True)
    out = torch.load(tmp_path / "boxes.pt", weights_only=False)
    assert out["strided"] > 0  # the case the test is for: FSDP2 over tp's dim-0 shards
    assert max(len({b for _, b in owners}) for owners in out["owners"].values()) == 4

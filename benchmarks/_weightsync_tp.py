"""Weight sync into a tensor-parallel engine, 2 trainer ranks x one engine replica of TP 2
(`benchmarks/weightsync.py --tp`): today's `slices` path against the shard transport planned
with each TP rank's slices, side by side.

Four processes on 127.0.0.1, one thread each: trainer ranks 0 and 1 hold half of every tensor
of the 100M model (its rows, as FSDP2 at dp_shard 2; benchmarks/_weightsync_ranks.py's layout),
engine ranks 0 and 1 are the TP ranks of one replica, each holding vLLM's slices of every
tensor (`engine_slices`). Every repetition times, on trainer rank 0's clock from a barrier to a
barrier after every rank is done:
  raw p2p   each trainer rank sends each engine rank the shard plan's bytes from it as one flat
            buffer (the same bytes as `shard`, with no plan, packing or checksums);
  slices    placement.weight_sync=slices: every tensor all-gathered on both trainer ranks
            (`named_weights()`), then trainer rank 0 `send_slices` to both engine ranks (with the
            tied lm_head.weight added, as the run sends vLLM) / `recv_slices`;
  shard     `ShardSender` on both trainer ranks / `ShardReceiver` on both engine ranks, by the plan
            built with the engine ranks' slices (`plan.tp_engine_boxes`): no gather.
Engines only receive here (nothing loads into vLLM): the transports are compared, not vLLM's
loaders, which both paths call the same way.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from _weightsync_ranks import HOST, gather_full, halves, layout, spawn, start, timed, timing

METHODS = ("raw_p2p", "slices", "shard")


def _worker(i: int, ports: tuple[int, int, int], reps: int, bucket: int, out_path: str) -> None:
    from weightsync import build_model

    from tidal.weightsync import BroadcastGroup
    from tidal.weightsync.plan import build_plan, tp_engine_boxes
    from tidal.weightsync.shard import ShardReceiver, ShardSender
    from tidal.weightsync.sliced import recv_slices, replica_targets, send_slices

    trainers = start(i, ports[0])
    trainer = i < 2
    model = build_model("100m", random_init=trainer)
    hf = model.config.to_dict()
    lay = layout(model)
    shapes = {n: p.shape for n, p in lay.items()}
    plan = build_plan(lay, tp_engine_boxes(hf, shapes, 2), bucket, trainer_ranks=2)
    mine = halves(model, i) if trainer else None
    del model
    sgroup = BroadcastGroup.join(HOST, ports[1], i, 4, timeout_s=600, name="bench-tp-s")
    lgroup = BroadcastGroup.join(HOST, ports[2], {0: 0, 2: 1, 3: 2}[i], 3, timeout_s=600, name="bench-tp-l") \
        if i != 1 else None
    shard = ShardSender(sgroup, plan) if trainer else ShardReceiver(sgroup, plan)
    flat = {d: torch.zeros(sum(m.nbytes for m in plan.messages if m.src == i and m.dst == d), dtype=torch.uint8)
            for d in range(2)} if trainer else None

    def run(method: str, version: int) -> float:
        if method == "raw_p2p":
            if trainer:
                for d in range(2):
                    dist.send(flat[d], 2 + d)
                return 0
            sizes = [sum(m.nbytes for m in plan.messages if m.src == s and m.dst == i - 2) for s in (0, 1)]
            works = [dist.irecv(torch.empty(k, dtype=torch.uint8), s) for s, k in zip((0, 1), sizes)]
            for w in works:
                w.wait()
            return sum(sizes)
        if method == "slices":
            if not trainer:
                return recv_slices(lgroup, lambda header, parts: None, f"bench TP rank {i - 2}/2")["bytes"]
            full = gather_full(mine, trainers)
            if i == 0:
                tensors, targets, roles = replica_targets(hf, full, 2, ["bench"], served=True)
                send_slices(lgroup, version, tensors, targets, bucket_bytes=bucket, roles=roles)
            return 0
        return (shard.send(version, mine) if trainer else shard.recv())["bytes"]

    times, got = timed(reps, METHODS, run)
    if i in (0, 2, 3):
        torch.save({"times": times, "bytes": got, "model_bytes": plan.model_bytes(), "plan": plan.summary(),
                    "stage": [plan.peak_staging_bytes(s) for s in (0, 1)]}, f"{out_path}.{i}")
    sgroup.close()
    if lgroup is not None:
        lgroup.close()
    dist.destroy_process_group()


def bench_tp(reps: int, bucket: int) -> dict:
    t0, *e = spawn(_worker, reps, bucket, (0, 2, 3), "tidal-bench-wstp-")
    out = {"model_bytes": t0["model_bytes"], "plan": t0["plan"], "reps": reps, "bucket_bytes": bucket,
           "trainer_stage_bytes": t0["stage"]}
    for m in METHODS:
        out[m] = {**timing(t0["times"], m, ("raw_p2p", "slices")),
                  "bytes_per_engine_rank": [statistics.median(x["bytes"][m]) for x in e]}
    return out


def tp_table(r: dict) -> str:
    rows = ["| method | bytes received per engine rank (TP 0, TP 1) | time per sync | × raw p2p | × slices |",
            "| --- | --- | --- | --- | --- |"]
    for m in METHODS:
        x = r[m]
        per = ", ".join(f"{b / 1e6:.1f}" for b in x["bytes_per_engine_rank"])
        rows.append(f"| {m.replace('_', ' ')} | {per} MB | {x['median_s'] * 1e3:.0f} ms | "
                    f"{x['ratio_to_raw_p2p']:.2f}× | {x['ratio_to_slices']:.2f}× |")
    return "\n".join(rows)

"""Weight sync into a tensor-parallel engine, 2 trainer ranks x one engine replica of TP 2
(`benchmarks/weightsync.py --tp`): today's `slices` path against the shard transport planned
with each TP rank's slices, side by side.

Four processes on 127.0.0.1, one thread each: trainer ranks 0 and 1 hold half of every tensor
of the 100M model (its rows, as FSDP2 at dp_shard 2; benchmarks/_weightsync_scale.py's layout),
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

import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
METHODS = ("raw_p2p", "slices", "shard")


def _worker(i: int, ports: tuple[int, int, int], reps: int, bucket: int, out_path: str) -> None:
    from _weightsync_scale import _halves, _layout
    from weightsync import build_model

    from tidal.weightsync import BroadcastGroup
    from tidal.weightsync.plan import build_plan, tp_engine_boxes
    from tidal.weightsync.shard import ShardReceiver, ShardSender
    from tidal.weightsync.sliced import recv_slices, replica_targets, send_slices

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{ports[0]}", rank=i, world_size=4,
                            timeout=datetime.timedelta(seconds=600))
    trainers = dist.new_group([0, 1])
    trainer = i < 2
    model = build_model("100m", random_init=trainer)
    hf = model.config.to_dict()
    layout = _layout(model)
    shapes = {n: p.shape for n, p in layout.items()}
    plan = build_plan(layout, tp_engine_boxes(hf, shapes, 2), bucket, trainer_ranks=2)
    mine = _halves(model, i) if trainer else None
    del model
    sgroup = BroadcastGroup.join(HOST, ports[1], i, 4, timeout_s=600, name="bench-tp-s")
    lgroup = BroadcastGroup.join(HOST, ports[2], {0: 0, 2: 1, 3: 2}[i], 3, timeout_s=600, name="bench-tp-l") \
        if i != 1 else None
    shard = ShardSender(sgroup, plan) if trainer else ShardReceiver(sgroup, plan)
    flat = {d: torch.zeros(sum(m.nbytes for m in plan.messages if m.src == i and m.dst == d), dtype=torch.uint8)
            for d in range(2)} if trainer else None
    times = {m: [] for m in METHODS}
    got = {m: [] for m in METHODS}
    for rep in range(reps + 1):  # repetition 0 warms up
        for method in METHODS:
            dist.barrier()
            t0 = time.perf_counter()
            n = 0
            if method == "raw_p2p":
                if trainer:
                    for d in range(2):
                        dist.send(flat[d], 2 + d)
                else:
                    sizes = [sum(m.nbytes for m in plan.messages if m.src == s and m.dst == i - 2) for s in (0, 1)]
                    works = [dist.irecv(torch.empty(k, dtype=torch.uint8), s) for s, k in zip((0, 1), sizes)]
                    for w in works:
                        w.wait()
                    n = sum(sizes)
            elif method == "slices":
                if trainer:
                    full = {}
                    for name, t in mine.items():
                        parts = [torch.empty_like(t) for _ in range(2)]
                        dist.all_gather(parts, t, group=trainers)
                        full[name] = torch.cat(parts)
                    if i == 0:
                        tensors, targets, roles = replica_targets(hf, full, 2, ["bench"], served=True)
                        send_slices(lgroup, rep + 1, tensors, targets, bucket_bytes=bucket, roles=roles)
                    del full
                else:
                    n = recv_slices(lgroup, lambda header, parts: None, f"bench TP rank {i - 2}/2")["bytes"]
            else:
                r = shard.send(rep + 1, mine) if trainer else shard.recv()
                n = r["bytes"]
            dist.barrier()
            if rep:
                times[method].append(time.perf_counter() - t0)
                got[method].append(n)
    if i in (0, 2, 3):
        torch.save({"times": times, "bytes": got, "model_bytes": plan.model_bytes(), "plan": plan.summary(),
                    "stage": [plan.peak_staging_bytes(s) for s in (0, 1)]}, f"{out_path}.{i}")
    sgroup.close()
    if lgroup is not None:
        lgroup.close()
    dist.destroy_process_group()


def bench_tp(reps: int, bucket: int) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    from tidal.engines.served import free_port

    with tempfile.TemporaryDirectory(prefix="tidal-bench-wstp-") as d:
        path = os.path.join(d, "out")
        mp.spawn(_worker, args=((free_port(), free_port(), free_port()), reps, bucket, path), nprocs=4, join=True)
        t0, e = torch.load(f"{path}.0"), [torch.load(f"{path}.{k}") for k in (2, 3)]
    times = t0["times"]
    out = {"model_bytes": t0["model_bytes"], "plan": t0["plan"], "reps": reps, "bucket_bytes": bucket,
           "trainer_stage_bytes": t0["stage"]}
    for m in METHODS:
        out[m] = {"median_s": statistics.median(times[m]), "all_s": times[m],
                  "ratio_to_raw_p2p": statistics.median(t / r for t, r in zip(times[m], times["raw_p2p"])),
                  "ratio_to_slices": statistics.median(t / r for t, r in zip(times[m], times["slices"])),
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

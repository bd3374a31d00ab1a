"""Weight sync at scale, 2 trainer ranks x 2 engine ranks (`benchmarks/weightsync.py --scale`), and
the delta's share of the bytes on the default job (`--delta-job STEPS`).

Four processes on 127.0.0.1, one thread each: trainer ranks 0 and 1 each hold half of every
tensor of the 100M model (its rows, `torch.chunk` along dim 0: the boxes FSDP2 gives them at
dp_shard 2), engine ranks 0 and 1 each hold whole tensors (torch engine / vLLM TP 1). A
default gloo group of the four gives barriers and the trainer ranks' all-gather; the
transports get their own groups. Every repetition times, on trainer rank 0's clock from a
barrier to a barrier after every rank is done:
  raw broadcast  one broadcast of a flat buffer of the model's bytes, trainer rank 0 -> both engines;
  broadcast      today's path: every tensor all-gathered on both trainer ranks (as `named_weights()`
                 does), then `send_weights` from trainer rank 0 / `recv_weights` on the engines;
  raw p2p        each trainer rank sends its half as one flat buffer to each engine rank;
  shard          `ShardSender.send` / `ShardReceiver.recv` by the transfer plan, full bytes;
  delta          the same with delta sync on, after a synthetic optimizer step (outside the timing):
                 every value moves by lr = 1e-6 times the sign of a random number, Adam's first
                 steps' update, so every float32 value changes in its low bits.

The default job's deltas: `tidal train`'s default job runs STEPS steps in this process (local
mode); after every step the trainer's weights (float32) and their bfloat16 cast (what a bf16
engine holds) are compared with the previous version's: the share of elements that changed,
what sparse indices + values would send (4-byte index + the value), and what XOR + byte shuffle
+ zstd level 1 / lz4 send, each as a fraction of the full bytes.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from _weightsync_ranks import HOST, gather_full, halves, layout, spawn, start, timed, timing

METHODS = ("raw_broadcast", "broadcast", "raw_p2p", "shard", "delta")


def _worker(i: int, ports: tuple[int, int, int], reps: int, bucket: int, out_path: str) -> None:
    from weightsync import build_model

    from tidal.weightsync import BroadcastGroup, recv_weights, send_weights
    from tidal.weightsync.delta import DeltaConfig
    from tidal.weightsync.plan import build_plan, full_slices
    from tidal.weightsync.shard import ShardReceiver, ShardSender

    trainers = start(i, ports[0])
    trainer = i < 2
    model = build_model("100m", random_init=trainer)
    lay = layout(model)
    plan = build_plan(lay, full_slices(lay, 2), bucket, trainer_ranks=2)
    nbytes = plan.model_bytes()
    mine = halves(model, i) if trainer else None
    if trainer:
        del model
    bcast = BroadcastGroup.join(HOST, ports[1], {0: 0, 2: 1, 3: 2}[i], 3, timeout_s=600, name="bench-b") \
        if i != 1 else None
    sgroup = BroadcastGroup.join(HOST, ports[2], i, 4, timeout_s=600, name="bench-s")
    shard = ShardSender(sgroup, plan) if trainer else ShardReceiver(sgroup, plan)
    delta = ShardSender(sgroup, plan, DeltaConfig(enabled=True, full_every=1000)) if trainer \
        else ShardReceiver(sgroup, plan)
    raw = torch.zeros(nbytes, dtype=torch.uint8)
    half = torch.zeros(plan.bytes_from(0) // 2, dtype=torch.uint8)
    g = torch.Generator().manual_seed(i)

    def step(rep: int) -> None:  # the synthetic optimizer step the delta sends (untimed)
        if trainer:
            for t in mine.values():
                t.add_(torch.randn(t.shape, generator=g).sign_().mul_(1e-6))

    def run(method: str, version: int) -> float:
        if method == "raw_broadcast":
            if bcast is not None:
                bcast.broadcast(raw, "the raw buffer")
            return nbytes
        if method == "broadcast":
            if trainer:
                full = gather_full(mine, trainers)
                if i == 0:
                    send_weights(bcast, version, full, bucket_bytes=bucket)
                del full
            else:
                recv_weights(bcast)
            return nbytes
        if method == "raw_p2p":
            if trainer:
                for dst in (2, 3):
                    dist.send(half, dst)
            else:
                works = [dist.irecv(torch.empty_like(half), src) for src in (0, 1)]
                for w in works:
                    w.wait()
            return 2 * half.numel()
        side = shard if method == "shard" else delta
        return (side.send(version, mine) if trainer else side.recv())["bytes"]

    times, got = timed(reps, METHODS, run, before=step)  # repetition 0 also gives the delta pair its base
    if i in (0, 2):  # trainer rank 0 has the times; engine rank 0 the bytes it received
        torch.save({"times": times, "bytes": got, "model_bytes": nbytes, "plan": plan.summary()}, f"{out_path}.{i}")
    sgroup.close()
    if bcast is not None:
        bcast.close()
    dist.destroy_process_group()


def bench_scale(reps: int, bucket: int) -> dict:
    t0, e0 = spawn(_worker, reps, bucket, (0, 2), "tidal-bench-ws-")
    out = {"model_bytes": t0["model_bytes"], "plan": t0["plan"], "reps": reps, "bucket_bytes": bucket}
    for m in METHODS:
        out[m] = {**timing(t0["times"], m, ("raw_broadcast", "raw_p2p")),
                  "bytes_per_engine_rank": statistics.median(e0["bytes"][m])}
    return out


def scale_table(r: dict) -> str:
    rows = ["| method | bytes received per engine rank | time per sync | × raw broadcast | × raw p2p |",
            "| --- | --- | --- | --- | --- |"]
    for m in METHODS:
        x = r[m]
        rows.append(f"| {m.replace('_', ' ')} | {x['bytes_per_engine_rank'] / 1e6:.1f} MB | {x['median_s'] * 1e3:.0f} ms | "
                    f"{x['ratio_to_raw_broadcast']:.2f}× | {x['ratio_to_raw_p2p']:.2f}× |")
    return "\n".join(rows)


def delta_job(steps: int) -> dict:
    """Per step of the default job, the delta's fraction of the full bytes (module docstring)."""
    import tempfile

    from tidal.config import load_config
    from tidal.runtime.controller import Controller
    from tidal.weightsync.delta import changed_fraction, encode

    def as_u8(t):
        return t.detach().contiguous().view(torch.uint8).reshape(-1)

    with tempfile.TemporaryDirectory(prefix="tidal-bench-delta-") as d:
        cfg = load_config(None, [f"run.dir={d}/run", f"train.steps={steps}", "run.progress=false", "run.eval_every=0",
                                 "run.save_every=0", "run.write_episodes=false"])
        ctl = Controller(cfg)
        try:
            prev = {n: t.detach().clone() for n, t in ctl.trainer.named_weights().items()}
            rows = []
            for _ in range(steps):
                ctl.train_step()
                cur = {n: t.detach().clone() for n, t in ctl.trainer.named_weights().items()}
                row = {}
                for dtype in (torch.float32, torch.bfloat16):
                    new = {n: t.to(dtype) for n, t in cur.items()}
                    old = {n: t.to(dtype) for n, t in prev.items()}
                    full = sum(t.numel() * t.element_size() for t in new.values())
                    changed = sum(changed_fraction(new[n], old[n]) * new[n].numel() for n in new)
                    numel = sum(t.numel() for t in new.values())
                    size = dtype.itemsize
                    r = {"changed": changed / numel, "sparse": changed * (4 + size) / full}
                    for codec in ("zstd", "lz4"):
                        t0 = time.perf_counter()
                        nb = sum(len(encode([as_u8(new[n])], [as_u8(old[n])], [size], codec, 1 if codec == "zstd" else 0))
                                 for n in new)
                        r[codec] = nb / full
                        r[f"{codec}_MBps"] = full / (time.perf_counter() - t0) / 1e6
                    nb = sum(len(encode([as_u8(new[n])], [as_u8(old[n])], [1], "zstd", 1)) for n in new)
                    r["zstd_unshuffled"] = nb / full
                    row[str(dtype).removeprefix("torch.")] = r
                rows.append(row)
                prev = cur
        finally:
            ctl.close()
    out = {"steps": steps, "per_step": rows}
    for dt in ("float32", "bfloat16"):
        out[dt] = {k: statistics.median(r[dt][k] for r in rows) for k in rows[0][dt]}
    return out


def delta_table(r: dict) -> str:
    head = ("| weights | elements changed | sparse (index + value) | XOR + shuffle + zstd-1 | XOR + zstd-1, one plane "
            "| XOR + shuffle + lz4 |")
    rows = [head, "| --- | --- | --- | --- | --- | --- |"]
    for dt in ("float32", "bfloat16"):
        x = r[dt]
        rows.append(f"| {dt} | {x['changed']:.1%} | {x['sparse']:.1%} | {x['zstd']:.1%} ({x['zstd_MBps']:.0f} MB/s) | "
                    f"{x['zstd_unshuffled']:.1%} | {x['lz4']:.1%} ({x['lz4_MBps']:.0f} MB/s) |")
    return "\n".join(rows)

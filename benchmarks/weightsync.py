"""Weight-sync cost against a raw torch.distributed broadcast of the same bytes, side by side.

    python benchmarks/weightsync.py [--reps 5] [--receivers 1,2] [--models tiny,100m]
                                    [--out benchmarks/results/weightsync.json]
    python benchmarks/weightsync.py --scale [--reps 5] [--delta-job 10] [--out ...]
    python benchmarks/weightsync.py --tp [--reps 5] [--out ...]

`--scale`: full broadcast, shard-to-shard and delta sync of the 100M model from 2 trainer ranks
to 2 engine ranks, and (`--delta-job STEPS`) the delta's share of the bytes on the default job
in float32 and bfloat16 (benchmarks/_weightsync_scale.py says how each is timed).

`--tp`: the 100M model from 2 trainer ranks into one engine replica of TP 2, by `slices`
(gather, rank 0 sends each TP rank its slices) and by the shard transport planned with each TP
rank's slices (benchmarks/_weightsync_tp.py).

Models: `tiny`, the shipped 1M default; `100m`, a ~100M-parameter Qwen2 (hidden 768,
12 layers, vocabulary 32000, tied embeddings) built from its config with random weights.
The weights move as float32, as the trainer's `named_weights()` gives them.

The benchmark process is rank 0 (the trainer's side) of a gloo group on 127.0.0.1; it
spawns the receivers (the engines' side). Each process uses one thread. Every repetition
times, on rank 0's clock from a barrier to a barrier after the last receiver is done:
  raw        one `broadcast` of a preallocated flat buffer of the same total bytes;
  transport  `send_weights` / `recv_weights` (header, pack, broadcast per bucket, unpack);
  +checksum  the same with `with_checksum=True` (SHA-256 on both sides);
  engine     `send_weights` / `receive_into` a TorchEngine (copy into its parameters);
and rank 0 alone times `DiskSync` write + `load_into` a TorchEngine (no checksum) of the
same tensors, in a temporary directory (page cache, no fsync; its ratio is to the median raw
broadcast with one receiver).
Medians over `--reps` repetitions (after one warm-up) are reported; a ratio to raw is the
median of the per-repetition ratios, which a shared, noisy machine disturbs less.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tidal.engines.served import free_port
from tidal.engines.torch_engine import TorchEngine
from tidal.weightsync import BroadcastGroup, DiskSync, receive_into, recv_weights, send_weights

HOST = "127.0.0.1"
METHODS = ("raw", "transport", "checksum", "engine")


def build_model(kind: str, random_init: bool = True):
    """The model of `kind`; `random_init=False` leaves a 100m model's memory uninitialised
    (a receiver overwrites it anyway, and initialising 100M parameters takes seconds)."""
    if kind == "tiny":
        from tidal.models import load_model, resolve_model_dir

        return load_model(resolve_model_dir("default"))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=True)
    if random_init:
        torch.manual_seed(0)
        return Qwen2ForCausalLM(cfg)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives lm_head its own storage: tie it again
    return model


def _rank_loop(group: BroadcastGroup, engine, nbytes: int, reps: int, tensors=None, progress=None) -> dict:
    """Both sides of every measurement; rank 0 (tensors given) returns its timings."""
    send = group.rank == 0
    raw = torch.zeros(nbytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for rep in range(reps + 1):  # repetition 0 warms up
        for method in METHODS:
            group.barrier()
            t0 = time.perf_counter()
            if method == "raw":
                group.broadcast(raw, "the raw buffer")
            elif send:
                send_weights(group, rep, tensors, with_checksum=method == "checksum")
            elif method == "engine":
                receive_into(engine, group)
            else:
                recv_weights(group)
            group.barrier()
            if rep:
                times[method].append(time.perf_counter() - t0)
        if progress:
            progress(rep)
    return times


def _receiver(kind: str, port: int, rank: int, world: int, nbytes: int, reps: int) -> None:
    torch.set_num_threads(1)
    engine = TorchEngine(build_model(kind, random_init=False), pad_token_id=0)
    group = BroadcastGroup.join(HOST, port, rank, world, timeout_s=600, name="bench")
    try:
        _rank_loop(group, engine, nbytes, reps)
    finally:
        group.close()


def summarize(times: list[float], raw: list[float], nbytes: int) -> dict:
    med = statistics.median(times)
    return {"median_s": med, "bytes_per_s": nbytes / med, "all_s": times,
            "ratio_to_raw": statistics.median(t / r for t, r in zip(times, raw))}


def bench(kind: str, model, receivers: int, reps: int) -> dict:
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    world, port = receivers + 1, free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_receiver, args=(kind, port, r, world, nbytes, reps), daemon=True)
             for r in range(1, world)]
    for p in procs:
        p.start()
    label = f"{kind} × {receivers} receiver{'s' if receivers > 1 else ''}"
    say(f"[{label}] waiting for the receivers to start and join")
    group = BroadcastGroup.join(HOST, port, 0, world, timeout_s=600, name="bench")
    try:
        times = _rank_loop(group, None, nbytes, reps, tensors,
                           progress=lambda rep: say(f"[{label}] {'warm-up' if rep == 0 else f'rep {rep}/{reps}'} done"))
    finally:
        group.close()
        for p in procs:
            p.join(timeout=60)
    out = {"model": kind, "receivers": receivers, "bytes": nbytes, "tensors": len(tensors)}
    for m in METHODS:
        out[m] = summarize(times[m], times["raw"], nbytes)
    return out


def bench_disk(kind: str, model, reps: int, raw_median_s: float) -> dict:
    """DiskSync write, then `load_into` a TorchEngine (safetensors maps the file: a bare read
    touches no bytes; the copy into the engine's parameters does)."""
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    engine = TorchEngine(build_model(kind, random_init=False), pad_token_id=0)
    write, load = [], []
    with tempfile.TemporaryDirectory(prefix="tidal-bench-ws-") as d:
        sync = DiskSync(d, keep=2)
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            path = sync.write(rep, tensors, with_checksum=False)
            t1 = time.perf_counter()
            sync.load_into(engine, path)
            if rep:
                write.append(t1 - t0)
                load.append(time.perf_counter() - t1)
    total = [w + r for w, r in zip(write, load)]
    return {"write_median_s": statistics.median(write), "load_into_median_s": statistics.median(load),
            "median_s": statistics.median(total), "bytes_per_s": nbytes / statistics.median(total),
            "ratio_to_raw": statistics.median(total) / raw_median_s, "all_s": total}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def table(results: list[dict]) -> str:
    head = "| model (params, MB) | receivers | raw broadcast | send/recv | + checksum | into TorchEngine | disk write + load into TorchEngine |"
    rows = [head, "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        cells = [f"{fmt_s(r['raw']['median_s'])}, {r['raw']['bytes_per_s'] / 1e9:.2f} GB/s"]
        for m in ("transport", "checksum", "engine"):
            cells.append(f"{fmt_s(r[m]['median_s'])} ({r[m]['ratio_to_raw']:.2f}×)")
        disk = r.get("disk")
        cells.append(f"{fmt_s(disk['median_s'])} ({disk['ratio_to_raw']:.2f}×)" if disk else "–")
        rows.append(f"| {r['model']} ({r['params'] / 1e6:.1f}M, {r['bytes'] / 1e6:.0f}) | {r['receivers']} | "
                    + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--receivers", default="1,2")
    p.add_argument("--models", default="tiny,100m")
    p.add_argument("--out", default="benchmarks/results/weightsync.json")
    p.add_argument("--scale", action="store_true", help="2 trainer ranks x 2 engine ranks: broadcast, shard, delta")
    p.add_argument("--tp", action="store_true", help="2 trainer ranks x one TP 2 engine replica: slices vs shard")
    p.add_argument("--delta-job", type=int, default=10, help="with --scale: steps of the default job to measure deltas on")
    p.add_argument("--bucket-mb", type=float, default=128.0, help="with --scale: bucket size of every transport")
    ns = p.parse_args()
    torch.set_num_threads(1)
    if ns.scale:
        return main_scale(ns)
    if ns.tp:
        return main_tp(ns)
    t_start, load_start = time.perf_counter(), os.getloadavg()
    results = []
    for kind in ns.models.split(","):
        say(f"[{kind}] building the model")
        model = build_model(kind)
        params = sum(p.numel() for p in model.parameters())
        first = True
        for receivers in (int(x) for x in ns.receivers.split(",")):
            r = bench(kind, model, receivers, ns.reps) | {"params": params}
            if first:  # disk does not depend on the number of receivers: once per model
                say(f"[{kind}] disk write + load into a TorchEngine")
                r["disk"] = bench_disk(kind, model, ns.reps, r["raw"]["median_s"])
                first = False
            results.append(r)
        del model
    out = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "load_average": {"start": load_start, "end": os.getloadavg()}, "torch": torch.__version__, "reps": ns.reps,
           "seconds": time.perf_counter() - t_start, "results": results}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(out, indent=1))
    print(table(results))
    say(f"wrote {ns.out} in {out['seconds']:.0f} s")


def main_scale(ns) -> None:
    from _weightsync_scale import bench_scale, delta_job, delta_table, scale_table

    t_start, load_start = time.perf_counter(), os.getloadavg()
    say("[scale] 100m, 2 trainer ranks x 2 engine ranks")
    scale = bench_scale(ns.reps, int(ns.bucket_mb * 2**20))
    say(scale["plan"])
    say(f"[delta] {ns.delta_job} steps of the default job")
    deltas = delta_job(ns.delta_job) if ns.delta_job else None
    out = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "load_average": {"start": load_start, "end": os.getloadavg()}, "torch": torch.__version__, "reps": ns.reps,
           "seconds": time.perf_counter() - t_start, "scale": scale, "delta_job": deltas}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(out, indent=1))
    print(scale_table(scale))
    if deltas:
        print()
        print(delta_table(deltas))
    say(f"wrote {ns.out} in {out['seconds']:.0f} s")


def main_tp(ns) -> None:
    from _weightsync_tp import bench_tp, tp_table

    t_start, load_start = time.perf_counter(), os.getloadavg()
    say("[tp] 100m, 2 trainer ranks x one engine replica of TP 2")
    r = bench_tp(ns.reps, int(ns.bucket_mb * 2**20))
    say(r["plan"])
    out = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "load_average": {"start": load_start, "end": os.getloadavg()}, "torch": torch.__version__, "reps": ns.reps,
           "seconds": time.perf_counter() - t_start, "tp": r}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(out, indent=1))
    print(tp_table(r))
    say(f"wrote {ns.out} in {out['seconds']:.0f} s")


if __name__ == "__main__":
    main()

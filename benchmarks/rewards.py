"""Reward-model serving: dynamic batching against scoring one by one, side by side.

    python benchmarks/rewards.py [--model DIR] [--texts 512] [--clients 32] [--reps 3]
                                 [--threads 1] [--out benchmarks/results/rewards.json]

The same reward model, the same texts (rendered arithmetic prompts with answers, as the
policy's episodes give them), the same machine, in one run:
  http/one-by-one   `tidal serve-rm`'s server with max_batch_size=1: every request its own
                    forward pass; `--clients` concurrent HTTP clients, one text per request
                    (as OpenRLHF's single-turn executor sends them);
  http/batched      the same server and clients with dynamic batching (max_batch_size 32,
                    max_wait_ms 5);
  inproc/one-by-one `pool.forward([text])` in a loop: no HTTP, no batching;
  inproc/batched    `--clients` concurrent `await pool.score([text])` callers on one pool.
Repetitions alternate the two modes of a pair; each pair's ratio is the median of the
per-repetition ratios (a shared, noisy machine disturbs that less than a ratio of medians).
`--model` default: a reward model built here (`train_reward_model`, a few steps from the
embedded tiny model): throughput does not depend on what the weights learnt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from tidal.envs.arithmetic import ArithmeticConfig, make_problems, worked_answer
from tidal.rewards.rm import RewardModelPool, render
from tidal.rewards.server import RewardServer
from tidal.rewards.train_rm import operands, train_reward_model


def make_texts(tokenizer, n: int) -> list[str]:
    rows = make_problems(ArithmeticConfig(), "train", n, seed=11)
    return [render(tokenizer, worked_answer(*operands(r)) if i % 2 else f"<answer>{r['answer']}</answer>",
                   prompt_messages=r["prompt"]) for i, r in enumerate(rows)]


async def http_load(url: str, texts: list[str], clients: int) -> float:
    """Seconds for `clients` concurrent HTTP clients to score all `texts`, one per request."""
    queue: asyncio.Queue = asyncio.Queue()
    for t in texts:
        queue.put_nowait(t)

    async def client():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            while not queue.empty():
                r = await c.post("/get_reward", json={"query": [queue.get_nowait()]})
                r.raise_for_status()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - t0


async def inproc_batched(pool: RewardModelPool, texts: list[str], clients: int) -> float:
    queue: asyncio.Queue = asyncio.Queue()
    for t in texts:
        queue.put_nowait(t)

    async def caller():
        while not queue.empty():
            await pool.score([queue.get_nowait()])

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(clients)))
    return time.perf_counter() - t0


def inproc_single(pool: RewardModelPool, texts: list[str]) -> float:
    t0 = time.perf_counter()
    for t in texts:
        pool.forward([t])
    return time.perf_counter() - t0


def run(model: Path, n_texts: int, clients: int, reps: int, batch: int, wait_ms: float) -> dict:
    one = RewardModelPool(model, max_batch_size=1, max_wait_ms=0)
    many = RewardModelPool(model, max_batch_size=batch, max_wait_ms=wait_ms)
    texts = make_texts(one.tokenizer, n_texts)
    times: dict[str, list[float]] = {k: [] for k in ("http/one-by-one", "http/batched", "inproc/one-by-one",
                                                       "inproc/batched")}
    hist: dict[str, dict] = {}
    with RewardServer(one, port=0) as s1, RewardServer(many, port=0) as s2:
        for rep in range(reps + 1):  # the first is a warm-up
            for name, fn in (("http/one-by-one", lambda: asyncio.run(http_load(s1.url, texts, clients))),
                             ("http/batched", lambda: asyncio.run(http_load(s2.url, texts, clients))),
                             ("inproc/one-by-one", lambda: inproc_single(one, texts)),
                             ("inproc/batched", lambda: asyncio.run(inproc_batched(many, texts, clients)))):
                many.reset_stats()
                dt = fn()
                if rep:
                    times[name].append(dt)
                if name.endswith("batched"):
                    hist[name] = many.stats()
            print(f"rep {rep}: " + "  ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items() if v and rep), flush=True)
    one.close()
    many.close()
    rows = []
    for kind in ("http", "inproc"):
        a, b = times[f"{kind}/one-by-one"], times[f"{kind}/batched"]
        st = hist[f"{kind}/batched"]
        rows.append({"path": kind, "texts": n_texts, "clients": clients,
                     "one_by_one_texts_per_s": n_texts / statistics.median(a),
                     "batched_texts_per_s": n_texts / statistics.median(b),
                     "speedup": statistics.median(x / y for x, y in zip(a, b)),
                     "mean_batch_size": st["mean_batch_size"], "batch_size_histogram": st["batch_size_histogram"],
                     "one_by_one_s": a, "batched_s": b})
    return {"rows": rows}


def table(rows: list[dict], batch: int, wait_ms: float) -> str:
    out = ["| path | texts × clients | one by one (texts/s) | dynamic batching (texts/s) | speed-up | mean batch |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        path = "HTTP `/get_reward`, 1 text per request" if r["path"] == "http" else "in process, `pool.score`"
        out.append(f"| {path} | {r['texts']} × {r['clients']} | {r['one_by_one_texts_per_s']:.0f} | "
                   f"{r['batched_texts_per_s']:.0f} | {r['speedup']:.2f}× | {r['mean_batch_size']:.1f} |")
    out.append(f"\nDynamic batching: max_batch_size {batch}, max_wait_ms {wait_ms:g}; one by one: max_batch_size 1.")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="reward model directory (default: built here in seconds)")
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the forward passes)")
    p.add_argument("--out", default="benchmarks/results/rewards.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(a.model) if a.model else Path(tmp) / "rm"
        if a.model is None:
            train_reward_model(model, pairs=64, steps=2, batch_size=8, heldout_pairs=16, log=lambda m: None)
        res = run(model, a.texts, a.clients, a.reps, a.batch, a.wait_ms)
    md = table(res["rows"], a.batch, a.wait_ms)
    out = {"benchmark": "rewards", "model": a.model or "train_reward_model(steps=2) from the embedded tiny model",
           "threads": a.threads, "reps": a.reps, "batch": a.batch, "wait_ms": a.wait_ms, "cpus": os.cpu_count(),
           "machine": platform.machine(), "python": sys.version.split()[0], "torch": torch.__version__,
           "loadavg_at_end": os.getloadavg(), "seconds": round(time.perf_counter() - t_start, 1), **res,
           "table": md}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(md)


if __name__ == "__main__":
    main()

"""Reward-model serving: dynamic batching against scoring one by one, side by side.

    python benchmarks/rewards.py [--model DIR] [--texts 512] [--clients 32] [--reps 3]
                                 [--per-request 1,8] [--threads 1]
                                 [--out benchmarks/results/rewards.json]

The same reward model, the same texts (rendered arithmetic prompts with answers, as the
policy's episodes give them), the same machine, in one run; each row compares one by one
(max_batch_size 1: one forward pass per text) with dynamic batching (max_batch_size 32,
max_wait_ms 5):
  http, n per request  two `tidal serve-rm` servers, each its own process with one torch
                       thread, one per mode; `--clients` concurrent HTTP clients in this
                       process POST `/get_reward` with n texts each (1: as OpenRLHF's
                       single-turn executor sends them; 8: a GRPO group);
  in process           one by one: `pool.forward([text])` in a loop; batched: `--clients`
                       concurrent `await pool.score([text])` callers on one pool.
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
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from tidal.envs.arithmetic import ArithmeticConfig, make_problems, worked_answer
from tidal.recipes.train_rm import operands, train_reward_model
from tidal.rewards.rm import RewardModelPool, render


def make_texts(tokenizer, n: int) -> list[str]:
    rows = make_problems(ArithmeticConfig(), "train", n, seed=11)
    return [render(tokenizer, worked_answer(*operands(r)) if i % 2 else f"<answer>{r['answer']}</answer>",
                   prompt_messages=r["prompt"]) for i, r in enumerate(rows)]


async def http_load(url: str, texts: list[str], clients: int, per_request: int) -> float:
    """Seconds for `clients` concurrent HTTP clients to score all `texts`, `per_request` texts
    in each request. The clients are made before the clock starts (an httpx client builds an
    SSL context, tens of milliseconds on a loaded machine) and connect on their first request."""
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(0, len(texts), per_request):
        queue.put_nowait(texts[i : i + per_request])
    pool = [httpx.AsyncClient(base_url=url, timeout=120) for _ in range(clients)]

    async def client(c: httpx.AsyncClient):
        while not queue.empty():
            r = await c.post("/get_reward", json={"query": queue.get_nowait()})
            r.raise_for_status()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in pool))
    dt = time.perf_counter() - t0
    for c in pool:
        await c.aclose()
    return dt


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


class ServeRM:
    """`tidal serve-rm MODEL` in a process of its own on 127.0.0.1 (a free port)."""

    def __init__(self, model: Path, batch: int, wait_ms: float, threads: int):
        cmd = [sys.executable, "-m", "tidal.cli", "serve-rm", str(model), "--port", "0", "--threads", str(threads),
               "--max-batch-size", str(batch), "--max-wait-ms", str(wait_ms)]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, stderr=self.log, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not (m := re.search(r"on (http://127\.0\.0\.1:\d+)", Path(self.log.name).read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tidal serve-rm did not start: {Path(self.log.name).read_text()[-2000:]}")
            time.sleep(0.1)
        self.url = m.group(1)
        for _ in range(600):  # the line is printed just before uvicorn listens
            try:
                httpx.get(self.url + "/health", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.1)

    def stats(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()["stats"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def _delta(after: dict, before: dict) -> dict:
    hist = {k: v - before["batch_size_histogram"].get(k, 0) for k, v in after["batch_size_histogram"].items()}
    hist = {k: v for k, v in hist.items() if v}
    passes = sum(hist.values())
    return {"batch_size_histogram": hist, "mean_batch_size": sum(int(k) * v for k, v in hist.items()) / max(1, passes)}


def run(model: Path, n_texts: int, clients: int, reps: int, batch: int, wait_ms: float, threads: int,
        per_request: list[int]) -> dict:
    one = RewardModelPool(model, max_batch_size=1, max_wait_ms=0)
    many = RewardModelPool(model, max_batch_size=batch, max_wait_ms=wait_ms)
    texts = make_texts(one.tokenizer, n_texts)
    s1, s2 = ServeRM(model, 1, 0, threads), ServeRM(model, batch, wait_ms, threads)
    cases = {}  # path -> (one-by-one thunk, batched thunk, stats of the batched side before/after)
    for n in per_request:
        cases[f"http/{n}"] = (lambda n=n: asyncio.run(http_load(s1.url, texts, clients, n)),
                              lambda n=n: asyncio.run(http_load(s2.url, texts, clients, n)), s2.stats)
    cases["inproc/1"] = (lambda: inproc_single(one, texts), lambda: asyncio.run(inproc_batched(many, texts, clients)),
                         many.stats)
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in cases}
    hist: dict[str, dict] = {}
    try:
        for rep in range(reps + 1):  # the first is a warm-up
            for name, (single, batched, stats) in cases.items():
                a = single()
                many.reset_stats()
                before = stats()
                b = batched()
                hist[name] = _delta(stats(), before)
                if rep:
                    times[name][0].append(a)
                    times[name][1].append(b)
            if rep:
                print(f"rep {rep}: " + "  ".join(f"{k} {v[0][-1]:.2f}s / {v[1][-1]:.2f}s" for k, v in times.items()),
                      flush=True)
    finally:
        s1.close()
        s2.close()
        one.close()
        many.close()
    rows = []
    for name, (a, b) in times.items():
        kind, n = name.split("/")
        st = hist[name]
        rows.append({"path": kind, "texts_per_request": int(n), "texts": n_texts, "clients": clients,
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
        path = (f"HTTP `/get_reward` (`tidal serve-rm` process), {r['texts_per_request']} per request"
                if r["path"] == "http" else "in process, `pool.score`, 1 per call")
        out.append(f"| {path} | {r['texts']} × {r['clients']} | {r['one_by_one_texts_per_s']:.0f} | "
                   f"{r['batched_texts_per_s']:.0f} | {r['speedup']:.2f}× | {r['mean_batch_size']:.1f} |")
    out.append(f"\nDynamic batching: max_batch_size {batch}, max_wait_ms {wait_ms:g}; one by one: max_batch_size 1; "
               "one torch thread per server; medians of the repetitions, speed-up the median per-repetition ratio.")
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
    p.add_argument("--per-request", default="1,8", help="texts per HTTP request, one row each (8: a GRPO group)")
    p.add_argument("--out", default="benchmarks/results/rewards.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(a.model) if a.model else Path(tmp) / "rm"
        if a.model is None:
            train_reward_model(model, pairs=64, steps=2, batch_size=8, heldout_pairs=16, log=lambda m: None)
        res = run(model, a.texts, a.clients, a.reps, a.batch, a.wait_ms, a.threads,
                  [int(x) for x in a.per_request.split(",")])
    md = table(res["rows"], a.batch, a.wait_ms)
    out = {"benchmark": "rewards", "model": a.model or "train_reward_model(steps=2) from the embedded tiny model",
           "threads": a.threads, "reps": a.reps, "batch": a.batch, "wait_ms": a.wait_ms, "cpus": os.cpu_count(),
           "machine": platform.machine(), "python": sys.version.split()[0], "torch": torch.__version__,
           "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg(),
           "seconds": round(time.perf_counter() - t_start, 1), **res, "table": md}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(md)


if __name__ == "__main__":
    main()

"""A million episodes through the real rollout, streamed to the Parquet episode store, with
bounded memory.

    python benchmarks/episodes.py [--episodes 1000000] [--chunk 2000] [--episodes-per-step 10000]
                                  [--no-text] [--out benchmarks/results/episodes.json]
    python benchmarks/episodes.py --store-only [--store-sample 20000] --out benchmarks/results/episodes_store.json

The environment is cheap and multi-turn (3 policy turns): it asks a sum, the policy answers,
the env asks for a check with its calculator tool, the policy calls it (`calc(a*b)`, executed
and recorded as a tool call), the env returns the result, the policy repeats it; per-turn
rewards and an outcome reward. The policy is `ScriptedEngine` (a script of three turns, no
model cost), so what is measured is tidal's own path: the rollout (chat template rendering,
incremental tokenization, batching, turn records) and the episode store (Arrow conversion,
text decoding, zstd Parquet). Episodes run through `Rollout.run` in chunks of `--chunk`
concurrent episodes; each episode goes to the store through `on_episode` as it finishes, and a
step's file is closed every `--episodes-per-step` episodes.

Memory: VmRSS from /proc/self/status after warm-up (one chunk run and thrown away), at every
chunk boundary (reported every 100k) and at the end, plus the kernel's peak (VmHWM). Growth =
max RSS seen - RSS after warm-up. One torch/tokenizer thread (the machine is shared).

A second, side-by-side measurement times the store alone on the same episodes: text decoding
off, batched per row group (the store's way), and one decode call per episode, alternating,
best of `--rounds`. `--store-only` runs only that, plus random 4096-token episodes (nothing
to compress: the disk cost per token of long agentic episodes).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizers library's thread pool
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from tidal.engines.scripted import ScriptedEngine
from tidal.envs.base import Action, StepResult
from tidal.models import DEFAULT_MODEL_DIR, load_tokenizer, stop_token_ids
from tidal.monitor.episodes import EpisodeWriter, episode_files, iter_episodes
from tidal.runtime.rollout import EpisodeSpec, Rollout
from tidal.types import SamplingParams, ToolCallRecord

CALC = re.compile(r"calc\((\d+)\*(\d+)\)")


class CheckedSumEnv:
    """Three turns: answer a sum; call the calculator on a product; repeat its result."""

    name = "checked_sum"

    def __init__(self, seed: int):
        self.a, self.b = 1 + seed % 9, 1 + (seed // 9) % 9
        self.turn = 0
        self.result = ""

    async def reset(self):
        return [{"role": "user", "content": f"What is {self.a}+{self.b}?"}]

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            ok = action.text.strip() == str(self.a + self.b)
            return StepResult([{"role": "user", "content": "Check 3*4 with calc."}], reward=0.1 * ok, done=False)
        if self.turn == 2:
            t0 = time.perf_counter()
            m = CALC.search(action.text)
            if m is None:
                call = ToolCallRecord("calc", action.text, f"c{self.turn}", "parse", "no calc(a*b) in the turn")
                return StepResult([{"role": "user", "content": "error: no call"}], done=False, tool_calls=[call])
            self.result = str(int(m.group(1)) * int(m.group(2)))
            call = ToolCallRecord("calc", m.group(0), f"c{self.turn}", "ok", "", len(self.result),
                                  time.perf_counter() - t0)
            return StepResult([{"role": "user", "content": self.result}], reward=0.1, done=False, tool_calls=[call])
        correct = float(action.text.strip() == self.result)
        return StepResult(reward=correct, reward_parts={"correct": correct}, done=True)

    async def close(self) -> None:
        pass


def rss_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                vals[k] = int(v.split()[0]) / 1024
    return vals["VmRSS"], vals["VmHWM"]


def specs(start: int, n: int, step: int) -> list[EpisodeSpec]:
    return [EpisodeSpec(env=CheckedSumEnv(i), episode_id=f"s{step}-e{i}", group_id=f"s{step}-g{i // 8}",
                        task_id=str(i // 8), seed=i) for i in range(start, start + n)]


async def run_chunk(rollout: Rollout, engine, chunk: list[EpisodeSpec], step: int, sink) -> list:
    if "on_episode" in inspect.signature(rollout.run).parameters:
        return await rollout.run(chunk, engine, step, on_episode=sink)
    eps = await rollout.run(chunk, engine, step)  # a rollout without streaming: hand them over at the end
    for e in eps:
        sink(e)
    return eps


def store_side_by_side(episodes: list, tokenizer, workdir: Path, rounds: int) -> dict:
    """Episodes/s of the store alone on the same episodes: text off, batched (the store's way),
    one decode call per episode. The modes alternate round by round; the best round counts
    (the machine is shared)."""

    class PerEpisodeDecode:  # the tokenizer seen through `decode` only: one call per episode (the old way)
        def __init__(self, tok):
            self.decode = tok.decode

    modes = {"no_text": {"decode_text": False}, "text_batched": {"tokenizer": tokenizer},
             "text_per_episode": {"tokenizer": PerEpisodeDecode(tokenizer), "decode_text": True}}
    best = dict.fromkeys(modes, float("inf"))
    size = {}
    for r in range(rounds):
        for name, kw in modes.items():
            d = workdir / f"{name}-{r}"
            t0 = time.perf_counter()
            with EpisodeWriter(d, **kw) as w:
                w.add_many(episodes)
            best[name] = min(best[name], time.perf_counter() - t0)
            size[name] = sum(f.stat().st_size for f in episode_files(d))
            shutil.rmtree(d)
    return {name: {"episodes_per_s": len(episodes) / best[name], "bytes_per_episode": size[name] / len(episodes)}
            for name in modes}


def long_episodes(n: int, length: int, seed: int = 0) -> list:
    """Incompressible stand-ins for long agentic episodes: random tokens and float32 log-probs
    over a 150k vocabulary, half the tokens the policy's, four turns with one tool call each."""
    import random
    import struct

    from tidal.types import Episode, Turn

    rng = random.Random(seed)
    out = []
    for i in range(n):
        mask = [k >= length // 8 and (k // 64) % 2 == 1 for k in range(length)]
        lp = [struct.unpack("f", struct.pack("f", -rng.expovariate(2.0)))[0] if m else 0.0 for m in mask]
        q = length // 4
        turns = [Turn(t, t * q, t * q + q // 2, (t + 1) * q, "x" * 40, "stop", 0.1 * t,
                      [ToolCallRecord("shell", '{"cmd": "ls -la"}', f"c{t}", "ok", "", 300, 0.01)], 3)
                 for t in range(4)]
        out.append(Episode(f"e{i}", f"g{i // 8}", str(i // 8), "long", tokens=[rng.randrange(150_000)
                                                                             for _ in range(length)],
                           loss_mask=mask, logprobs=lp, versions=[3 if m else -1 for m in mask], reward=1.0,
                           metrics={"turns": 4.0}, prompt_len=length // 8, step=1, seed=i, turns=turns))
    return out


def store_only(args, tok, tmp: Path) -> None:
    torch.set_num_threads(1)
    eos = stop_token_ids(tok)[0]
    engine = ScriptedEngine.from_texts(tok, ["7", "calc(3*4)", "12"], stop_token_id=eos)
    rollout = Rollout(tok, SamplingParams(max_new_tokens=16, stop_token_ids=(eos,)), max_turns=3)
    eps = asyncio.run(run_chunk(rollout, engine, specs(0, args.chunk, 1), 1, lambda e: None))
    sample = (eps * (args.store_sample // len(eps) + 1))[: args.store_sample]
    res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "rounds": args.rounds,
           "checked_sum": {"episodes": len(sample), "tokens_per_episode": len(eps[0].tokens),
                           **store_side_by_side(sample, tok, tmp, args.rounds)}}
    long = long_episodes(args.store_sample // 10, 4096)
    d = tmp / "long"
    t0 = time.perf_counter()
    with EpisodeWriter(d, decode_text=False) as w:
        w.add_many(long)
    dt = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in episode_files(d))
    res["long_random"] = {"episodes": len(long), "tokens_per_episode": 4096, "episodes_per_s": len(long) / dt,
                          "bytes_per_episode": size / len(long), "bytes_per_token": size / len(long) / 4096}
    Path(args.out).write_text(json.dumps(res, indent=1))
    shutil.rmtree(tmp)
    print("| store alone | episodes | tokens/episode | episodes/s | bytes/episode |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in ("no_text", "text_batched", "text_per_episode"):
        v = res["checked_sum"][name]
        print(f"| checked_sum, {name} | {len(sample):,} | {len(eps[0].tokens)} | {v['episodes_per_s']:,.0f} | "
              f"{v['bytes_per_episode']:.0f} |")
    v = res["long_random"]
    print(f"| random 4096-token episodes, no_text | {len(long):,} | 4096 | {v['episodes_per_s']:,.0f} | "
          f"{v['bytes_per_episode']:,.0f} ({v['bytes_per_token']:.2f}/token) |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=1_000_000)
    ap.add_argument("--chunk", type=int, default=2000, help="episodes per Rollout.run call (run concurrently)")
    ap.add_argument("--episodes-per-step", type=int, default=10_000)
    ap.add_argument("--no-text", action="store_true", help="do not decode the `text` column")
    ap.add_argument("--store-sample", type=int, default=10_000, help="episodes for the store-alone comparison")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the store-alone comparison (best counts)")
    ap.add_argument("--store-only", action="store_true", help="only the store-alone comparison (and random long "
                    "episodes); writes --out")
    ap.add_argument("--dir", default=None, help="where the store goes (default: a temporary folder, removed)")
    ap.add_argument("--out", default="benchmarks/results/episodes.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    eos = stop_token_ids(tok)[0]
    engine = ScriptedEngine.from_texts(tok, ["7", "calc(3*4)", "12"], stop_token_id=eos)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=tuple(stop_token_ids(tok)))
    rollout = Rollout(tok, params, max_turns=3)
    tmp = Path(tempfile.mkdtemp(prefix="tidal-episodes-"))
    if args.store_only:
        return store_only(args, tok, tmp)
    store = Path(args.dir) if args.dir else tmp / "episodes"

    # Warm-up: one chunk, thrown away (imports, template compilation, allocator pools).
    warm = asyncio.run(run_chunk(rollout, engine, specs(0, args.chunk, 0), 0, lambda e: None))
    sample = warm[: args.store_sample]
    while len(sample) < args.store_sample:
        sample += warm[: args.store_sample - len(sample)]
    side = store_side_by_side(sample, tok, tmp, args.rounds)
    del warm, sample

    writer = EpisodeWriter(store, tok, decode_text=not args.no_text)
    store_s = 0.0

    def sink(ep) -> None:
        nonlocal store_s
        t = time.perf_counter()
        writer.add(ep)
        store_s += time.perf_counter() - t

    rss0, _ = rss_mb()
    samples = [(0, rss0)]
    peak = rss0
    done, statuses = 0, {}
    t0 = time.perf_counter()
    next_report = 100_000
    while done < args.episodes:
        step = 1 + done // args.episodes_per_step
        step_end = min(step * args.episodes_per_step, args.episodes)
        n = min(args.chunk, step_end - done)
        eps = asyncio.run(run_chunk(rollout, engine, specs(done, n, step), step, sink))
        for e in eps:
            statuses[e.status.value] = statuses.get(e.status.value, 0) + 1
        del eps
        done += n
        if done == step_end:
            t = time.perf_counter()
            writer.end_step(step)
            store_s += time.perf_counter() - t
        rss, _ = rss_mb()
        peak = max(peak, rss)
        if done >= next_report or done == args.episodes:
            samples.append((done, rss))
            el = time.perf_counter() - t0
            print(f"{done:>9,} episodes  {done / el:8.0f}/s  RSS {rss:7.1f} MB (+{rss - rss0:5.1f})", flush=True)
            next_report += 100_000
    wall = time.perf_counter() - t0
    writer.close()
    rss_end, hwm = rss_mb()
    files = episode_files(store)
    size = sum(f.stat().st_size for f in files)

    # The store reads back: count, and the first episode's turns (per-turn rewards, tool calls).
    first = next(iter_episodes(files[0]))
    assert [t.reward for t in first.turns] and first.turns[1].tool_calls, "turns did not reach the store"

    res = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": sys.version.split()[0],
        "episodes": done, "chunk": args.chunk, "episodes_per_step": args.episodes_per_step,
        "decode_text": not args.no_text, "statuses": statuses,
        "wall_s": wall, "episodes_per_s": done / wall, "store_s": store_s, "store_share": store_s / wall,
        "rss_mb": {"after_warmup": rss0, "samples": samples, "end": rss_end, "max_sampled": peak, "vm_hwm": hwm},
        "rss_growth_mb": peak - rss0, "parquet_files": len(files), "parquet_bytes": size,
        "parquet_bytes_per_episode": size / done,
        "tokens_per_episode": len(first.tokens), "policy_tokens_per_episode": first.num_policy_tokens,
        "writer_max_buffered": writer.max_buffered, "row_group_episodes": writer.row_group_episodes,
        "store_alone": side,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    if not args.dir:
        shutil.rmtree(tmp)

    print()
    print("| episodes | episodes/s | store share of wall | RSS after warm-up | RSS growth (max sampled) | "
          "Parquet on disk | bytes/episode |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {done:,} | {done / wall:,.0f} | {store_s / wall:.0%} | {rss0:.0f} MB | {peak - rss0:+.1f} MB | "
          f"{size / 2**20:.1f} MiB in {len(files)} files | {size / done:.0f} |")
    print()
    print("| store alone, same episodes | episodes/s | bytes/episode |")
    print("| --- | ---: | ---: |")
    for name, v in side.items():
        print(f"| {name} | {v['episodes_per_s']:,.0f} | {v['bytes_per_episode']:.0f} |")


if __name__ == "__main__":
    main()

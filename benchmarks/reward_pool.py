"""What the reward pool's isolation costs: wall time to score one step's episodes with the
default task's reward (`tidal.rewards.arithmetic:score`, microseconds of work per episode)
through the inline scorer (the caller's event loop) and through worker processes, side by
side in one run, for the three ways a rollout calls a scorer.

    python benchmarks/reward_pool.py [--episodes 256] [--repeats 20] [--workers 2] [--ray]

- `one call`: `score(all episodes)`;
- `per group`: one `score` per group of 8, concurrently (what a batched TRL-form reward gets);
- `per episode`: one `score([episode])` per episode, concurrently (what the rollout does for
  per-sample rewards).

Prints the median and the ratio to inline per pattern (milliseconds per step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time


def _inputs(n: int):
    from tidal.rewards.contract import RewardInput

    pm = [{"role": "user", "content": "What is 7 + 5? Answer as <answer>N</answer>."}]
    done = [*pm, {"role": "assistant", "content": "<answer>12</answer>"}]
    return [RewardInput(f"e{i}", f"g{i // 8}", "arith", 1, "<|user|>What is 7 + 5?<|assistant|>", pm,
                        "<answer>12</answer>", list(range(12)), done,
                        [{"index": 0, "text": "<answer>12</answer>", "finish_reason": "stop", "reward": 0.0,
                          "tool_calls": []}], {"answer": "12", "task_id": f"t{i}"}) for i in range(n)]


async def _pattern(scorer, inputs, pattern: str):
    if pattern == "one call":
        return await scorer.score(inputs)
    size = 8 if pattern == "per group" else 1
    groups = [inputs[i:i + size] for i in range(0, len(inputs), size)]
    return [o for outs in await asyncio.gather(*(scorer.score(g) for g in groups)) for o in outs]


def _time(scorer, inputs, pattern: str, repeats: int) -> float:
    async def go():
        outs = await _pattern(scorer, inputs, pattern)  # warm-up, and a check that it scored
        assert all(o.status == "ok" and o.reward > 1.0 for o in outs), outs[:2]
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await _pattern(scorer, inputs, pattern)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ray", action="store_true", help="also through Ray reward actors (as many as --workers)")
    args = ap.parse_args()

    from tidal.config import RewardConfig, RewardSpec
    from tidal.rewards.pool import build_scorer

    specs = [RewardSpec(fn="tidal.rewards.arithmetic:score")]
    inputs = _inputs(args.episodes)
    scorers = {"inline": build_scorer(specs, RewardConfig(isolation="inline")),
               f"process x{args.workers}": build_scorer(specs, RewardConfig(workers=args.workers))}
    if args.ray:
        import logging
        import os

        import ray

        from tidal.runtime.placement import keep_on_loopback
        from tidal.runtime.workers import RewardActors, RewardWorker

        keep_on_loopback()
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, logging_level=logging.WARNING)
        cls = ray.remote(RewardWorker).options(num_cpus=0, max_concurrency=64)
        scorers[f"ray x{args.workers}"] = build_scorer(
            specs, RewardConfig(), ray_handles=RewardActors(args.workers, lambda i, s, t: cls.remote(s, t)))
    patterns = ["one call", "per group", "per episode"]
    results: dict[str, dict[str, float]] = {}
    try:
        for pattern in patterns:
            for name, scorer in scorers.items():
                results.setdefault(name, {})[pattern] = _time(scorer, inputs, pattern, args.repeats)
    finally:
        for scorer in scorers.values():
            asyncio.run(scorer.close())
    print(f"\n{args.episodes} episodes per step, median of {args.repeats}, ms per step (ratio to inline)\n")
    print("| scorer | " + " | ".join(patterns) + " |")
    print("| --- |" + " --- |" * len(patterns))
    for name, row in results.items():
        cells = [f"{1e3 * row[p]:.1f} ({row[p] / results['inline'][p]:.1f}x)" for p in patterns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n" + json.dumps({k: {p: round(v * 1e3, 2) for p, v in r.items()} for k, r in results.items()}))


if __name__ == "__main__":
    main()

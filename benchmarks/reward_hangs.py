"""What hung synchronous rewards cost a step: wall time to score one step's calls when some
of them hang, with the sync lanes of each worker (`reward.sync_concurrency`, default 8) against
one synchronous call at a time per worker (`reward.sync_concurrency=1`, the pool before sync
lanes), side by side in one run. Real worker processes; each hung call sleeps far past
`reward.timeout_s` and is ended by the pool.

    python benchmarks/reward_hangs.py [--episodes 64] [--timeout 1.0] [--workers 2] [--rounds 3]

Cases: `10% hang` (every tenth call), `all hang`, and `none hang` (the healthy path's cost of
the lanes). Prints per case and setting the median seconds per step and the ratio; writes
benchmarks/results/reward_hangs.json.

    python benchmarks/reward_hangs.py --budget [--timeout 2.0]

One training step of the default model (16 episodes, 2 workers of 2 lanes) whose reward always
hangs, with `reward.failure_budget=0.2` (the step stops waiting once 4 have failed) against
1.0 (every episode waited out); writes benchmarks/results/reward_hangs_budget.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

REWARD = textwrap.dedent('''
    import time

    def behave(completion, mode):
        if mode == "hang":
            time.sleep(1000)
        return 1.0
''')


def _inputs(modes: list[str]):
    from tidal.rewards.contract import RewardInput

    pm = [{"role": "user", "content": "What is 7 + 5?"}]
    return [RewardInput(f"e{i}", f"g{i // 8}", "t", 1, "<prompt>", pm, "12", [1, 2], pm, [], {"mode": m})
            for i, m in enumerate(modes)]


def _round(path: str, modes: list[str], timeout_s: float, workers: int, lanes: int) -> tuple[float, int]:
    from tidal.config import RewardConfig, RewardSpec
    from tidal.rewards.pool import build_scorer

    scorer = build_scorer([RewardSpec(fn=f"{path}:behave")],
                          RewardConfig(timeout_s=timeout_s, workers=workers, sync_concurrency=lanes))
    try:
        t0 = time.perf_counter()
        outs = asyncio.run(scorer.score(_inputs(modes)))
        elapsed = time.perf_counter() - t0
    finally:
        scorer.shutdown()
    expected = ["timeout" if m == "hang" else "ok" for m in modes]
    assert [o.status for o in outs] == expected, [o.status for o in outs][:8]
    return elapsed, sum(m == "hang" for m in modes)


def _budget_step(path: str, timeout_s: float, budget: float, run_dir: str) -> dict:
    from tidal.config import load_config
    from tidal.runtime.controller import Controller, RunFailed

    cfg = load_config(None, [f"run.dir={run_dir}", "train.steps=1", "rollout.prompts_per_step=4",
                             "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4", "run.eval_every=0",
                             "run.progress=false", "run.save_every=0", f"task.reward={path}:always_hangs",
                             f"reward.timeout_s={timeout_s}", "reward.workers=2", "reward.sync_concurrency=2",
                             f"reward.failure_budget={budget}", "reward.failure_steps=1"])
    ctl = Controller(cfg)
    try:
        t0 = time.perf_counter()
        try:
            ctl.train_step()
        except RunFailed:
            pass
        elapsed = time.perf_counter() - t0
    finally:
        ctl.close()
    row = json.loads((Path(run_dir) / "metrics.jsonl").read_text().splitlines()[0])
    return {"step_s": elapsed, "timeout": row.get("episodes/timeout"), "reward_error": row.get("episodes/reward_error")}


def budget(timeout_s: float) -> None:
    out: dict = {"timeout_s": timeout_s, "episodes": 16, "workers": 2, "sync_concurrency": 2, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "hanging.py")
        Path(path).write_text(REWARD + "\n\ndef always_hangs(completion, **kw):\n    time.sleep(1000)\n")
        for b in (0.2, 1.0):
            res = out["runs"][f"failure_budget={b}"] = _budget_step(path, timeout_s, b, f"{tmp}/run{b}")
            print(f"reward.failure_budget={b}: the step took {res['step_s']:.1f} s ({res['timeout']:.0f} timeout, "
                  f"{res['reward_error']:.0f} not scored)", flush=True)
    dest = Path(__file__).resolve().parent / "results" / "reward_hangs_budget.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", action="store_true", help="the step failure budget, in a training step")
    args = ap.parse_args()
    if args.budget:
        budget(args.timeout)
        return
    cases = {"none hang": lambda i: "ok", "10% hang": lambda i: "hang" if i % 10 == 0 else "ok",
             "all hang": lambda i: "hang"}
    out: dict = {"episodes": args.episodes, "timeout_s": args.timeout, "workers": args.workers, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "hanging.py")
        Path(path).write_text(REWARD)
        for name, mode in cases.items():
            modes = [mode(i) for i in range(args.episodes)]
            row = {}
            for lanes in (8, 1):
                times = [_round(path, modes, args.timeout, args.workers, lanes)[0] for _ in range(args.rounds)]
                row[f"lanes={lanes}"] = {"median_s": statistics.median(times), "all_s": times}
            row["ratio"] = row["lanes=1"]["median_s"] / row["lanes=8"]["median_s"]
            out["cases"][name] = row
            print(f"{name:10s}  8 lanes {row['lanes=8']['median_s']:7.2f} s   1 lane {row['lanes=1']['median_s']:7.2f} s"
                  f"   ratio {row['ratio']:.1f}x", flush=True)
    dest = Path(__file__).resolve().parent / "results" / "reward_hangs.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

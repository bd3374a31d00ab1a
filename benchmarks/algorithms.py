"""Every estimator of examples/algorithms/ on the default task: held-out greedy accuracy
before and after a short run, and wall clock, in one process, one after another.

    python benchmarks/algorithms.py [--steps 20] [--out benchmarks/results/algorithms.json] [names ...]

Each run starts from the embedded model with the example's algorithm settings and the
default job's everything else, for STEPS steps; accuracy is greedy on the 500-problem
held-out split (as `tidal eval`). Prints a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import tempfile
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "algorithms"
STEPS = 20
EVAL_N = 500


def _held_out_accuracy(ctl) -> float:
    from tidal.runtime.evaluate import evaluate_engine

    rows = ctl.task.eval_rows[:EVAL_N]
    return evaluate_engine(ctl.engine, ctl.rollout, rows, ctl.make_env, k=0)["accuracy"]


def _config(name: str, run_dir: Path, steps: int):
    from tidal.config import load_config

    return load_config(EXAMPLES / f"{name}.yaml", [
        f"run.dir={run_dir}", f"train.steps={steps}", "run.eval_every=0", "run.progress=false",
        "run.write_episodes=false", "run.save_every=0",
    ])


@functools.lru_cache(maxsize=1)
def start_accuracy() -> float:
    """Held-out greedy accuracy of the embedded model (the same for every run)."""
    from tidal.runtime.controller import Controller

    with tempfile.TemporaryDirectory() as tmp:
        ctl = Controller(_config("grpo", Path(tmp) / "run", 1))
        try:
            return _held_out_accuracy(ctl)
        finally:
            ctl.close()  # its run log lives in `tmp`: nothing may write there once it is gone


def run_one(name: str, run_dir: Path, steps: int = STEPS) -> dict:
    from tidal.runtime.controller import Controller

    cfg = _config(name, run_dir, steps)
    t0 = time.perf_counter()
    ctl = Controller(cfg)
    try:
        ctl.train()
        wall = time.perf_counter() - t0
        accuracy = _held_out_accuracy(ctl)
    finally:
        ctl.close()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    a = cfg.algorithm
    return {"name": name, "advantage": a.advantage, "policy_loss": a.policy_loss, "loss_agg": a.loss_agg,
            "steps": ctl.step, "accuracy_after": accuracy, "train_wall_s": round(wall, 1),
            "mean_step_s": round(sum(m["time/step_s"] for m in metrics) / len(metrics), 2),
            "train_reward_first": metrics[0].get("reward"), "train_reward_last": metrics[-1].get("reward")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--out", default="benchmarks/results/algorithms.json")
    p.add_argument("names", nargs="*", help="example names (default: every file in examples/algorithms/)")
    ns = p.parse_args()
    names = ns.names or sorted(q.stem for q in EXAMPLES.glob("*.yaml"))
    before = start_accuracy()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results.append(run_one(name, Path(tmp) / name, ns.steps))
            r = results[-1]
            print(f"{name}: {before:.3f} → {r['accuracy_after']:.3f} in {r['train_wall_s']:.0f} s", flush=True)
    out = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "eval_n": EVAL_N,
           "accuracy_before": before, "runs": results}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(out, indent=1))
    print("\n| example | advantage | policy loss | aggregation | steps | held-out accuracy | wall clock | s/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| `{r['name']}` | {r['advantage']} | {r['policy_loss']} | {r['loss_agg']} | {r['steps']} | "
              f"{before:.3f} → {r['accuracy_after']:.3f} | {r['train_wall_s']:.0f} s | {r['mean_step_s']:.2f} |")


if __name__ == "__main__":
    main()

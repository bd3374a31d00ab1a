"""The default job, measured: held-out accuracy before and after `tidal train`, and wall clock.

    python benchmarks/default_job.py [--out benchmarks/results/default_job.json] [overrides ...]

Runs `tidal eval default`, `tidal train` (no arguments but a run directory), and
`tidal eval` on the final checkpoint, each as its own process, as a user would. Writes
the raw figures as JSON and prints a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def tidal(*args: str) -> tuple[dict, float]:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "tidal.cli", *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1]), time.time() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/default_job.json")
    p.add_argument("--run-dir", default=None, help="keep the run here (default: a temporary directory)")
    p.add_argument("overrides", nargs="*")
    ns = p.parse_args()
    before, _ = tidal("eval", "default", "--json")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(ns.run_dir or Path(tmp) / "run")
        train, train_s = tidal("train", f"run.dir={run}", "run.progress=false", *ns.overrides)
        ckpt = max((run / "checkpoints").iterdir())
        after, _ = tidal("eval", str(ckpt), "--json")
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [(m["step"], m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m]
    result = {"machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
              "overrides": ns.overrides, "train_wall_s": round(train_s, 1), "steps": train["step"],
              "before": before, "after": after, "eval_curve": evals,
              "mean_step_s": sum(m["time/step_s"] for m in metrics) / len(metrics)}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1))
    print("| | held-out greedy accuracy | pass@8 | pass@1 (T=1) |\n| --- | --- | --- | --- |")
    for name, r in (("before RL (embedded model)", before), (f"after {train['step']} GRPO steps", after)):
        print(f"| {name} | {r['accuracy']:.3f} | {r['pass_at_k']:.3f} | {r['pass_at_1']:.3f} |")
    print(f"\ntraining wall clock {train_s:.0f} s (process start to exit), {result['mean_step_s']:.2f} s/step")


if __name__ == "__main__":
    main()

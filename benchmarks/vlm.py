"""Vision-language RL with the embedded tiny VLM: held-out greedy accuracy before -> after GRPO and the
wall clock, per image task and engine (the built-in torch engine and vLLM side by side).

    python benchmarks/vlm.py [--tasks vlm_color vlm_count vlm_zoom] [--engines torch vllm]

Each run is `tidal train examples/<task>.yaml engine.kind=<engine>` in a fresh process; accuracy is
`tidal eval` on the task's 200 held-out pictures (greedy), before (the embedded model) and after (the
run's last checkpoint). Wall clock is the run's own `wall_s` (model load to the last step, evaluations
during training included), and its step time is the median of its steps' `time/step_s`. Raw results:
benchmarks/results/vlm.json; the table goes to BENCHMARKS.md ("Vision-language RL") by hand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tidal(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], check=True, capture_output=True, text=True,
                          cwd=ROOT).stdout


def held_out(model: str, config: Path) -> dict:
    return json.loads(tidal("eval", model, str(config), "--json").splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="+", default=["vlm_color", "vlm_count", "vlm_zoom"])
    ap.add_argument("--engines", nargs="+", default=["torch", "vllm"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vlm.json"))
    args = ap.parse_args()
    results = []
    for task in args.tasks:
        config = ROOT / "examples" / f"{task}.yaml"
        before = held_out("default-vlm", config)
        for engine in args.engines:
            with tempfile.TemporaryDirectory() as tmp:
                run = Path(tmp) / "run"
                t0 = time.perf_counter()
                final = json.loads(tidal("train", str(config), f"run.dir={run}", "run.progress=false",
                                         f"engine.kind={engine}").splitlines()[-1])
                process_s = time.perf_counter() - t0
                steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                after = held_out(str(max((run / "checkpoints").iterdir())), config)
            row = {"task": task, "engine": engine, "steps": final["step"], "before": before["accuracy"],
                   "before_pass_at_k": before["pass_at_k"], "after": after["accuracy"],
                   "after_pass_at_k": after["pass_at_k"], "wall_s": final["wall_s"],
                   "process_s": round(process_s, 1),
                   "median_step_s": round(statistics.median(s["time/step_s"] for s in steps if "time/step_s" in s), 3),
                   "eval_curve": [(s["step"], s["eval/accuracy"]) for s in steps if "eval/accuracy" in s]}
            results.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"machine": "2 CPU cores", "results": results}, indent=1))
    print("\n| task | engine | held-out greedy before -> after | pass@8 before -> after | steps | wall clock | s/step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['task']} | {r['engine']} | {r['before']:.3f} -> {r['after']:.3f} | "
              f"{r['before_pass_at_k']:.3f} -> {r['after_pass_at_k']:.3f} | {r['steps']} | {r['wall_s']:.0f} s | "
              f"{r['median_step_s']:.2f} |")


if __name__ == "__main__":
    main()

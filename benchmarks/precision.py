"""The default job in float32, in mixed precision and with LoRA, side by side: held-out
accuracy, wall clock, time per step (generate / train), and the engine/trainer mismatch.

    python benchmarks/precision.py [--rounds 2] [--steps 60] [--out benchmarks/results/precision.json]

fp32: `tidal train` as it is. bf16: `train.mixed_precision=true engine.dtype=bfloat16` (the
trainer computes in bfloat16 over float32 master weights; the engine holds bfloat16 weights,
cast at each weight sync). lora: `train.lora.rank=16 train.lr=3e-3` (peft adapters on every
projection of every block, float32; adapters take a larger step than full weights, as is usual
for LoRA; the engine receives the merged weights). Each run is `tidal train` in a process of its own with the same
seed, then `tidal eval` of its last checkpoint on a float32 engine (greedy accuracy and pass@8
on the held-out split: the trained weights compared, not the engines); the two alternate in rounds (the machine is shared: compare within a round).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {"fp32": [], "bf16": ["train.mixed_precision=true", "engine.dtype=bfloat16"],
         "lora": ["train.lora.rank=16", "train.lr=3e-3"]}


def tidal(*args: str) -> tuple[dict, float]:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "tidal.cli", *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1]), time.time() - t0


def one(mode: str, steps: int, tmp: Path, r: int) -> dict:
    run = tmp / f"{mode}-{r}"
    _, wall = tidal("train", f"run.dir={run}", "run.progress=false", f"train.steps={steps}", *MODES[mode])
    after, _ = tidal("eval", str(max((run / "checkpoints").iterdir())), "--json")  # both on a float32 engine
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [m for m in rows if "time/step_s" in m]
    mean = lambda k: statistics.fmean(m[k] for m in rows)
    return {"mode": mode, "round": r, "train_wall_s": round(wall, 1), "accuracy": after["accuracy"],
            "pass_at_k": after["pass_at_k"], "step_s": mean("time/step_s"), "rollout_s": mean("time/rollout_s"),
            "train_s": mean("time/train_s"), "logprob_abs_diff": mean("logprob_abs_diff"),
            "mismatch_kl": mean("mismatch_kl"), "logprob_max_abs_diff": max(m["logprob_max_abs_diff"] for m in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default="benchmarks/results/precision.json")
    a = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            names = list(MODES)
            for mode in names[r % len(names):] + names[:r % len(names)]:  # the order rotates by round
                res = one(mode, a.steps, Path(tmp), r + 1)
                results.append(res)
                print(json.dumps(res), flush=True)
    out = {"rounds": results, "steps": a.steps, "command": "python benchmarks/precision.py " + " ".join(sys.argv[1:]),
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print("| round | mode | held-out greedy | pass@8 | train wall s | s/step | rollout s | train s | "
          "mean abs log-prob diff | mismatch KL | max abs diff |\n" + "| --- " * 11 + "|")
    for x in results:
        print(f"| {x['round']} | {x['mode']} | {x['accuracy']:.3f} | {x['pass_at_k']:.3f} | {x['train_wall_s']:.0f} | "
              f"{x['step_s']:.2f} | {x['rollout_s']:.2f} | {x['train_s']:.2f} | {x['logprob_abs_diff']:.1e} | "
              f"{x['mismatch_kl']:.1e} | {x['logprob_max_abs_diff']:.2f} |")


if __name__ == "__main__":
    main()

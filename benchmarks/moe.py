"""Mixture of experts, routing replay (docs/moe.md): GRPO on the default task with the embedded tiny
MoE (`model.path=default-moe`), rollout routing replay off and on (R3), in float32 and in bfloat16,
the same seeds; the cost of R3.

    python benchmarks/moe.py [--seeds 0 1] [--steps 15] [--modes fp32 fp32-R3 bf16 bf16-R3]
                             [--out benchmarks/results/moe.json]

Each run is `tidal train` in a process of its own (seed `run.seed`), then `tidal eval` of its last
checkpoint on a float32 engine (held-out greedy accuracy, the trained weights compared), against
`tidal eval default-moe` before. From its metrics: the step time (`time/step_s`, and the
trainer's `time/train_s`), the engine/trainer top-k disagreement (`moe/topk_disagree`: the
trainer's own choice, measured replay or not), and the log-prob mismatch (`logprob_abs_diff`)
with replay (R3 runs) and without (the others); their first steps train on the same episodes
(same seed, same weights), so step 1 compares the two on one batch. The R3 runs do not set
`train.moe.measure_unreplayed`, whose extra forward would add to their step time. From its episode store:
the bytes R3's record adds per episode (the raw record, and the store's files written again
without the column: what it costs on disk after Parquet's compression).

bf16: `train.mixed_precision=true engine.dtype=bfloat16` (the engine holds bfloat16 weights; the
routers of both compute in float32 from those weights).

Expert parallelism's rows (ep 1 / ep 2 step time and memory) are another section of BENCHMARKS.md.
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

COMMON = ["model.path=default-moe", "engine.kind=torch", "run.progress=false", "run.eval_every=0"]
MODES = {
    "fp32": [],
    "fp32-R3": ["train.moe.routing_replay=R3"],
    "bf16": ["train.mixed_precision=true", "engine.dtype=bfloat16"],
    "bf16-R3": ["train.mixed_precision=true", "engine.dtype=bfloat16", "train.moe.routing_replay=R3"],
}


def tidal(*args: str) -> tuple[dict, float]:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "tidal.cli", *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1]), time.time() - t0


def store_bytes(episodes_dir: Path) -> dict:
    """R3's record in the store: its raw bytes per episode, and the store's bytes per episode with
    and without the column (each file written again by pyarrow with the writer's settings)."""
    import pyarrow.parquet as pq

    files = sorted(episodes_dir.glob("*.parquet"))
    n = raw = with_col = without = 0
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            t = pq.read_table(f)
            n += t.num_rows
            raw += sum(len(r["data"]) for r in t.column("routed_experts").to_pylist() if r is not None)
            for table, name in ((t, "with"), (t.drop_columns(["routed_experts"]), "without")):
                out = Path(tmp) / f"{name}.parquet"
                pq.write_table(table, out)
                size = out.stat().st_size
                with_col, without = (with_col + size, without) if name == "with" else (with_col, without + size)
    return {"episodes": n, "raw_bytes_per_episode": raw / max(n, 1),
            "store_bytes_per_episode_with": with_col / max(n, 1), "store_bytes_per_episode_without": without / max(n, 1)}


def one(mode: str, seed: int, steps: int, tmp: Path) -> dict:
    run = tmp / f"{mode}-{seed}"
    _, wall = tidal("train", *COMMON, f"run.dir={run}", f"run.seed={seed}", f"train.steps={steps}",
                    f"run.save_every={steps}", *MODES[mode])
    after, _ = tidal("eval", str(max((run / "checkpoints").iterdir())), "--json")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [m for m in rows if "time/step_s" in m]
    mean = lambda k: statistics.fmean(m[k] for m in rows if k in m) if any(k in m for m in rows) else None
    out = {"mode": mode, "seed": seed, "train_wall_s": round(wall, 1), "accuracy": after["accuracy"],
           "pass_at_k": after["pass_at_k"], "step_s": mean("time/step_s"), "train_s": mean("time/train_s"),
           "topk_disagree": mean("moe/topk_disagree"), "router_disagree": mean("moe/router_disagree"),
           "logprob_abs_diff": mean("logprob_abs_diff"),
           "imbalance": mean("moe/imbalance"), "reward_first": rows[0]["reward"], "reward_last": rows[-1]["reward"],
           "step1_topk_disagree": rows[0].get("moe/topk_disagree"), "step1_abs_diff": rows[0]["logprob_abs_diff"]}
    if "R3" in mode:
        out |= store_bytes(run / "episodes")
    return out


def fmt(x, spec=".3f") -> str:
    return "–" if x is None else format(x, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--out", default="benchmarks/results/moe.json")
    a = p.parse_args()
    before, _ = tidal("eval", "default-moe", "--json")
    print(json.dumps({"before": before}), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            for mode in a.modes:  # alternating modes within a seed: the machine is shared
                res = one(mode, seed, a.steps, Path(tmp))
                results.append(res)
                print(json.dumps(res), flush=True)
    out = {"before": before, "runs": results, "steps": a.steps,
           "command": "python benchmarks/moe.py " + " ".join(sys.argv[1:]),
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"before: held-out greedy {before['accuracy']:.3f}, pass@8 {before['pass_at_k']:.3f}")
    print("| seed | mode | held-out greedy after | pass@8 | s/step | train s/step | top-k disagree | router disagree | "
          "abs log-prob diff | step 1: top-k disagree | step 1: abs log-prob diff |\n" + "| --- " * 11 + "|")
    for x in results:
        print(f"| {x['seed']} | {x['mode']} | {x['accuracy']:.3f} | {x['pass_at_k']:.3f} | {fmt(x['step_s'], '.2f')} | "
              f"{fmt(x['train_s'], '.2f')} | {fmt(x['topk_disagree'])} | {fmt(x['router_disagree'])} | "
              f"{fmt(x['logprob_abs_diff'], '.1e')} | {fmt(x['step1_topk_disagree'])} | {fmt(x['step1_abs_diff'], '.1e')} |")
    for x in results:
        if "raw_bytes_per_episode" in x:
            print(f"R3 record ({x['mode']}, seed {x['seed']}): {x['raw_bytes_per_episode']:.0f} raw bytes per episode; "
                  f"store {x['store_bytes_per_episode_with']:.0f} vs {x['store_bytes_per_episode_without']:.0f} "
                  "bytes per episode with / without it")


if __name__ == "__main__":
    main()

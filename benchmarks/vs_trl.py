"""tidal against TRL's GRPOTrainer on the default job: time to held-out accuracy 0.9, seconds
per step split into generation and training, completions/s; the two alternate in rounds.

    python benchmarks/vs_trl.py --setup          # once: TRL into a venv of its own (.venv-trl)
    python benchmarks/vs_trl.py [--rounds 2] [--steps 10] [--modes identical,best]

Both run the default job (`tidal train` with no arguments; examples/arith_grpo.yaml): the
embedded model, the arithmetic task's train prompts in the order tidal's PromptSource draws
them (TRL's sampler does not shuffle them again), 32 prompts × 8 samples, at most 32 new tokens
at temperature 1, the arithmetic score (correct + 0.1 format) as the reward, group-normalised
advantages, clip 0.2/0.28, no KL, token-mean loss (TRL's `dapo`), one update per batch, AdamW
(lr 3e-4, betas 0.9/0.99, no weight decay, grad clip 1), 5 warm-up steps then constant, float32,
no activation checkpointing (TRL's GRPOConfig turns it on by default; tidal's is off), the same
torch thread count. After each step both decode the same held-out prompts greedily and
score them, off the clock.

Modes (tidal's side; TRL runs its one configuration in both):
- `identical`: tidal's default job as it stands;
- `best`: with tidal's best *system* settings for this machine (`--best`, overrides that
  change how fast a step runs, not the algorithm, the updates per batch or the data; the
  default, bfloat16 mixed precision with packing, one micro-batch per update
  (`train.micro_batch_tokens=16384`; the loss is the same whatever the split) and each group's
  prompt computed once in the update (`train.share_prompts`; the same gradient), is the best
  tried: BENCHMARKS.md).

Both children run in the same environment, including the OpenMP defaults that importing tidal
sets (`OMP_WAIT_POLICY=ACTIVE`, `GOMP_SPINCOUNT=100000`, unless set; recorded in the results).

TRL runs in `.venv-trl` with its own transformers (benchmarks/_trl_job.py), so tidal's pins stay
untouched. Raw records go to benchmarks/results/vs_trl.json; the tables printed are the ones in
BENCHMARKS.md.
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

ROOT = Path(__file__).resolve().parent.parent
TRL_VENV = ROOT / ".venv-trl"
TARGET = 0.9
BEST = ["train.mixed_precision=true", "train.packing=true", "train.micro_batch_tokens=16384", "train.share_prompts=true"]


def setup() -> None:
    """A venv of TRL's own: the same CPU torch as tidal's (the local wheel), the newest TRL."""
    if not (TRL_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(TRL_VENV / "bin" / "pip"), "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "trl", "datasets"], check=True)


def job_spec(steps: int, threads: int, eval_n: int) -> dict:
    """What both sides run, read from tidal's own config and task: TRL gets exactly these rows."""
    sys.path.insert(0, str(ROOT))
    from tidal.config import load_config
    from tidal.envs.dataset import PromptSource
    from tidal.models import resolve_model_dir
    from tidal.runtime.tasks import build_task

    cfg = load_config(None, [])
    task = build_task(cfg.task)
    r, a, t = cfg.rollout, cfg.algorithm, cfg.train
    if a.kl_coef or t.lr_schedule != "constant" or t.mini_batches != 1 or t.epochs != 1 or a.advantage != "grpo":
        raise SystemExit(f"the default job changed ({a.advantage}, kl {a.kl_coef}, {t.lr_schedule}); update vs_trl.py")
    order = PromptSource(task.train_rows, seed=cfg.run.seed).take(steps * r.prompts_per_step)
    completions = r.prompts_per_step * r.samples_per_prompt
    return {
        "repo": str(ROOT), "model": str(resolve_model_dir(cfg.model.path)), "seed": cfg.run.seed, "steps": steps,
        "threads": threads,
        "train": [{"prompt": row["prompt"], "answer": row["answer"]} for row in order],
        "eval": [{"prompt": row["prompt"], "answer": row["answer"]} for row in task.eval_rows[:eval_n]],
        "hparams": {
            "samples_per_prompt": r.samples_per_prompt, "max_new_tokens": r.max_new_tokens,
            "temperature": r.temperature, "lr": t.lr, "warmup_steps": t.warmup_steps, "betas": list(t.betas),
            "weight_decay": t.weight_decay, "grad_clip": t.grad_clip, "kl_coef": a.kl_coef,
            "clip_low": a.clip_low, "clip_high": a.clip_high,
            # TRL's GRPOConfig turns gradient checkpointing on by default; tidal's is off
            "activation_checkpointing": t.activation_checkpointing,
            # 256 completions per update in two micro-batches of 128 (~6k tokens, as tidal's
            # micro_batch_tokens 8192 splits them); one generation per update
            "micro_batch": completions // 2, "accum": 2,
        },
    }


def run_tidal(steps: int, threads: int, eval_n: int, overrides: list[str], tmp: Path) -> dict:
    run = tmp / f"tidal-{time.time_ns()}"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", "train", f"run.dir={run}", "run.progress=false",
                           f"train.steps={steps}", "run.eval_every=1", f"eval.n={eval_n}", f"run.threads={threads}",
                           "run.save_every=0", *overrides], check=False, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"tidal train {' '.join(overrides)} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    wall = time.time() - t0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps_rec = [{"step": m["step"], "step_s": m["time/step_s"], "gen_s": m["time/rollout_s"],
                  "train_s": m["time/train_s"], "accuracy": m["eval/accuracy"]}
                 for m in metrics if "time/step_s" in m and "eval/accuracy" in m]
    return {"steps": steps_rec, "process_s": wall}


def run_trl(spec: dict, tmp: Path, child: str = "_trl_job.py") -> dict:
    """`child` (a TRL job in benchmarks/) in the TRL venv on `spec`; its records and process time."""
    spec_path, out = tmp / f"spec-{time.time_ns()}.json", tmp / f"trl-{time.time_ns()}.json"
    spec_path.write_text(json.dumps(spec))
    t0 = time.time()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true"}
    proc = subprocess.run([str(TRL_VENV / "bin" / "python"), str(ROOT / "benchmarks" / child), str(spec_path),
                           str(out)], check=False, capture_output=True, text=True, env=env, cwd=tmp)
    if proc.returncode:
        raise SystemExit(f"the TRL job failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    res = json.loads(out.read_text())
    res["process_s"] = time.time() - t0
    return res


def summarize(rec: dict, completions: int) -> dict:
    """Time to the target (the steps' own time summed up to the first step whose held-out greedy
    accuracy reaches it; eval and process start excluded), medians per step."""
    steps, elapsed, to_target, at = rec["steps"], 0.0, None, None
    for s in steps:
        elapsed += s["step_s"]
        if to_target is None and s["accuracy"] >= TARGET:
            to_target, at = elapsed, s["step"]
    med = {k: statistics.median(s[k] for s in steps) for k in ("step_s", "gen_s", "train_s")}
    return {"time_to_target_s": to_target, "target_step": at, **{f"median_{k}": v for k, v in med.items()},
            "completions_per_s": completions / med["step_s"], "accuracy": [round(s["accuracy"], 3) for s in steps]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", action="store_true", help="install TRL into .venv-trl and exit")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-n", type=int, default=200)
    p.add_argument("--modes", default="identical,best")
    p.add_argument("--best", nargs="*", default=BEST, help="tidal's overrides in the best mode")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vs_trl.json"))
    ns = p.parse_args()
    if ns.setup:
        setup()
        return
    if not (TRL_VENV / "bin" / "python").exists():
        raise SystemExit(f"no TRL venv at {TRL_VENV}: run `python benchmarks/vs_trl.py --setup` first")
    modes = ns.modes.split(",")
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                     "threads": ns.threads, "steps": ns.steps, "eval_n": ns.eval_n, "target": TARGET,
                     "best_overrides": ns.best, "rounds": []}
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        spec = job_spec(ns.steps, ns.threads, ns.eval_n)
        # job_spec imported tidal, which set its OpenMP defaults in this process's environment
        # (tidal/__init__.py) unless they were set: both children inherit the same values.
        results["openmp_env"] = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        completions = len(spec["train"]) // ns.steps * spec["hparams"]["samples_per_prompt"]
        for rnd in range(ns.rounds):
            order = ["trl", *modes] if rnd % 2 == 0 else [*reversed(modes), "trl"]
            row: dict = {"round": rnd + 1, "order": order}
            for who in order:
                if who == "trl":
                    rec = run_trl(spec, tmp)
                else:
                    rec = run_tidal(ns.steps, ns.threads, ns.eval_n, ns.best if who == "best" else [], tmp)
                row[who] = {**rec, "summary": summarize(rec, completions)}
                s = row[who]["summary"]
                print(f"round {rnd + 1} {who}: to {TARGET} {s['time_to_target_s']} s (step {s['target_step']}), "
                      f"{s['median_step_s']:.2f} s/step (gen {s['median_gen_s']:.2f}, train {s['median_train_s']:.2f}), "
                      f"accuracy {s['accuracy']}", flush=True)
            results["rounds"].append(row)
        results["versions"] = {k: results["rounds"][0]["trl"][k] for k in ("trl", "transformers", "torch")}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(results, indent=1))
    print(table(results, modes))


def table(results: dict, modes: list[str]) -> str:
    lines = [("| round | run | time to 0.9 (s) | at step | s/step | generate s | train s | completions/s | "
              "TRL ÷ tidal (time to 0.9) |"), "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in results["rounds"]:
        trl = row["trl"]["summary"]["time_to_target_s"]
        for who in ["trl", *modes]:
            s = row[who]["summary"]
            t = s["time_to_target_s"]
            ratio = f"{trl / t:.2f}×" if t and trl else "—"
            name = "TRL" if who == "trl" else f"tidal ({who})"
            lines.append(f"| {row['round']} | {name} | {t if t is None else round(t, 2)} | {s['target_step']} | "
                         f"{s['median_step_s']:.2f} | {s['median_gen_s']:.2f} | {s['median_train_s']:.2f} | "
                         f"{s['completions_per_s']:.0f} | {ratio if who != 'trl' else ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""tidal against TRL's GRPOTrainer on vision-language RL: the embedded tiny VLM on tidal's image tasks
(vlm_color, vlm_count); held-out greedy accuracy before -> after, time to held-out accuracy 0.8, seconds per
step split into generation and training, completions/s; the two alternate in rounds.

    python benchmarks/vlm_vs_trl.py --setup          # once: .venv-trl (benchmarks/vs_trl.py's setup) + Pillow
    python benchmarks/vlm_vs_trl.py [--tasks vlm_color vlm_count] [--rounds 2] [--steps 20]

Both run examples/<task>.yaml as tidal reads it: the embedded tiny Qwen2-VL
(tidal/models/assets/tiny-vlm, 0.8M parameters), the task's train pictures and questions in the order
tidal's PromptSource draws them (TRL's sampler does not shuffle them again), 16 prompts × 8 samples,
at most 16 new tokens at temperature 1 (top-p 1, no top-k), the image-task score (tidal/rewards/vision.py:
correct + 0.1 format, loaded from its file in the TRL child) as the reward, group-normalised advantages,
clip 0.2/0.28, no KL, token-mean loss (TRL's `dapo`), one update per batch in one micro-batch (128
completions of at most ~45 tokens fit tidal's micro_batch_tokens 8192), AdamW (lr 3e-4, betas 0.9/0.99,
no weight decay, grad clip 1), 2 warm-up steps then constant, float32, no activation checkpointing
(tidal's default; TRL's default is on, so the child turns it off), the same torch thread count. Before
the first step and after each step both decode the same 200 held-out pictures greedily and score
them, off the clock (tidal: `run.eval_every=1 eval.at_start=true`).

Images: both use transformers' PIL image processor (`Qwen2VLImageProcessorPil`) built from the
model's preprocessor_config.json (no usable torchvision here), so a 56×56 picture is 4 image tokens on
both sides. TRL gets it in an image-only Qwen2VLProcessor subclass built in the child (TRL's default,
AutoProcessor, needs torchvision for the video processor): benchmarks/_trl_vlm_job.py's docstring
lists everything its child does beyond plain TRL; no TRL or transformers source is patched.

Differences that remain between the two sides:
- Vision special tokens: tidal masks `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>` and
  `<|video_pad|>` out of the policy's distribution when sampling and in the trainer's log-probs;
  TRL suppresses only `<|image_pad|>` when sampling and leaves its log-probs unmasked. (The held-out
  greedy decode bans all four on both sides.)
- Each side's own generation loop: tidal's torch engine, TRL's `model.generate` (transformers).

TRL runs in `.venv-trl` with its own transformers (benchmarks/_trl_vlm_job.py), so tidal's pins stay
untouched. Raw records go to benchmarks/results/vlm_vs_trl.json (rewritten after every round); the
table printed is markdown. Each run records the 1-minute load average before it starts. The committed
results were measured with `--threads 1` while another job used the 2-core machine: with 2 threads on
the CPU left over, both sides' steps swung from 0.5 to 15 s (the threads wait on each other), which
measured the other job, not the two systems.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import ROOT, TRL_VENV, run_trl
from vs_trl import setup as trl_setup

TARGET = 0.8


def setup() -> None:
    """benchmarks/vs_trl.py's TRL venv, plus Pillow (TRL's image path needs it; the text job does not)."""
    t0 = time.time()
    trl_setup()
    subprocess.run([str(TRL_VENV / "bin" / "pip"), "install", "--quiet", "pillow"], check=True)
    print(f"setup: {time.time() - t0:.0f} s")


def _question_and_image(row: dict, pictures: Path) -> dict:
    """A tidal image-task row as the TRL child takes it: the question, the picture as a PNG file, the answer."""
    (msg,) = row["prompt"]
    parts = msg["content"]
    if [p["type"] for p in parts] != ["image", "text"]:
        raise SystemExit(f"an image-task prompt changed shape ({[p['type'] for p in parts]}); update vlm_vs_trl.py")
    blob = parts[0]["image"]
    path = pictures / f"{blob.id}.png"
    if not path.exists():
        path.write_bytes(blob.png)
    return {"question": parts[1]["text"], "image": str(path), "answer": str(row["answer"])}


def job_spec(task_name: str, steps: int, threads: int, eval_n: int, pictures: Path) -> dict:
    """What both sides run, read from tidal's own config and task: TRL gets exactly these rows."""
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from tidal.config import load_config
    from tidal.envs.dataset import PromptSource
    from tidal.models import resolve_model_dir
    from tidal.models.vision import Vision
    from tidal.runtime.tasks import build_task

    cfg = load_config(ROOT / "examples" / f"{task_name}.yaml", [])
    task = build_task(cfg.task)
    r, a, t = cfg.rollout, cfg.algorithm, cfg.train
    if (a.kl_coef or t.lr_schedule != "constant" or t.mini_batches != 1 or t.epochs != 1 or a.advantage != "grpo"
            or a.loss_agg != "token-mean" or t.packing or t.lora.rank or cfg.model.dtype != "float32"):
        raise SystemExit(f"examples/{task_name}.yaml changed ({a.advantage}, kl {a.kl_coef}, {t.lr_schedule}, "
                         f"{a.loss_agg}); update vlm_vs_trl.py")
    model = str(resolve_model_dir(cfg.model.path))
    order = PromptSource(task.train_rows, seed=cfg.run.seed).take(steps * r.prompts_per_step)
    completions = r.prompts_per_step * r.samples_per_prompt
    # tidal's micro-batches: rows × longest padded length within train.micro_batch_tokens; the longest
    # sequence is the longest prompt (image runs expanded) plus max_new_tokens
    tok, vision = AutoTokenizer.from_pretrained(model), Vision.load(model)
    longest = 0
    for row in order:
        blob = row["prompt"][0]["content"][0]["image"]
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
        longest = max(longest, len(vision.expand(list(ids["input_ids"]), [blob])))
    micro = math.ceil(completions / (t.micro_batch_tokens // (longest + r.max_new_tokens)))
    if completions % micro:
        raise SystemExit(f"{completions} completions do not split evenly into {micro} micro-batches")
    return {
        "task": task_name, "repo": str(ROOT), "model": model, "seed": cfg.run.seed, "steps": steps,
        "threads": threads, "longest_sequence": longest + r.max_new_tokens,
        "train": [_question_and_image(row, pictures) for row in order],
        "eval": [_question_and_image(row, pictures) for row in task.eval_rows[:eval_n]],
        "hparams": {
            "samples_per_prompt": r.samples_per_prompt, "max_new_tokens": r.max_new_tokens,
            "temperature": r.temperature, "lr": t.lr, "warmup_steps": t.warmup_steps, "betas": list(t.betas),
            "weight_decay": t.weight_decay, "grad_clip": t.grad_clip, "kl_coef": a.kl_coef,
            "clip_low": a.clip_low, "clip_high": a.clip_high, "activation_checkpointing": t.activation_checkpointing,
            "micro_batch": completions // micro, "accum": micro,
        },
    }


def run_tidal(task_name: str, steps: int, threads: int, eval_n: int, tmp: Path) -> dict:
    run = tmp / f"tidal-{time.time_ns()}"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", "train", str(ROOT / "examples" / f"{task_name}.yaml"),
                           f"run.dir={run}", "run.progress=false", f"train.steps={steps}", "run.eval_every=1",
                           "eval.at_start=true", f"eval.n={eval_n}", f"run.threads={threads}", "run.save_every=0"],
                          check=False, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"tidal train {task_name} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    wall = time.time() - t0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    recs = [{"step": m["step"], "accuracy": m["eval/accuracy"]} if m["step"] == 0 else
            {"step": m["step"], "step_s": m["time/step_s"], "gen_s": m["time/rollout_s"],
             "train_s": m["time/train_s"], "accuracy": m["eval/accuracy"]}
            for m in metrics if "eval/accuracy" in m and (m["step"] == 0 or "time/step_s" in m)]
    return {"steps": recs, "process_s": wall}


def summarize(rec: dict, completions: int) -> dict:
    """Accuracy before (step 0) -> after (the last step); time to the target (the steps' own time summed
    up to the first step whose held-out greedy accuracy reaches it; eval and process start excluded);
    medians per step; the fastest step (with its generate/train split)."""
    start = [s for s in rec["steps"] if s["step"] == 0]
    steps = [s for s in rec["steps"] if s["step"] > 0]
    elapsed, to_target, at = 0.0, None, None
    for s in steps:
        elapsed += s["step_s"]
        if to_target is None and s["accuracy"] >= TARGET:
            to_target, at = elapsed, s["step"]
    med = {k: statistics.median(s[k] for s in steps) for k in ("step_s", "gen_s", "train_s")}
    fastest = min(steps, key=lambda s: s["step_s"])  # the least disturbed by other jobs on the machine
    return {"fastest_step_s": fastest["step_s"], "fastest_step_gen_s": fastest["gen_s"],
            "fastest_step_train_s": fastest["train_s"],"before": start[0]["accuracy"] if start else None, "after": steps[-1]["accuracy"],
            "time_to_target_s": to_target, "target_step": at, "total_step_s": elapsed,
            **{f"median_{k}": v for k, v in med.items()}, "completions_per_s": completions / med["step_s"],
            "accuracy": [round(s["accuracy"], 3) for s in steps]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", action="store_true", help="install TRL (and Pillow) into .venv-trl and exit")
    p.add_argument("--tasks", nargs="+", default=["vlm_color", "vlm_count"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-n", type=int, default=200)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vlm_vs_trl.json"))
    ns = p.parse_args()
    if ns.setup:
        setup()
        return
    if not (TRL_VENV / "bin" / "python").exists():
        raise SystemExit(f"no TRL venv at {TRL_VENV}: run `python benchmarks/vlm_vs_trl.py --setup` first")
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                     "threads": ns.threads, "steps": ns.steps, "eval_n": ns.eval_n, "target": TARGET, "tasks": {}}
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        (tmp / "pictures").mkdir()
        for task_name in ns.tasks:
            spec = job_spec(task_name, ns.steps, ns.threads, ns.eval_n, tmp / "pictures")
            completions = len(spec["train"]) // ns.steps * spec["hparams"]["samples_per_prompt"]
            entry: dict = {"hparams": spec["hparams"], "longest_sequence": spec["longest_sequence"], "rounds": []}
            for rnd in range(ns.rounds):
                order = ["trl", "tidal"] if rnd % 2 == 0 else ["tidal", "trl"]
                row: dict = {"round": rnd + 1, "order": order}
                for who in order:
                    load = round(os.getloadavg()[0], 2)  # another job on the machine shows here
                    rec = run_trl(spec, tmp, "_trl_vlm_job.py") if who == "trl" else run_tidal(task_name, ns.steps, ns.threads,
                                                                            ns.eval_n, tmp)
                    row[who] = {**rec, "load_avg_1m_before": load, "summary": summarize(rec, completions)}
                    s = row[who]["summary"]
                    print(f"{task_name} round {rnd + 1} {who}: {s['before']} -> {s['after']}, to {TARGET} "
                          f"{s['time_to_target_s']} s (step {s['target_step']}), {s['median_step_s']:.2f} s/step "
                          f"(gen {s['median_gen_s']:.2f}, train {s['median_train_s']:.2f}), accuracy {s['accuracy']}",
                          flush=True)
                entry["rounds"].append(row)
                results["tasks"][task_name] = entry
                first = entry["rounds"][0]["trl"]
                results["versions"] = {k: first[k] for k in ("trl", "transformers", "torch")}
                write(results, ns.out)  # after every round: an interrupted run keeps its finished rounds
    print(table(results))


def write(results: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=1))


def table(results: dict) -> str:
    t = results["target"]
    lines = [(f"| task | round | run | held-out before → after | time to {t} (s) | at step | s/step | generate s | "
              f"train s | fastest step s | completions/s | tidal ÷ TRL (s/step) | TRL ÷ tidal (time to {t}) | load before |"),
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for task_name, entry in results["tasks"].items():
        for row in entry["rounds"]:
            trl = row["trl"]["summary"]
            for who in ("trl", "tidal"):
                s = row[who]["summary"]
                tt = s["time_to_target_s"]
                step_ratio = f"{s['median_step_s'] / trl['median_step_s']:.2f}" if who == "tidal" else ""
                ratio = (f"{trl['time_to_target_s'] / tt:.2f}×" if tt and trl["time_to_target_s"] else "—") \
                    if who == "tidal" else ""
                before = "—" if s["before"] is None else f"{s['before']:.3f}"
                lines.append(f"| {task_name} | {row['round']} | {'TRL' if who == 'trl' else 'tidal'} | "
                             f"{before} → {s['after']:.3f} | {tt if tt is None else round(tt, 2)} | "
                             f"{s['target_step']} | {s['median_step_s']:.2f} | {s['median_gen_s']:.2f} | "
                             f"{s['median_train_s']:.2f} | {s['fastest_step_s']:.2f} | {s['completions_per_s']:.0f} | "
                             f"{step_ratio} | {ratio} | {row[who]['load_avg_1m_before']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""The thread law of `tidal plan calibrate`: how much faster a torch training step and a rollout of a small
model run on 2 torch threads than on 1, on this machine, so that a calibration on one-thread Ray actors
(the async benchmark's) carries to a run whose process has two (the default job's driver).

    python benchmarks/plan_threads.py [--rounds 2] [--models async,default] [--out benchmarks/results/plan_threads.json]

Each measurement is a fresh process with `OMP_NUM_THREADS` and `torch.set_num_threads` at 1 or 2 (OpenMP
fixes a thread's team at its first parallel op, so one process never measures both), the two counts
alternating in rounds. A process times, after one untimed pass of each:
- train: `Trainer.forward_backward` + `optim_step` (float32, padded) on a GRPO-shaped batch (32 prompts x 8
  samples of the default task's prompts with long-tailed random completions: benchmarks/trainer.py's
  batch), at the model's micro-batch size (the async benchmark's 1024 tokens; the default job's 8192);
- rollout: the torch engine (`TorchEngine`, lean decode) generating 8 prompts x 8 samples with the
  model's stop token, up to 256 new tokens, every request seeded (the same lengths at both counts).
The law is Amdahl's: t(n) = t(1)·((1 − p) + p/n); p = 2·(1 − t(2)/t(1)) from the median ratio over the
rounds, one p for training and one for generation. tidal/plan/threads.py holds the p of the calibration
run's model (`async`: the 4M Qwen2 of benchmarks/async.py); `default` (the embedded 1M model) is
reported beside it, not used.

This machine is shared: run it where nothing else does, or say the load average (recorded per
process in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, os, sys, time
import torch
threads = int(sys.argv[1]); torch.set_num_threads(threads)
sys.path.insert(0, sys.argv[4])
from trainer import contender, make_batch
from pathlib import Path
from tidal.engines.torch_engine import TorchEngine
from tidal.envs.arithmetic import ArithmeticConfig, make_problems
from tidal.models import load_model, load_tokenizer, stop_token_ids
from tidal.types import GenerationRequest, SamplingParams

model_dir, micro = Path(sys.argv[2]), int(sys.argv[3])
load = os.getloadavg()[0]
batch = make_batch(model_dir)
step = contender("tidal", model_dir, micro)
tok = load_tokenizer(model_dir)
engine = TorchEngine(load_model(model_dir), tok.pad_token_id, max_batch_size=64)
stops = stop_token_ids(tok)
reqs = []
for i, row in enumerate(make_problems(ArithmeticConfig(), "test", 8, seed=0)):
    ids = tok(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    reqs += [GenerationRequest(f"{i}-{s}", ids, SamplingParams(max_new_tokens=256, temperature=1.0,
                                                               stop_token_ids=stops, seed=1000 + 8 * i + s))
             for s in range(8)]
step(batch); engine.generate_sync(reqs)  # warm-up
t = time.perf_counter(); step(batch); step(batch); train = (time.perf_counter() - t) / 2
t = time.perf_counter(); out = engine.generate_sync(reqs); out = engine.generate_sync(reqs)
rollout = (time.perf_counter() - t) / 2
engine.close()
print(json.dumps({"threads": threads, "torch_threads": torch.get_num_threads(), "train_s": train,
                  "rollout_s": rollout, "generated": sum(len(r.token_ids) for r in out),
                  "load_before": load, "load_after": os.getloadavg()[0]}))
"""


def child(threads: int, model_dir: Path, micro: int, timeout_s: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    p = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(model_dir), str(micro), str(HERE)],
                       check=False, capture_output=True, text=True, env=env, timeout=timeout_s)
    if p.returncode:
        raise RuntimeError(f"thread measurement ({threads} threads, {model_dir}) failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def amdahl_p(ratio: float, n: int = 2) -> float:
    """The parallel fraction p of t(n)/t(1) = (1 - p) + p/n."""
    return (1.0 - ratio) / (1.0 - 1.0 / n)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--models", default="async,default")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--out", default="benchmarks/results/plan_threads.json")
    ns = p.parse_args()
    import importlib.util

    spec = importlib.util.spec_from_file_location("tidal_async_bench", HERE / "async.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    from tidal.models import DEFAULT_MODEL_DIR

    out: dict = {"command": "python benchmarks/plan_threads.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
                 "nice": os.nice(0), "models": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tidal-plan-threads-") as tmp:
        models = {"async": (lambda: ab.build_long_tail_model(Path(tmp) / "async"), 1024),
                  "default": (lambda: Path(DEFAULT_MODEL_DIR), 8192)}
        for name in ns.models.split(","):
            build, micro = models[name]
            model_dir = build()
            runs = []
            for rnd in range(ns.rounds):
                for n in ((1, 2) if rnd % 2 == 0 else (2, 1)):
                    r = child(n, model_dir, micro, ns.timeout_s)
                    r["round"] = rnd + 1
                    runs.append(r)
                    print(name, r, flush=True)
            res = {}
            for part in ("train_s", "rollout_s"):
                ratios = [next(r[part] for r in runs if r["round"] == k and r["threads"] == 2)
                          / next(r[part] for r in runs if r["round"] == k and r["threads"] == 1)
                          for k in range(1, ns.rounds + 1)]
                med = statistics.median(ratios)
                res[part] = {"t2_over_t1": ratios, "median": med, "amdahl_p": amdahl_p(med)}
            out["models"][name] = {"micro_batch_tokens": micro, "runs": runs, "law": res}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(ns.out).write_text(json.dumps(out, indent=1))
    for name, m in out["models"].items():
        for part, r in m["law"].items():
            print(f"{name} {part}: t(2)/t(1) {r['median']:.3f} (rounds {', '.join(f'{x:.3f}' for x in r['t2_over_t1'])}), "
                  f"Amdahl p {r['amdahl_p']:.3f}")
    print(f"written to {ns.out} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()

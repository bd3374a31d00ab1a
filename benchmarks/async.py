"""Samples/s of the asynchronous loop at rollout.max_staleness k = 0, 1, 2, side by side in one process.

    python benchmarks/async.py [--rounds 2] [--warmup 2] [--measure 6] [--max-load 1.5]
                               [--out benchmarks/results/async.json]

Runs, one after another (the second round runs them in reverse order): k=0 (synchronous),
k=1, k=2, and k=2 with `algorithm.is_level=token` (the decoupled-PPO importance weight).
Each is `Controller(load_config(overrides)).train()` then `.close()`, with
`placement.mode=ray`: the trainer and the engine are Ray actors of one CPU each (torch
threads = 1), weights go by broadcast, and the driver runs the loop.

Workload: responses with long-tailed lengths. The embedded model stops after 5–26
tokens, so the benchmark builds a random-weight Qwen2 (hidden 256, 4 layers, the embedded
model's tokenizer, tied embeddings) whose stop token gets a constant logit bias (see
`build_long_tail_model`): lengths are geometric, capped at rollout.max_new_tokens=256.
8 prompts × 8 samples per step; `train.micro_batch_tokens=1024`, so that a micro-batch is
not padded to the batch's longest response. The reward (arithmetic) is zero for random
text: every advantage is zero, and the trainer still runs its full forward and backward
(`time/train_s`). Every run uses the same seed, prompts and weights (zero gradients leave
them as they are), so every run generates and trains on the same episodes.

Throughput: a run has `warmup + measure + 1` steps; samples/s = episodes of steps
warmup+1 .. warmup+measure / wall clock from the end of learning step `warmup` to the
end of step `warmup + measure`. The step after the window keeps the rollout thread
producing to its end (no pipeline drain inside it), and the last step's checkpoint lies
outside it. Before the first run the benchmark waits (up to --wait-s) for the 1-minute
load average to fall below --max-load, then measures how much parallel compute the
machine offers (`parallel_capacity`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

STOP_BIAS_CONSTANT = 3.0  # see build_long_tail_model
RUNS = [("k=0", 0, "none"), ("k=1", 1, "none"), ("k=2", 2, "none"), ("k=2, is_level=token", 2, "token")]


def build_long_tail_model(out: Path, hidden: int = 256, layers: int = 4, delta: float = 0.2, seed: int = 0) -> Path:
    """Save a Qwen2 with random weights whose stop token has a constant logit bias.

    A plain Qwen2 head has no bias term (and the directory must load as a normal HF model),
    so the bias is built from the embeddings: dimension 0 of every token embedding is set
    to a constant A, large against the other dimensions (init std 0.02), so every position
    carries about the same value h_0 there after the final RMSNorm. With tied embeddings the
    logit of token v gains h_0 · E[v, 0]: the same shift for every token (softmax ignores
    it) except the stop token, whose row holds A + delta, so its logit is raised by about
    h_0 · delta at every position. Without it a random model picks the stop token about
    once in 300 positions and nearly every response runs to the budget; with it the
    per-position stop probability is about constant and lengths are geometric. `delta`
    sets the mean; it was chosen by measuring (h_0 is whatever the random layers make it).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tidal.models import DEFAULT_MODEL_DIR, load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    (stop,) = stop_token_ids(tokenizer)  # <|im_end|>, also the tokenizer's EOS
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), max_position_embeddings=512,
        tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight  # tied: also the output head
        emb[:, 0] = STOP_BIAS_CONSTANT
        emb[stop, 0] = STOP_BIAS_CONSTANT + delta
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def wait_for_idle(max_load: float, wait_s: float) -> list[float]:
    """Sleep in 30 s steps until the 1-minute load average is below max_load (or wait_s
    has passed); return the load averages seen."""
    seen = [os.getloadavg()[0]]
    deadline = time.monotonic() + wait_s
    while seen[-1] >= max_load and time.monotonic() < deadline:
        print(f"load average {seen[-1]:.2f} ≥ {max_load}: waiting 30 s", flush=True)
        time.sleep(30)
        seen.append(os.getloadavg()[0])
    return seen


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent busy since boot (every process, from /proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def parallel_capacity(iters: int = 300) -> float:
    """Matrix products per second of two single-threaded processes at once, over one alone:
    2.0 when the machine gives two processes a core each (the best case for overlapping
    an engine and a trainer), less when its cores are busy or are hyperthreads of one."""
    import subprocess
    import sys

    code = ("import time, torch; torch.set_num_threads(1); a = torch.randn(512, 512); a @ a; t = time.perf_counter()\n"
            f"for _ in range({iters}): a @ a\nprint(time.perf_counter() - t)")
    run = lambda n: [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
                     for _ in range(n)]
    alone = float(run(1)[0].communicate()[0])
    both = [float(p.communicate()[0]) for p in run(2)]
    return 2 * alone / statistics.fmean(both)


def overrides(model_dir: Path, run_dir: Path, k: int, is_level: str, steps: int) -> list[str]:
    return [
        f"model.path={model_dir}", f"run.dir={run_dir}", f"train.steps={steps}", f"rollout.max_staleness={k}",
        f"algorithm.is_level={is_level}", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=8",
        "rollout.max_new_tokens=256", "train.micro_batch_tokens=1024", "run.eval_every=0", "run.save_every=0",
        "run.write_episodes=false", "placement.mode=ray", "placement.trainer.num_cpus=1",
        "placement.engine.num_cpus=1", "engine.replicas=1", "placement.weight_sync=broadcast",
    ]


def run_one(name: str, k: int, is_level: str, model_dir: Path, run_dir: Path, warmup: int, measure: int) -> dict:
    import ray

    from tidal.config import load_config
    from tidal.runtime.controller import Controller

    steps = warmup + measure + 1
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    ctl = Controller(load_config(overrides=overrides(model_dir, run_dir, k, is_level, steps)))
    t_started = time.perf_counter()
    pids: dict[str, int] = {}
    learn_end: dict[int, float] = {}
    cpu: dict[int, dict[str, float]] = {}
    lengths: dict[int, list[int]] = {}
    learn = ctl._learn

    def timed_learn(sampled, **kw):  # when each step's learning (and its weight push) ends
        out = learn(sampled, **kw)
        learn_end[sampled.step] = time.perf_counter()
        cpu[sampled.step] = {role: cpu_seconds(pid) for role, pid in pids.items()}
        cpu[sampled.step]["machine"] = machine_busy_seconds()
        lengths[sampled.step] = [e.num_policy_tokens for e in sampled.episodes]
        return out

    ctl._learn = timed_learn
    try:
        pids.update(driver=os.getpid(), trainer=ctl.trainer.ranks[0].call("pid"),
                    engine=ctl.pusher.engine_handles[0].call("pid"))
        ctl.train()
    finally:
        ctl.close()
    if ray.is_initialized():
        raise RuntimeError(f"{name}: Ray is still running after Controller.close()")
    wall = time.perf_counter() - t0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    window = [m for m in metrics if warmup < m["step"] <= warmup + measure]
    mean = lambda key: statistics.fmean(m[key] for m in window)
    episodes = sum(m["episodes"] for m in window)
    seconds = learn_end[warmup + measure] - learn_end[warmup]
    # CPU seconds each process used per second of the window (1.0 = one core all the time).
    # Rest: Ray's own services and whatever else ran on the machine (other people's jobs).
    busy = {role: (cpu[warmup + measure][role] - cpu[warmup][role]) / seconds for role in [*pids, "machine"]}
    busy["rest"] = busy.pop("machine") - sum(busy.values())
    return {
        "name": name, "max_staleness": k, "is_level": is_level, "steps": steps,
        "measured_steps": [m["step"] for m in window], "episodes": episodes, "seconds": round(seconds, 3),
        "samples_per_s": episodes / seconds, "step_s": [round(m["time/step_s"], 3) for m in window],
        "trainer_wait_s": mean("time/trainer_wait_s"), "engine_wait_s": mean("time/engine_wait_s"),
        "overlap": mean("time/overlap"), "rollout_s": mean("time/rollout_s"), "train_s": mean("time/train_s"),
        "weight_sync_s": mean("time/weight_sync_s"), "staleness_mean": mean("staleness/mean"),
        "staleness_max": max(m["staleness/max"] for m in window),
        "lag_frac": {j: mean(f"staleness/lag{j}_frac") for j in range(k + 1)},
        "cores_used": busy, "grad_norm_max": max(m["grad_norm"] for m in window),
        "response_lengths": {m["step"]: lengths[m["step"]] for m in window},
        "start_s": round(t_started - t0, 1), "run_wall_s": round(wall, 1),
        "load_before": load_before, "load_after": os.getloadavg()[0],
    }


def length_stats(lengths: list[int], cap: int = 256) -> dict:
    s = sorted(lengths)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]
    return {"n": len(s), "mean": round(statistics.fmean(s), 1), "median": statistics.median(s), "p90": q(0.9),
            "p99": q(0.99), "max": s[-1], "truncated": sum(n >= cap for n in s)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2, help="repeats; odd rounds run the configurations in reverse order")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--measure", type=int, default=6)
    p.add_argument("--max-load", type=float, default=1.5, help="wait until the 1-minute load average is below this")
    p.add_argument("--wait-s", type=float, default=600.0, help="longest wait for the load to fall")
    p.add_argument("--out", default="benchmarks/results/async.json")
    ns = p.parse_args()

    loads = wait_for_idle(ns.max_load, ns.wait_s)
    capacity = parallel_capacity()
    print(f"load average {loads[-1]:.2f}; two processes compute {capacity:.2f}× one: starting", flush=True)
    t_start = time.perf_counter()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tidal-async-") as tmp:
        model_dir = build_long_tail_model(Path(tmp) / "model")
        order = [RUNS if r % 2 == 0 else RUNS[::-1] for r in range(ns.rounds)]
        total = sum(len(o) for o in order)
        for r, configs in enumerate(order):
            for name, k, is_level in configs:
                print(f"[{len(runs) + 1}/{total}] round {r + 1}: {name} "
                      f"({ns.warmup + ns.measure + 1} steps, load {os.getloadavg()[0]:.2f})", flush=True)
                res = run_one(name, k, is_level, model_dir, Path(tmp) / f"run{len(runs)}", ns.warmup, ns.measure)
                res["round"] = r + 1
                runs.append(res)
                print(f"  {res['samples_per_s']:.2f} samples/s over steps {res['measured_steps'][0]}-"
                      f"{res['measured_steps'][-1]} ({res['seconds']:.1f} s); rollout {res['rollout_s']:.2f} s, "
                      f"train {res['train_s']:.2f} s per step; cores used: "
                      + ", ".join(f"{role} {c:.2f}" for role, c in res["cores_used"].items())
                      + f"; run {res['run_wall_s']:.0f} s", flush=True)

    summary = []
    for name, k, is_level in RUNS:
        mine = [r for r in runs if r["name"] == name]
        avg = lambda key, rs=mine: statistics.fmean(r[key] for r in rs)
        summary.append({"name": name, "max_staleness": k, "is_level": is_level,
                        "samples_per_s": avg("samples_per_s"),
                        "samples_per_s_rounds": [r["samples_per_s"] for r in mine],
                        **{key: avg(key) for key in ("trainer_wait_s", "engine_wait_s", "overlap", "rollout_s",
                                                     "train_s", "weight_sync_s", "staleness_mean")},
                        "cores_used": {role: statistics.fmean(r["cores_used"][role] for r in mine)
                                       for role in mine[0]["cores_used"]},
                        "staleness_max": max(r["staleness_max"] for r in mine)})
    base = summary[0]["samples_per_s"]
    for s in summary:
        s["ratio_to_k0"] = s["samples_per_s"] / base
    sync = summary[0]
    bound = (sync["rollout_s"] + sync["train_s"]) / max(sync["rollout_s"], sync["train_s"])
    first = runs[0]
    one_step = first["response_lengths"][first["measured_steps"][0]]
    pooled = [n for ls in first["response_lengths"].values() for n in ls]
    same = all(r["response_lengths"] == first["response_lengths"] for r in runs)
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average_waited": loads, "parallel_capacity": capacity,
        "load_average_at_run_start": [r["load_before"] for r in runs],
        "workload": {"model": "random Qwen2, hidden 256, 4 layers, stop-token bias delta 0.2",
                     "prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 256,
                     "micro_batch_tokens": 1024, "placement": "ray, trainer 1 CPU, engine 1 CPU, broadcast"},
        "warmup_steps": ns.warmup, "measured_steps": ns.measure, "rounds": ns.rounds,
        "lengths_one_step": length_stats(one_step), "lengths_measured_steps": length_stats(pooled),
        "same_episodes_in_every_run": same, "speedup_bound_from_k0": bound,
        "wall_s": round(time.perf_counter() - t_start, 1), "summary": summary, "runs": runs,
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(out, indent=1))

    print(f"\nresponse lengths, one step ({len(one_step)} responses): {out['lengths_one_step']}")
    print(f"response lengths, {ns.measure} measured steps: {out['lengths_measured_steps']}; "
          f"same episodes in every run: {same}")
    print(f"k=0: rollout {sync['rollout_s']:.2f} s + train {sync['train_s']:.2f} s per step: "
          f"overlap can reach at most {bound:.2f}×")
    print("\n| run | samples/s (each round) | × k=0 | rollout / train (s/step) | trainer wait (s/step) | "
          "engine wait (s/step) | overlap | staleness mean / max | cores: trainer, engine, rest |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in summary:
        rounds = ", ".join(f"{x:.1f}" for x in s["samples_per_s_rounds"])
        c = s["cores_used"]
        print(f"| {s['name']} | {s['samples_per_s']:.2f} ({rounds}) | {s['ratio_to_k0']:.2f}× | "
              f"{s['rollout_s']:.2f} / {s['train_s']:.2f} | {s['trainer_wait_s']:.2f} | {s['engine_wait_s']:.2f} | "
              f"{s['overlap']:.2f} | {s['staleness_mean']:.2f} / {s['staleness_max']:.0f} | "
              f"{c['trainer']:.2f}, {c['engine']:.2f}, {c['rest']:.2f} |")
    print(f"\nwritten to {ns.out} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()

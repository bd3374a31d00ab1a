"""Where a step's learning stages run, measured on the default job's step.

    python benchmarks/step_threads.py [--rounds 3] [--steps 8] [--out benchmarks/results/step_threads.json]
                                      [section.key=value ...]

Two placements of the learning stages of a synchronous step (the batch and its advantages,
the update, the weight push, the metrics: `Controller._learn`):

- `trainer thread`: on a thread that ends with them (`on_own_thread`, tidal/trainer/threads.py),
  as tidal/runtime/controller.py runs them since commit fe5632e;
- `loop thread`: on the loop's own (main) thread, as before it. The update itself runs on the
  trainer's per-call thread either way.

Each placement runs as a `tidal train` process of the default job (train.steps=--steps,
no progress bar; any overrides given are added to both); the two alternate, their order
reversed every round. A round's ratio divides the loop-thread process's median `time/step_s`
(metrics.jsonl, steps 3 to --steps: the first two warm up) by the trainer-thread one's; the
same for `time/rollout_s` (the engine's decode, which the OpenMP team of the loop's thread
slows) and `time/train_s`. Medians, not means: on a shared machine a burst of other work
adds seconds to a few steps of one process, and a mean carries them into the ratio (the means
are in the JSON too, with every step's figures). A process per placement because an OpenMP
team stays with the thread that made it for the thread's life: one process cannot run both
cleanly.

How the loop-thread placement is selected: the library has no switch for it (none is added
for a benchmark). This script's child process replaces the name `on_own_thread` in
tidal.runtime.controller with a direct call, in that process only, and then runs
`tidal.cli.main(["train", ...])`; everything else is the ordinary command. Each child also
records the name of the thread its first `_learn` ran on, so the results show that the two
placements differed (a substitution that no longer took effect would show the same name twice).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLACEMENTS = ("trainer thread", "loop thread")
WARMUP_STEPS = 2  # steps 1-2 are left out: the first builds caches and allocator pools
CHILD_TIMEOUT_S = 900  # a default-job process of ~10 steps takes 20-60 s here; a hung one is killed


def child(placement: str, run_dir: str, steps: int, overrides: list[str]) -> int:
    """One `tidal train` of the default job with the learning stages where `placement` says."""
    import threading

    sys.path.insert(0, str(ROOT))  # this checkout's tidal, as `python -m tidal.cli` run from ROOT would
    from tidal.cli import main as tidal_main
    from tidal.runtime import controller

    if placement == "loop thread":  # the placement before fe5632e: _learn called on the loop's thread
        controller.on_own_thread = lambda fn, *args, **kwargs: fn(*args, **kwargs)
    seen: list[str] = []
    learn = controller.Controller._learn

    def recorded(self, *args, **kwargs):
        if not seen:
            seen.append(threading.current_thread().name)
        return learn(self, *args, **kwargs)

    controller.Controller._learn = recorded
    code = tidal_main(["train", f"run.dir={run_dir}", "run.progress=false", f"train.steps={steps}", *overrides])
    (Path(run_dir) / "learn_thread.json").write_text(json.dumps({"placement": placement, "thread": seen[0]}))
    return code


def run_placement(placement: str, steps: int, overrides: list[str], tmp: Path) -> dict:
    run = tmp / f"{placement.replace(' ', '-')}-{time.time_ns()}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", placement, "--run-dir", str(run),
           "--steps", str(steps), *overrides]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, timeout=CHILD_TIMEOUT_S)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds the whole process used (start-up included): work, and any OpenMP worker's spinning
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode:
        raise SystemExit(f"the {placement} run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in metrics if "time/step_s" in m and m["step"] > WARMUP_STEPS]
    if not timed:
        raise SystemExit(f"the {placement} run has no step after step {WARMUP_STEPS}: give --steps > {WARMUP_STEPS}")
    keys = ("step_s", "rollout_s", "train_s")
    per_step = {k: [m[f"time/{k}"] for m in timed] for k in keys}
    thread = json.loads((run / "learn_thread.json").read_text())["thread"]
    return {"placement": placement, "learn_thread": thread, "steps": [m["step"] for m in timed], "process_cpu_s": cpu_s,
            **{k: statistics.median(v) for k, v in per_step.items()},
            **{f"mean_{k}": statistics.fmean(v) for k, v in per_step.items()}, "per_step": per_step}


def table(rounds: list[dict]) -> str:
    head = ("| round | order | median step s (trainer / loop thread) | rollout s | train s | process CPU s "
            "| step ratio loop/trainer | rollout ratio |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(rounds, 1):
        t, lo = r["trainer thread"], r["loop thread"]
        lines.append(f"| {i} | {r['order'][0]} first | {t['step_s']:.3f} / {lo['step_s']:.3f} | "
                     f"{t['rollout_s']:.3f} / {lo['rollout_s']:.3f} | {t['train_s']:.3f} / {lo['train_s']:.3f} | "
                     f"{t.get('process_cpu_s', float('nan')):.0f} / {lo.get('process_cpu_s', float('nan')):.0f} | "
                     f"{r['step_ratio']:.2f} | {r['rollout_ratio']:.2f} |")
    step, rollout = (statistics.median(r[k] for r in rounds) for k in ("step_ratio", "rollout_ratio"))
    lines.append(f"| median | | | | | | {step:.2f} | {rollout:.2f} |")
    return "\n".join(lines)


def write(ns: argparse.Namespace, rounds: list[dict]) -> None:
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "steps": ns.steps, "overrides": ns.overrides, "rounds": rounds,
              "median_step_ratio": statistics.median(r["step_ratio"] for r in rounds),
              "median_rollout_ratio": statistics.median(r["rollout_ratio"] for r in rounds),
              "median_mean_step_ratio": statistics.median(r["mean_step_ratio"] for r in rounds)}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1))
    Path(ns.out).with_suffix(".md").write_text(table(rounds) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="steps per process (the first 2 are not timed)")
    p.add_argument("--out", default="benchmarks/results/step_threads.json")
    p.add_argument("--child", choices=PLACEMENTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="section.key=value, for both placements")
    ns = p.parse_args()
    if ns.child:
        sys.exit(child(ns.child, ns.run_dir, ns.steps, ns.overrides))
    rounds = []
    with tempfile.TemporaryDirectory(prefix="tidal-step-threads-") as tmp:
        for i in range(ns.rounds):
            order = PLACEMENTS if i % 2 == 0 else PLACEMENTS[::-1]
            res = {name: run_placement(name, ns.steps, ns.overrides, Path(tmp)) for name in order}
            t, lo = res["trainer thread"], res["loop thread"]
            if t["learn_thread"] == lo["learn_thread"]:
                raise SystemExit(f"both placements ran _learn on thread {t['learn_thread']!r}: the loop-thread "
                                 "substitution no longer takes effect (see this file's docstring)")
            rounds.append({"order": list(order), **res, "step_ratio": lo["step_s"] / t["step_s"],
                           "rollout_ratio": lo["rollout_s"] / t["rollout_s"], "train_ratio": lo["train_s"] / t["train_s"],
                           "mean_step_ratio": lo["mean_step_s"] / t["mean_step_s"],
                           "load_avg_1min": os.getloadavg()[0]})  # the machine's other work, said beside the figures
            print(f"round {i + 1}: step {t['step_s']:.3f} s (trainer thread) vs {lo['step_s']:.3f} s (loop thread), "
                  f"ratio {rounds[-1]['step_ratio']:.2f} (load {rounds[-1]['load_avg_1min']:.1f})", file=sys.stderr,
                  flush=True)
            write(ns, rounds)  # after every round: a run cut short keeps the rounds it finished
    print(table(rounds))


if __name__ == "__main__":
    main()

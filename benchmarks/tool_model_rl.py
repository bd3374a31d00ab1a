"""Held-out success of a tiny tool model before and after a short GRPO run, on `tool_arith` and
on two environments it was never built on (examples/unit_convert.yaml,
examples/train_lookup.yaml): the check docs/agents.md ("Tools the model never saw") asks of a
general tool model (the embedded `default-tool`, `--model tidal/models/assets/tiny-tool-general`,
or a rebuild of it: `tidal build-general-tool-model --out DIR`, then `--model DIR`).

    python benchmarks/tool_model_rl.py [--steps N] [--n N] [--k K] [--out DIR] [--model DIR]
        [--envs a,b] [--set section.key=value ...]

Per environment, with the CLI a user runs: `tidal eval MODEL CONFIG` (greedy accuracy and
pass@k on `--n` held-out problems), `tidal train CONFIG` for `--steps` GRPO steps (`--set`:
more overrides for the run, such as `rollout.prompts_per_step=8`), then `tidal eval` of the
final checkpoint. The environments run at once, one process (and one torch thread) each.
Prints a markdown table and writes `results.json` under `--out` (each environment's result as
soon as it is done, so a stopped run keeps what it finished).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENVS = {"tool_arith": "examples/tool_arith.yaml", "unit_convert": "examples/unit_convert.yaml",
        "train_lookup": "examples/train_lookup.yaml"}
TIMEOUT_S = 3 * 3600  # one environment's eval, train and eval; a hung child is killed, not waited on
DEFAULT_MODEL = ROOT / "tidal" / "models" / "assets" / "tiny-tool"  # or a general build's directory


def tidal(*args: str, timeout: float) -> str:
    out = subprocess.run([sys.executable, "-m", "tidal.cli", *args], check=False, cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"tidal {' '.join(args)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return out.stdout


def sampled_call_errors(run: Path, first: int, last: int) -> float | None:
    """The tool-call error rate of the run's sampled turns over steps `first..last` (metrics.jsonl)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if first <= r.get("step", -1) <= last and "tools/calls" in r]
    calls = sum(r["tools/calls"] for r in rows)
    return None if not calls else round(sum(r["tools/calls"] * r["tools/error_rate"] for r in rows) / calls, 3)


def one(env: str, config: str, ns: argparse.Namespace) -> dict:
    t0 = time.time()
    evals = [f"eval.n={ns.n}", f"eval.k={ns.k}", f"task.eval_size={ns.n}", "run.threads=1"]
    before = json.loads(tidal("eval", ns.model, config, *evals, "--json", timeout=TIMEOUT_S).splitlines()[-1])
    run = Path(ns.out).resolve() / env
    t1 = time.time()
    tidal("train", config, f"model.path={ns.model}", f"train.steps={ns.steps}", f"run.dir={run}", "run.eval_every=0",
          "run.progress=false", f"task.eval_size={ns.n}", *ns.set, timeout=TIMEOUT_S)
    train_s = time.time() - t1
    ckpt = run / "checkpoints" / f"step_{ns.steps:06d}"
    after = json.loads(tidal("eval", str(ckpt), *evals, "--json", timeout=TIMEOUT_S).splitlines()[-1])
    few = min(3, ns.steps)
    return {"env": env, "config": config, "model": ns.model, "steps": ns.steps, "set": ns.set, "before": before,
            "after": after, "call_errors_first": sampled_call_errors(run, 1, few),
            "call_errors_last": sampled_call_errors(run, ns.steps - few + 1, ns.steps),
            "train_s": round(train_s, 1), "wall_s": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--out", default="runs/tool-model-rl")
    ap.add_argument("--envs", default=",".join(ENVS), help="comma-separated subset of " + ", ".join(ENVS))
    ap.add_argument("--set", nargs="*", default=[], help="more overrides for the GRPO runs (section.key=value)")
    ns = ap.parse_args()
    envs = ns.envs.split(",")
    if set(envs) - set(ENVS):
        ap.error(f"--envs: unknown {sorted(set(envs) - set(ENVS))}; known: {', '.join(ENVS)}")
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    done: dict[str, dict] = {}
    lock = threading.Lock()

    def run_one(env: str) -> dict:
        res = one(env, ENVS[env], ns)
        with lock:
            done[env] = res
            (Path(ns.out) / "results.json").write_text(json.dumps([done[e] for e in envs if e in done], indent=1))
        return res

    with ThreadPoolExecutor(len(envs)) as pool:
        results = list(pool.map(run_one, envs))
    print(f"| environment | greedy before | pass@{ns.k} before | greedy after {ns.steps} steps | "
          f"pass@{ns.k} after | call errors, first → last 3 steps | GRPO time |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        b, a = r["before"], r["after"]
        print(f"| {r['env']} | {b['accuracy']:.3f} | {b['pass_at_k']:.3f} | {a['accuracy']:.3f} | "
              f"{a['pass_at_k']:.3f} | {r['call_errors_first']} → {r['call_errors_last']} | {r['train_s']:.0f} s |")


if __name__ == "__main__":
    main()

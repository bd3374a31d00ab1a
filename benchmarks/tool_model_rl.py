"""Held-out success of the embedded tiny tool model before and after a short GRPO run, on
`tool_arith` (in its warm start) and on two environments it was never built on
(examples/unit_convert.yaml, examples/train_lookup.yaml): the numbers in docs/agents.md.

    python benchmarks/tool_model_rl.py [--steps N] [--n N] [--k K] [--out DIR] [--model DIR]

Per environment, with the CLI a user runs: `tidal eval MODEL CONFIG` (greedy accuracy and
pass@k on `--n` held-out problems), `tidal train CONFIG` for `--steps` GRPO steps, then
`tidal eval` of the final checkpoint. The three environments run at once, one process (and
one torch thread) each. Prints a markdown table and writes `results.json` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENVS = {"tool_arith": "examples/tool_arith.yaml", "unit_convert": "examples/unit_convert.yaml",
        "train_lookup": "examples/train_lookup.yaml"}
TIMEOUT_S = 3 * 3600  # one environment's eval, train and eval; a hung child is killed, not waited on


def tidal(*args: str, timeout: float) -> str:
    out = subprocess.run([sys.executable, "-m", "tidal.cli", *args], check=False, cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"tidal {' '.join(args)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return out.stdout


def one(env: str, config: str, ns: argparse.Namespace) -> dict:
    t0 = time.time()
    evals = [f"eval.n={ns.n}", f"eval.k={ns.k}", f"task.eval_size={ns.n}", "run.threads=1"]
    before = json.loads(tidal("eval", ns.model, config, *evals, "--json", timeout=TIMEOUT_S).splitlines()[-1])
    run = Path(ns.out).resolve() / env
    tidal("train", config, f"model.path={ns.model}", f"train.steps={ns.steps}", f"run.dir={run}", "run.eval_every=0",
          "run.progress=false", f"task.eval_size={ns.n}", timeout=TIMEOUT_S)
    ckpt = run / "checkpoints" / f"step_{ns.steps:06d}"
    after = json.loads(tidal("eval", str(ckpt), *evals, "--json", timeout=TIMEOUT_S).splitlines()[-1])
    return {"env": env, "config": config, "before": before, "after": after, "wall_s": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--model", default=str(ROOT / "tidal" / "models" / "assets" / "tiny-tool"))
    ap.add_argument("--out", default="runs/tool-model-rl")
    ns = ap.parse_args()
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(len(ENVS)) as pool:
        results = list(pool.map(lambda kv: one(kv[0], kv[1], ns), ENVS.items()))
    (Path(ns.out) / "results.json").write_text(json.dumps(results, indent=1))
    print(f"| environment | greedy before | pass@{ns.k} before | greedy after {ns.steps} steps | "
          f"pass@{ns.k} after | wall |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        b, a = r["before"], r["after"]
        print(f"| {r['env']} | {b['accuracy']:.3f} | {b['pass_at_k']:.3f} | {a['accuracy']:.3f} | "
              f"{a['pass_at_k']:.3f} | {r['wall_s']:.0f} s |")


if __name__ == "__main__":
    main()

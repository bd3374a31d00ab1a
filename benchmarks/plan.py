"""`tidal plan` against tidal's own runs: calibrate the simulator on one run, predict runs it did not see.

    python benchmarks/plan.py [--steps 7] [--default-steps 20] [--max-load 1.5] [--out benchmarks/results/plan.json]

1. The async benchmark's workload (`benchmarks/async.py`: a random 4M Qwen2 with long-tailed lengths, Ray,
   trainer and engine one CPU each, broadcast sync) at k=0 with the episode store on: the calibration run.
   Then k=1 and k=2, measured the same way (samples/s over the steps after the warm-up).
   `tidal.plan.calibrate` fits the k=0 run; the simulator predicts samples/s at k=0, 1, 2; the ratios
   k/k0 predicted and measured are printed side by side.
2. The default job, local (one process) and on Ray (`examples/ray/local_fsdp.yaml`: 2 FSDP ranks + 2
   engines): calibrated on the local run, the simulator predicts the Ray run's mean step time; calibrated
   on the async k=0 run (another model, another batch), it predicts the local default job's step time.
Every run is on this machine one after another, so ratios are compared, not seconds across machines.
A calibration carries each role's torch threads (from the run's config: Ray actors round(num_cpus), a local
run the machine's cores) and a prediction scales them to the predicted run's by the law of
tidal/plan/threads.py (measured by benchmarks/plan_threads.py): the async actors compute on one thread, the
default job's driver on two.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent


def _async_bench():
    spec = importlib.util.spec_from_file_location("tidal_async_bench", HERE / "async.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train(overrides: list[str], config: str | None = None) -> None:
    from tidal.config import load_config
    from tidal.runtime.controller import Controller

    ctl = Controller(load_config(config, overrides))
    try:
        ctl.train()
    finally:
        ctl.close()


def measured(run_dir: Path, warmup: int) -> dict:
    ms = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ms = [m for m in ms if "time/elapsed_s" in m]
    window = [m for m in ms if m["step"] > warmup]
    seconds = ms[-1]["time/elapsed_s"] - ms[warmup - 1]["time/elapsed_s"]
    return {"samples_per_s": sum(m["episodes"] for m in window) / seconds, "step_s": seconds / len(window),
            "rollout_s": statistics.fmean(m["time/rollout_s"] for m in window),
            "train_s": statistics.fmean(m["time/train_s"] for m in window),
            "sync_s": statistics.fmean(m["time/weight_sync_s"] for m in window)}


def predict(calib: dict, cfg: dict, devices: dict, steps: int, workload_run: Path | None = None,
            cores: int | None = None) -> dict:
    from tidal.plan.calibrate import spec_for_run
    from tidal.plan.loop import simulate
    from tidal.plan.report import summarize
    from tidal.plan.spec import load_spec

    s = summarize(simulate(load_spec(data=spec_for_run(calib, cfg, devices, steps, workload_run, cores=cores))))
    return {"samples_per_s": s.samples_per_s, "step_s": s.step_s, "rollout_s": s.rollout_s, "train_s": s.train_s,
            "sync_s": s.sync_s}


def save(out: dict, path: str) -> None:
    """Written after every run, so a stopped benchmark keeps what it measured."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1, default=float))


def run_all(root: Path, ns, out: dict) -> None:
    """The runs, one after another, into root/async-k{0,1,2} and root/default-{local,ray}."""
    ab = _async_bench()
    out["load_average_waited"] = ab.wait_for_idle(ns.max_load, ns.wait_s)
    model = ab.build_long_tail_model(root / "model")
    for k in (0, 1, 2):
        ov = ab.overrides(model, root / f"async-k{k}", k, "none", ns.steps)
        ov = [o for o in ov if not o.startswith("run.write_episodes")] + ["run.write_episodes=true"]
        print(f"async k={k} (load {os.getloadavg()[0]:.1f})", flush=True)
        train(ov)
    for name, conf in (("local", None), ("ray", "examples/ray/local_fsdp.yaml")):
        print(f"default job, {name} (load {os.getloadavg()[0]:.1f})", flush=True)
        train([f"run.dir={root / f'default-{name}'}", f"train.steps={ns.default_steps}", "run.progress=false",
               "run.eval_every=0", "run.save_every=0"], conf)


def compare(root: Path, out: dict) -> None:
    """Calibrate and predict from the runs under root (those present)."""
    import yaml

    from tidal.plan.calibrate import calibrate

    warm = 2
    cfg_of = lambda run: yaml.safe_load((run / "config.yaml").read_text())
    if (root / "async-k0").is_dir():
        calib = calibrate(root / "async-k0")
        out["async_calibration"] = {"fit": calib["fit"], "accelerator": calib["accelerator"],
                                    "efficiency": calib["efficiency"]}
        for k in (0, 1, 2):
            run = root / f"async-k{k}"
            if (run / "metrics.jsonl").is_file():
                dev = {"trainer_gpus": 1, "engine_gpus": 1, "colocate": False, "max_staleness": k,
                       "sync": "broadcast"}
                out["async"][k] = {"measured": measured(run, warm),
                                   "predicted": predict(calib, cfg_of(root / "async-k0"), dev, 40)}
    local, ray = root / "default-local", root / "default-ray"
    for name, run in (("local", local), ("ray", ray)):
        if (run / "metrics.jsonl").is_file():
            out["default"][name] = {"measured": measured(run, warm)}
    local_dev = {"trainer_gpus": 1, "engine_gpus": 1, "colocate": True, "max_staleness": 0, "sync": "inprocess"}
    ray_dev = {"trainer_gpus": 1, "engine_gpus": 2, "colocate": False, "max_staleness": 0, "sync": "broadcast"}
    if "local" in out["default"] and "ray" in out["default"]:
        calib_local = calibrate(local)
        out["default_calibration"] = {"fit": calib_local["fit"]}
        # the Ray run from the local run's calibration (the workload's lengths from the local run too)
        out["default"]["ray"]["predicted"] = predict(calib_local, cfg_of(ray), ray_dev, 20, local)
    if "local" in out["default"] and "async_calibration" in out:
        # the local run from the async k=0 run's calibration: another model and batch; the lengths the
        # default task generates taken from the Ray run (same task), never the predicted run's timings
        src = ray if (ray / "episodes").is_dir() else local
        out["default"]["local"]["predicted"] = predict(calib, cfg_of(local), local_dev, 20, src)


def recorded(path: Path, tmp: Path, out: dict) -> None:
    """The same comparison on a recorded `benchmarks/async.py` result (a quiet machine's): each round's
    k=0 run becomes a run directory (its per-step response lengths, its mean rollout, train and sync
    times: the benchmark records means, so the fit sees no per-step variation), is calibrated on, and
    predicts that round's k=1 and k=2 samples/s."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from tidal.plan.calibrate import calibrate

    rec = json.loads(path.read_text())
    ab = _async_bench()
    rows = []
    for rnd in sorted({r["round"] for r in rec["runs"]}):
        runs = {r["name"]: r for r in rec["runs"] if r["round"] == rnd}
        k0 = runs["k=0"]
        d = tmp / f"recorded-round{rnd}"
        (d / "episodes").mkdir(parents=True)
        model = tmp / "model"
        if not model.is_dir():
            ab.build_long_tail_model(model)
        # benchmarks/async.py's placement: trainer and engine Ray actors of one CPU (one torch thread) each
        cfg = {"model": {"path": str(model)}, "engine": {"replicas": 1},
               "placement": {"mode": "ray", "trainer": {"num_cpus": 1}, "engine": {"num_cpus": 1}},
               "rollout": {"prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 256}}
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
        lines = []
        for step, lengths in k0["response_lengths"].items():
            masks = [[False] * 30 + [True] * int(n) for n in lengths]  # 30: the arithmetic prompt's tokens
            pq.write_table(pa.table({"loss_mask": masks, "prompt_len": [30] * len(lengths)}),
                           d / "episodes" / f"step_{int(step):06d}.parquet")
            lines.append(json.dumps({"step": int(step), "time/rollout_s": k0["rollout_s"],
                                     "time/train_s": k0["train_s"], "time/weight_sync_s": k0["weight_sync_s"]}))
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        calib = calibrate(d, skip_steps=0, cores=RECORDED_CORES)
        pred = {}
        for k in (0, 1, 2):
            dev = {"trainer_gpus": 1, "engine_gpus": 1, "colocate": False, "max_staleness": k, "sync": "broadcast"}
            pred[k] = predict(calib, cfg, dev, 40, cores=RECORDED_CORES)["samples_per_s"]
        for k in (1, 2):
            rows.append({"round": rnd, "k": k,
                         "measured_ratio": runs[f"k={k}"]["samples_per_s"] / k0["samples_per_s"],
                         "predicted_ratio": pred[k] / pred[0]})
    out["recorded_async"] = rows


# the recorded runs' machine (benchmarks/results/async.json: "x86_64, 2 cores"): a local run's torch threads
RECORDED_CORES = 2

# BENCHMARKS.md, "Ray placement: the default job" (a quiet machine): mean step, train, rollout, sync (s)
RAY_PLACEMENT = {"local": {"step_s": 1.99, "train_s": 1.05, "rollout_s": 0.94, "sync_s": 0.001},
                 "ray": {"step_s": 1.98, "train_s": 1.22, "rollout_s": 0.65, "sync_s": 0.11}}


def recorded_default(episodes_run: Path, tmp: Path, out: dict) -> None:
    """The default job's recorded local and Ray runs (means only): the local run, as a run directory with
    the default job's episodes (`episodes_run`: any default-job run; the job is seeded, so its episodes
    are the recorded run's), is calibrated on and predicts the Ray run's step time; the async
    benchmark's recorded k=0 run (round 1, calibrated in `recorded`) predicts the local run's."""
    import shutil

    import yaml

    from tidal.plan.calibrate import calibrate
    from tidal.plan.threads import run_threads

    d = tmp / "recorded-default-local"
    shutil.copytree(episodes_run / "episodes", d / "episodes")
    steps = sorted(int(f.stem.split("_")[1]) for f in (d / "episodes").glob("step_*.parquet"))
    loc = RAY_PLACEMENT["local"]
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time/rollout_s": loc["rollout_s"],
                                                         "time/train_s": loc["train_s"],
                                                         "time/weight_sync_s": loc["sync_s"]}) + "\n"
                                             for s in steps))
    cfg = yaml.safe_load((episodes_run / "config.yaml").read_text())
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    calib_local = calibrate(d, skip_steps=0, cores=RECORDED_CORES)
    ray_yaml = yaml.safe_load((HERE.parent / "examples" / "ray" / "local_fsdp.yaml").read_text())
    ray_cfg = {**cfg, "engine": {**cfg["engine"], **ray_yaml["engine"]},
               "placement": {**cfg["placement"], **ray_yaml["placement"]}}
    ray_dev = {"trainer_gpus": 1, "engine_gpus": 2, "colocate": False, "max_staleness": 0, "sync": "broadcast"}
    rows = [{"run": "ray", "calibrated_on": "default job, local (recorded)", "measured_step_s":
             RAY_PLACEMENT["ray"]["step_s"], "predicted": predict(calib_local, ray_cfg, ray_dev, 20, d, RECORDED_CORES)}]
    calib_async = calibrate(tmp / "recorded-round1", skip_steps=0, cores=RECORDED_CORES)
    local_dev = {"trainer_gpus": 1, "engine_gpus": 1, "colocate": True, "max_staleness": 0, "sync": "inprocess"}
    rows.append({"run": "local", "calibrated_on": "async benchmark k=0 (recorded, round 1)",
                 "measured_step_s": loc["step_s"], "predicted": predict(calib_async, cfg, local_dev, 20, d, RECORDED_CORES),
                 "threads": {"calibration": calib_async["threads"], "predicted": run_threads(cfg, RECORDED_CORES)}})
    out["recorded_default"] = rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=7, help="steps of each async run (2 warm-up)")
    p.add_argument("--default-steps", type=int, default=12)
    p.add_argument("--max-load", type=float, default=1.5)
    p.add_argument("--wait-s", type=float, default=600.0)
    p.add_argument("--keep", default=None, help="run into this directory and keep it (default: a temporary one)")
    p.add_argument("--runs", default=None, help="do not run: calibrate and predict from the runs in this directory")
    p.add_argument("--recorded", default=None, help="also compare against a recorded benchmarks/async.py result "
                   "(e.g. benchmarks/results/async.json)")
    p.add_argument("--default-episodes", default=None, help="with --recorded: a default-job run directory whose "
                   "episodes stand for the recorded default job's (the job is seeded)")
    p.add_argument("--out", default="benchmarks/results/plan.json")
    ns = p.parse_args()
    out: dict = {"async": {}, "default": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tidal-plan-bench-") as tmp:
        root = Path(ns.runs or ns.keep or tmp)
        if not ns.runs:
            root.mkdir(parents=True, exist_ok=True)
            run_all(root, ns, out)
        compare(root, out)
        if ns.recorded:
            recorded(Path(ns.recorded), Path(tmp), out)
            if ns.default_episodes:
                recorded_default(Path(ns.default_episodes), Path(tmp), out)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    save(out, ns.out)
    a, d = out["async"], out["default"]
    if 0 in a:
        print("\n| run | measured samples/s | × k=0 measured | predicted samples/s | × k=0 predicted | "
              "error of the ratio |")
        print("| --- | --- | --- | --- | --- | --- |")
        for k in sorted(a):
            mr = a[k]["measured"]["samples_per_s"] / a[0]["measured"]["samples_per_s"]
            pr = a[k]["predicted"]["samples_per_s"] / a[0]["predicted"]["samples_per_s"]
            print(f"| async k={k} | {a[k]['measured']['samples_per_s']:.2f} | {mr:.2f} | "
                  f"{a[k]['predicted']['samples_per_s']:.2f} | {pr:.2f} | {pr / mr - 1:+.1%} |")
    if "recorded_async" in out:
        print(f"\nrecorded ({ns.recorded}): calibrated on each round's k=0 run")
        print("| round | k | measured × k=0 | predicted × k=0 | error |")
        print("| --- | --- | --- | --- | --- |")
        for r in out["recorded_async"]:
            print(f"| {r['round']} | {r['k']} | {r['measured_ratio']:.2f} | {r['predicted_ratio']:.2f} | "
                  f"{r['predicted_ratio'] / r['measured_ratio'] - 1:+.1%} |")
    if "recorded_default" in out:
        print("\n| recorded run | calibrated on | measured step (s) | predicted step (s) | error |")
        print("| --- | --- | --- | --- | --- |")
        for r in out["recorded_default"]:
            ps = r["predicted"]["step_s"]
            print(f"| default job, {r['run']} | {r['calibrated_on']} | {r['measured_step_s']:.2f} | {ps:.2f} | "
                  f"{ps / r['measured_step_s'] - 1:+.1%} |")
    rows = [(n, on) for n, on in (("ray", "default, local"), ("local", "async k=0")) if "predicted" in d.get(n, {})]
    if rows:
        print("\n| run | calibrated on | measured step (s) | predicted step (s) | error |")
        print("| --- | --- | --- | --- | --- |")
        for name, on in rows:
            ms, ps = d[name]["measured"]["step_s"], d[name]["predicted"]["step_s"]
            print(f"| default job, {name} | {on} | {ms:.2f} | {ps:.2f} | {ps / ms - 1:+.1%} |")
    print(f"\nwritten to {ns.out} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()

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


def predict(calib: dict, cfg: dict, devices: dict, steps: int) -> dict:
    from tidal.plan.calibrate import spec_for_run
    from tidal.plan.loop import simulate
    from tidal.plan.report import summarize
    from tidal.plan.spec import load_spec

    s = summarize(simulate(load_spec(data=spec_for_run(calib, cfg, devices, steps))))
    return {"samples_per_s": s.samples_per_s, "step_s": s.step_s, "rollout_s": s.rollout_s, "train_s": s.train_s,
            "sync_s": s.sync_s}


def save(out: dict, path: str) -> None:
    """Written after every run, so a stopped benchmark keeps what it measured."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1, default=float))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=7, help="steps of each async run (2 warm-up)")
    p.add_argument("--default-steps", type=int, default=12)
    p.add_argument("--max-load", type=float, default=1.5)
    p.add_argument("--wait-s", type=float, default=600.0)
    p.add_argument("--out", default="benchmarks/results/plan.json")
    ns = p.parse_args()
    import yaml

    from tidal.plan.calibrate import calibrate

    ab = _async_bench()
    loads = ab.wait_for_idle(ns.max_load, ns.wait_s)
    warm = 2
    out: dict = {"load_average_waited": loads, "async": {}, "default": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tidal-plan-bench-") as tmp:
        tmp = Path(tmp)
        model = ab.build_long_tail_model(tmp / "model")
        for k in (0, 1, 2):
            run = tmp / f"async-k{k}"
            ov = ab.overrides(model, run, k, "none", ns.steps)
            ov = [o for o in ov if not o.startswith("run.write_episodes")] + ["run.write_episodes=true"]
            print(f"async k={k} (load {os.getloadavg()[0]:.1f})", flush=True)
            train(ov)
            out["async"][k] = {"measured": measured(run, warm)}
            save(out, ns.out)
        calib = calibrate(tmp / "async-k0")
        out["async_calibration"] = {"fit": calib["fit"], "accelerator": calib["accelerator"]}
        cfg = yaml.safe_load((tmp / "async-k0" / "config.yaml").read_text())
        for k in (0, 1, 2):
            dev = {"trainer_gpus": 1, "engine_gpus": 1, "colocate": False, "max_staleness": k, "sync": "broadcast"}
            out["async"][k]["predicted"] = predict(calib, cfg, dev, 40)
        for name, conf in (("local", None), ("ray", "examples/ray/local_fsdp.yaml")):
            run = tmp / f"default-{name}"
            print(f"default job, {name} (load {os.getloadavg()[0]:.1f})", flush=True)
            train([f"run.dir={run}", f"train.steps={ns.default_steps}", "run.progress=false", "run.eval_every=0",
                   "run.save_every=0"], conf)
            out["default"][name] = {"measured": measured(run, warm)}
            save(out, ns.out)
        calib_local = calibrate(tmp / "default-local")
        out["default_calibration"] = {"fit": calib_local["fit"]}
        cfg_local = yaml.safe_load((tmp / "default-local" / "config.yaml").read_text())
        local_dev = {"trainer_gpus": 1, "engine_gpus": 1, "colocate": True, "max_staleness": 0, "sync": "inprocess"}
        ray_dev = {"trainer_gpus": 1, "engine_gpus": 2, "colocate": False, "max_staleness": 0, "sync": "broadcast"}
        out["default"]["ray"]["predicted"] = predict(calib_local, cfg_local, ray_dev, 20)
        out["default"]["local"]["predicted"] = predict(calib, cfg_local, local_dev, 20)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    save(out, ns.out)
    a = out["async"]
    print("\n| run | measured samples/s | × k=0 measured | predicted samples/s | × k=0 predicted | error of the ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in (0, 1, 2):
        mr = a[k]["measured"]["samples_per_s"] / a[0]["measured"]["samples_per_s"]
        pr = a[k]["predicted"]["samples_per_s"] / a[0]["predicted"]["samples_per_s"]
        print(f"| async k={k} | {a[k]['measured']['samples_per_s']:.2f} | {mr:.2f} | "
              f"{a[k]['predicted']['samples_per_s']:.2f} | {pr:.2f} | {pr / mr - 1:+.1%} |")
    d = out["default"]
    print("\n| run | calibrated on | measured step (s) | predicted step (s) | error |")
    print("| --- | --- | --- | --- | --- |")
    for name, on in (("ray", "default, local"), ("local", "async k=0")):
        ms, ps = d[name]["measured"]["step_s"], d[name]["predicted"]["step_s"]
        print(f"| default job, {name} | {on} | {ms:.2f} | {ps:.2f} | {ps / ms - 1:+.1%} |")
    print(f"\nwritten to {ns.out} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()

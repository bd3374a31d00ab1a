"""`tidal plan calibrate RUN_DIR`: the cost model's constants fitted to what a run measured, so that the
simulator's seconds are this machine's. From the run's `metrics.jsonl` (time/rollout_s, time/train_s,
time/weight_sync_s per step), its episode store (generated tokens of every episode: the decode
iterations and tokens of each step) and its model directory (parameter count and shapes):

- generation: rollout_s = a·iterations + b·tokens (+ c), least squares over the steps: a is the fixed
  cost of a decode iteration (on a small model on a CPU, Python and kernel launches), b the cost of one
  sequence's token in a batch (its FLOPs: the device's FLOP/s = 2·N / b);
- training: train_s = c0 + c1·tokens: c1 is 6·N / (FLOP/s · mfu_train), c0 a fixed step cost;
- sync: bytes / time_s of the weight sync.

The choice: the result is an accelerator (peak FLOP/s: the faster of the rates a decode token and a
trained token reached; the other as its efficiency) plus efficiency overrides, the same form as a GPU's table entry and
stated factors, so one simulator serves both. A CPU device is a number of torch threads: the calibration
records each role's (tidal/plan/threads.py, from the run's config), and `spec_for_run` scales each role's
rates to the predicted run's threads by the measured law there, so a one-thread actor's calibration
predicts a two-thread process. The run's trace.json, when present, only adds a check,
reported and not fitted: how far its `train` and `sync` spans are from the metrics' times (the train
span covers the forward and backward passes; time/train_s also counts building the batch).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import yaml

from tidal.models import resolve_model_dir
from tidal.monitor.episodes import episode_files, file_step
from tidal.plan.threads import AMDAHL_P, rate_scale, run_threads

FREE = 1e6  # how much faster than the measured rate a cost the fit found no trace of runs (see `device`)
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}


def model_shape(model_dir: Path) -> dict:
    """Parameters and shapes of a Hugging Face model directory, from its config and safetensors headers."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    params, nbytes = 0, 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                count = int(np.prod(t["shape"])) if t["shape"] else 1
                params += count
                nbytes += count * DTYPE_BYTES.get(t["dtype"], 4)
    heads = cfg.get("num_attention_heads", 1)
    return {"params": params, "bytes": nbytes, "layers": cfg.get("num_hidden_layers", 1),
            "hidden": cfg.get("hidden_size", 1), "kv_heads": cfg.get("num_key_value_heads", heads),
            "head_dim": cfg.get("head_dim") or cfg.get("hidden_size", 1) // heads}


def run_steps(run_dir: Path) -> list[dict]:
    """Per step: the metrics and, from the episode store, response lengths and prompt lengths."""
    import pyarrow.parquet as pq


    metrics = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "time/rollout_s" in m:
            metrics[m["step"]] = m
    lengths: dict[int, list[int]] = {}
    prompts: dict[int, list[int]] = {}
    for f in episode_files(run_dir / "episodes"):
        t = pq.read_table(f, columns=["loss_mask", "prompt_len"])
        s = file_step(f)
        masks = t.column("loss_mask").to_pylist()
        lengths.setdefault(s, []).extend(int(sum(x)) for x in masks)
        prompts.setdefault(s, []).extend(t.column("prompt_len").to_pylist())
    out = []
    for s in sorted(metrics):
        if s in lengths:
            out.append({"step": s, "metrics": metrics[s], "lengths": lengths[s], "prompts": prompts[s]})
    if not out:
        raise FileNotFoundError(f"{run_dir}: no step has both metrics (metrics.jsonl) and episodes (episodes/): "
                                f"calibration needs a run with run.write_episodes=true")
    return out


def _fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (columns whose coefficient comes out negative are
    dropped and the rest refitted: a cost cannot be negative)."""
    keep = list(range(x.shape[1]))
    while True:
        coef = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            full = np.zeros(x.shape[1])
            full[keep] = np.maximum(coef, 0)
            return full
        keep.pop(int(np.argmin(coef)))


def trace_check(run_dir: Path, steps: list[dict]) -> dict | None:
    """With `run.trace=true`: the largest relative difference, over the calibrated steps, between the
    trace's `train` and `sync` spans and the metrics' time/train_s and time/weight_sync_s (a large one
    says the batch building outside the train span, or another run's trace, is in the way). None
    without a trace."""
    path = run_dir / "trace.json"
    if not path.is_file():
        return None
    spans: dict[tuple[str, int], float] = {}
    for e in json.loads(path.read_text()).get("traceEvents", []):
        if e.get("ph") == "X" and e.get("name") in ("train", "sync") and "step" in e.get("args", {}):
            key = (e["name"], int(e["args"]["step"]))
            spans[key] = spans.get(key, 0.0) + e["dur"] / 1e6
    worst = 0.0
    for s in steps:
        for name, metric in (("train", "time/train_s"), ("sync", "time/weight_sync_s")):
            got, want = spans.get((name, s["step"])), s["metrics"].get(metric)
            if got is not None and want:
                worst = max(worst, abs(got - want) / want)
    return {"spans": len(spans), "max_rel_diff": worst}


def device(decode_rate: float, train_rate: float) -> tuple[float, float, float]:
    """(peak FLOP/s, mfu_decode, mfu_train) of a device whose decode and trained tokens reach these rates:
    the peak is the faster, each an efficiency of it. A rate the fit found no trace of (inf) is free: the
    peak is then FREE times the other rate, so that work costs a millionth of the other's per FLOP."""
    finite = [r for r in (decode_rate, train_rate) if math.isfinite(r)]
    if not finite:
        return 1e30, 1.0, 1.0
    flops = max(finite) * (FREE if len(finite) < 2 else 1.0)
    eff = lambda r: r / flops if math.isfinite(r) else 1.0
    return flops, eff(decode_rate), eff(train_rate)


def calibrate(run_dir: str | Path, skip_steps: int = 1, cores: int | None = None) -> dict:
    """Fit the constants; returns a dict with `accelerator` and `efficiency` overrides for a spec, the
    fitted coefficients, the residuals, the run's shape (model, batch) and its roles' torch threads
    (`cores`: of the machine that ran it, for a local run on torch's default; default: this machine's)."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a tidal run directory?)")
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    shape = model_shape(resolve_model_dir(cfg["model"]["path"]))
    steps = run_steps(run_dir)[skip_steps:] or run_steps(run_dir)
    replicas = int(cfg["engine"]["replicas"])
    iters = np.array([max(s["lengths"]) for s in steps], float)
    tokens = np.array([sum(s["lengths"]) for s in steps], float) / replicas
    rollout = np.array([s["metrics"]["time/rollout_s"] for s in steps])
    # A fixed cost is believed only where the times vary with the work: times that do not (a record of
    # means) are fitted as all variable, so that they scale with another model's or batch's work.
    flat = lambda y: np.std(y) <= 0.01 * np.mean(y)
    train_tok = np.array([sum(s["lengths"]) + sum(s["prompts"]) for s in steps], float)
    train = np.array([s["metrics"]["time/train_s"] for s in steps])
    tr = [float(x) for x in (_fit(np.c_[train_tok, np.ones_like(train_tok)], train) if not flat(train)
                             else [*_fit(train_tok[:, None], train), 0.0])]
    # the simulator prefills prompts at the training rate (a forward pass: a third of a trained token);
    # that share of the rollout is taken out before the decode costs are fitted, so it is not counted twice
    prefill = np.array([sum(s["prompts"]) for s in steps], float) / replicas * tr[0] / 3
    decode = np.maximum(rollout - prefill, 0.0)
    gen = [float(x) for x in (_fit(np.c_[iters, tokens, np.ones_like(iters)], decode) if not flat(rollout)
                              else [*_fit(np.c_[iters, tokens], decode), 0.0])]
    sync = float(np.median([s["metrics"].get("time/weight_sync_s", 0.0) for s in steps]))
    P = shape["params"]
    # FLOP/s a decode token and a trained token reached; a cost the fit found no trace of (all in the
    # fixed terms, e.g. a run whose times do not vary with its tokens) is free
    decode_rate = 2.0 * P / gen[1] if gen[1] > 1e-12 else math.inf
    train_rate = 6.0 * P / tr[0] if tr[0] > 1e-12 else math.inf
    flops, mfu_decode, mfu_train = device(decode_rate, train_rate)
    sync_bw = shape["bytes"] / sync if sync > 0 else 1e12
    predicted = gen[0] * iters + gen[1] * tokens + gen[2] + prefill
    return {
        "run": str(run_dir), "steps": len(steps),
        "model": {"params": P, "bytes": shape["bytes"], "layers": shape["layers"], "hidden": shape["hidden"],
                  "kv_heads": shape["kv_heads"], "head_dim": shape["head_dim"]},
        "fit": {"decode_iteration_s": gen[0], "token_s": gen[1], "rollout_fixed_s": gen[2],
                "train_token_s": tr[0], "train_fixed_s": tr[1], "sync_s": sync,
                "rollout_residual_rel": float(np.mean(np.abs(predicted - rollout) / rollout)),
                "train_residual_rel": float(np.mean(np.abs(tr[0] * train_tok + tr[1] - train) / train))},
        # the device as measured: decode FLOP/s at efficiency 1; memory traffic folded into the
        # per-iteration overhead (hbm_bw set high), links at the sync's measured rate
        "accelerator": {"bf16_flops": flops, "hbm_bw": 1e15, "hbm_bytes": 64e9, "nvlink_bw": sync_bw,
                        "nic_bw": sync_bw, "pcie_bw": 1e15, "link_latency_s": 0.0},
        # a prefilled token is a forward pass in one batch: the training rate's, not a decode step's
        "efficiency": {"mfu_decode": mfu_decode, "mfu_prefill": mfu_train, "mfu_train": mfu_train, "hbm": 1.0, "link": 1.0,
                       "decode_overhead_s": gen[0], "train_overhead_s": tr[1], "sync_overhead_s": 0.0,
                       "comm_overlap": 0.0},
        "rollout_fixed_s": gen[2],
        "rates": {"decode_flops": decode_rate, "train_flops": train_rate},
        "threads": run_threads(cfg, cores or os.cpu_count() or 1),
        "prompt_tokens": float(np.mean([np.mean(s["prompts"]) for s in steps])),
        "trace_check": trace_check(run_dir, steps),
    }


def scaled_device(calib: dict, trainer_threads: float, engine_threads: float,
                  law: dict[str, float] | None = None) -> tuple[dict, dict]:
    """The calibrated accelerator and efficiencies carried to a device of other torch thread counts (per
    modelled trainer device and per engine replica): each role's rates times the law's speed-up ratio
    (tidal/plan/threads.py). The law was measured on whole step and rollout times, so it scales a role's
    fixed per-iteration and per-step costs with its rates; the rollout's fixed part (the driver's scoring)
    is not scaled. Prefill runs on the engine at the training law (a batched forward)."""
    p = {**AMDAHL_P, **(law or {})}
    cal = calib["threads"]
    s_train = rate_scale(cal["trainer"], trainer_threads, p["train"])
    s_decode = rate_scale(cal["engine"], engine_threads, p["decode"])
    s_prefill = rate_scale(cal["trainer"], engine_threads, p["train"])
    rates = calib["rates"]
    flops, mfu_decode, mfu_train = device(rates["decode_flops"] * s_decode, rates["train_flops"] * s_train)
    prefill = rates["train_flops"] * s_prefill
    mfu_prefill = min(1.0, prefill / flops) if math.isfinite(prefill) else 1.0
    eff = {**calib["efficiency"], "mfu_decode": mfu_decode, "mfu_train": mfu_train, "mfu_prefill": mfu_prefill,
           "decode_overhead_s": calib["efficiency"]["decode_overhead_s"] / s_decode,
           "train_overhead_s": calib["efficiency"]["train_overhead_s"] / s_train}
    return {**calib["accelerator"], "bf16_flops": flops}, eff


def spec_for_run(calib: dict, cfg: dict, devices: dict, steps: int = 40, workload_run: str | Path | None = None,
                 cores: int | None = None, law: dict[str, float] | None = None) -> dict:
    """A spec (as a dict for `load_spec`) of a run shaped like `cfg` (a tidal config as a dict: its model,
    its batch, its placement's torch threads) on the calibrated device: `devices` gives the placement in
    devices (trainer_gpus, engine_gpus, colocate, max_staleness, sync). The device's rates follow the
    run's threads (`cores`: its machine's, for a local run; default this machine's) by `law` (default the
    measured one, tidal.plan.threads.AMDAHL_P). The workload's lengths (what the task makes the model
    generate, not a timing) are resampled from `workload_run`'s episode store (default: the calibration
    run's)."""

    r = cfg["rollout"]
    m = model_shape(resolve_model_dir(cfg["model"]["path"]))
    source = Path(workload_run or calib["run"])
    prompt = max(1, round(float(np.mean([np.mean(s["prompts"]) for s in run_steps(source)]))))
    threads = run_threads(cfg, cores or os.cpu_count() or 1)
    accelerator, efficiency = scaled_device(calib, threads["trainer"] / devices["trainer_gpus"],
                                            threads["engine"], law)
    return {
        "model": {"params_b": m["params"] / 1e9, "layers": m["layers"], "hidden": m["hidden"],
                  "kv_heads": m["kv_heads"], "head_dim": m["head_dim"],
                  "dtype_bytes": max(1, round(m["bytes"] / m["params"]))},
        "cluster": {"gpu": "H100", "gpus": devices["trainer_gpus"] + devices.get("engine_gpus", 0),
                    "gpus_per_node": 64, "accelerator": accelerator},
        "workload": {"prompts_per_step": r["prompts_per_step"], "samples_per_prompt": r["samples_per_prompt"],
                     "prompt_tokens": prompt, "prefix_sharing": False,
                     "lengths": {"kind": "parquet", "path": str(source / "episodes"),
                                 "max": r["max_new_tokens"]}},
        "placement": {"engine_tp": 1, **devices},
        "efficiency": {**efficiency, "rollout_overhead_s": calib["rollout_fixed_s"]},
        "failures": {"checkpoint_s": 0.0, "save_every": 10_000},
        "sim": {"steps": steps, "warmup_steps": 2, "chunks": 256},
    }

"""How many torch threads each role of a CPU run computed with, and how a calibrated CPU device's speed
follows that count: the part of a calibration that a GPU's table row does not need.

A calibration on a CPU measures a device of some number of torch threads: a Ray actor uses the cores it
reserved (`round(num_cpus)`, at least one: tidal/runtime/workers.py), a local run torch's default (one
thread per core) unless `run.threads` says otherwise. A prediction for a run whose processes have other
counts scales each role's rate by Amdahl's law, t(n) = t(1)·((1 − p) + p/n), with one parallel fraction p
for training and one for generation, measured on this machine by `benchmarks/plan_threads.py` (results:
benchmarks/results/plan_threads.json, BENCHMARKS.md "tidal plan"). The choice: a law with one measured
constant per role, not a fit to the run being predicted; the constants are this machine's and those of
models of a few million parameters (larger matmuls parallelize better), stated here and overridable.
"""

from __future__ import annotations

from typing import Any

# train: benchmarks/plan_threads.py on the async benchmark's 4M-parameter Qwen2 (the model the async
# calibration runs on), a training step at 1024-token micro-batches: t(2)/t(1) = 0.645 and 0.633 in two
# rounds (the embedded 1M model at 8192: 0.57 and 0.63), so p = 2·(1 − 0.639) = 0.72.
# decode: 0. A rollout of these models is Python and launches, not matmuls: the same benchmark measured
# two threads slower than one (t(2)/t(1) 1.4–2.3 on a loaded machine: the second thread waits for a
# core), and on a quiet machine the default job's rollout took 0.66 s at 2 threads and 0.69 s at 1
# (docs/engines.md), within its noise. No speed-up is the law both allow.
AMDAHL_P = {"train": 0.72, "decode": 0.0}


def speedup(threads: float, p: float) -> float:
    """t(1)/t(n) under Amdahl's law with parallel fraction p."""
    n = max(1.0, float(threads))
    return 1.0 / ((1.0 - p) + p / n)


def run_threads(cfg: dict[str, Any], cores: int) -> dict[str, float]:
    """Torch threads of the trainer (summed over its ranks: the simulator may model them as one device)
    and of one engine replica, from a run's config (as saved in its config.yaml) and the cores of the
    machine that ran it."""
    placement = cfg.get("placement") or {}
    run = cfg.get("run") or {}
    if placement.get("mode", "local") == "ray":
        per = lambda role: max(1, round(float((placement.get(role) or {}).get("num_cpus", 1.0))))
        ranks = int(placement.get("trainer_ranks", 1))
        engine = per("trainer") if placement.get("colocate") else per("engine")
        return {"trainer": float(per("trainer") * ranks), "engine": float(engine)}
    local = int(run.get("threads") or 0) or max(1, int(cores))
    return {"trainer": float(local), "engine": float(local)}


def rate_scale(calibrated: float, target: float, p: float) -> float:
    """Factor on a rate measured at `calibrated` threads for a device of `target` threads."""
    return speedup(target, p) / speedup(calibrated, p)

"""tidal plan: the simulator's invariants (episodes conserved, staleness within k, monotone where it must
be, k=0 equal to the synchronous formula), calibration recovering known costs, and the command's
outputs (trace.json in a real run's format, a plan config tidal loads, clear errors)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

pytest.importorskip("simpy")

from tidal.plan import cost
from tidal.plan.hardware import accelerator
from tidal.plan.loop import simulate
from tidal.plan.report import summarize
from tidal.plan.spec import PlanSpecError, load_spec
from tidal.plan.sync_model import sync_cost

MODEL = {"params_b": 7, "layers": 28, "hidden": 3584, "kv_heads": 4}


def spec(**sections):
    data = {"model": MODEL, "cluster": {"gpu": "H100", "gpus": 64},
            "workload": {"prompts_per_step": 32, "samples_per_prompt": 8, "prompt_tokens": 256,
                         "lengths": {"kind": "lognormal", "mean": 1024, "sigma": 1.0, "max": 8192}},
            "placement": {"trainer_gpus": 32, "engine_gpus": 32, "engine_tp": 1, "max_staleness": 1},
            "sim": {"steps": 30, "warmup_steps": 2}, "failures": {"checkpoint_s": 0.0, "save_every": 10}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return load_spec(data=data)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_episodes_are_conserved_and_staleness_stays_within_k(k):
    s = spec(placement={"max_staleness": k}, workload={"uninformative_frac": 0.3, "max_sampling_rounds": 3})
    r = simulate(s)
    assert [x.step for x in r.records] == list(range(1, 31))  # every step once, in order
    batch = 32 * 8
    for x in r.records:
        assert x.episodes == x.rounds * batch  # each DAPO round samples a whole batch
        assert x.trained <= batch and x.trained % 8 == 0  # whole groups, never more than asked
        assert 0 <= x.staleness_mean <= x.staleness_max <= k
        assert x.rollout_start >= 0 and x.train_start >= x.rollout_end  # a step trains on a finished rollout
    # the bound is reached, not just respected: training is slow here, so rollouts run k steps ahead
    short = {"lengths": {"kind": "fixed", "mean": 64, "max": 64}}
    slow = simulate(spec(workload=short, placement={"max_staleness": k, "trainer_gpus": 4, "engine_gpus": 60}))
    assert max(x.staleness_max for x in slow.records) == k


def test_admission_rule_is_what_bounds_staleness():
    """Positive control: the same run with a larger k goes past the smaller bound."""
    fast_engines = {"trainer_gpus": 4, "engine_gpus": 60}
    short = {"lengths": {"kind": "fixed", "mean": 64, "max": 64}}
    r2 = simulate(spec(workload=short, placement={"max_staleness": 2, **fast_engines}))
    assert max(x.staleness_max for x in r2.records) > 1


def test_k0_equals_the_synchronous_formula_on_a_deterministic_workload():
    L, prompt, n_ep = 512, 256, 32 * 8
    s = spec(workload={"lengths": {"kind": "fixed", "mean": L, "max": L}, "prefix_sharing": False},
             placement={"max_staleness": 0, "engine_gpus": 32}, sim={"steps": 12, "chunks": 64})
    r = simulate(s)
    hw = accelerator("H100")
    b = n_ep / 32  # episodes per replica, all decoding at once
    rollout = float(cost.prefill_s(np.array([b * prompt]), s.model, hw, s.efficiency, 1)[0]
                    + L * cost.decode_iter_s(np.array([b]), np.array([b * (prompt + L / 2)]), s.model, hw,
                                             s.efficiency, 1, 1)[0])
    train = cost.train_step_cost(n_ep * (prompt + L), prompt + L, s.model, hw, s.efficiency, s.cluster, 32, 1, 1,
                                 1).total_s
    sync = sync_cost(s.model, hw, s.efficiency, s.cluster, s.placement).total_s
    got = summarize(r)
    # exact up to float rounding: the chunks split L evenly and the cost is linear within one regime
    assert got.step_s == pytest.approx(rollout + train + sync, rel=1e-9)
    assert got.samples_per_s == pytest.approx(n_ep / (rollout + train + sync), rel=1e-9)


def test_async_overlaps_and_is_bounded_by_the_longer_stage():
    s0 = summarize(simulate(spec(placement={"max_staleness": 0})))
    s1 = summarize(simulate(spec(placement={"max_staleness": 1})))
    assert s1.samples_per_s > s0.samples_per_s
    # overlap can at best bring a step down to the longer of rollout and training (+ the sync)
    bound = s0.step_s / max(s0.rollout_s, s0.train_s + s0.sync_s)
    assert s1.samples_per_s / s0.samples_per_s <= bound * 1.001  # float rounding of sums over 28 steps


def test_monotone_in_bandwidth_and_gpu_count():
    by_bw = [summarize(simulate(spec(cluster={"accelerator": {"nic_bw": bw}},
                                     placement={"max_staleness": 0}))).samples_per_s for bw in (1e9, 5e9, 25e9)]
    assert by_bw[0] < by_bw[1] < by_bw[2]
    # more engine GPUs never slow the rollout (a deterministic workload: no sampling noise)
    fixed = {"lengths": {"kind": "fixed", "mean": 1024, "max": 1024}}
    by_gpus = [summarize(simulate(spec(workload=fixed, cluster={"gpus": 32 + n},
                                       placement={"engine_gpus": n, "max_staleness": 0}))).rollout_s
               for n in (8, 16, 32)]
    assert by_gpus[0] > by_gpus[1] > by_gpus[2]


def test_failures_lose_work_and_redo_steps():
    calm = simulate(spec(sim={"steps": 40}))
    s = spec(sim={"steps": 40}, failures={"node_mtbf_h": 1.0, "restart_s": 30.0, "save_every": 5})
    r = simulate(s)
    assert r.failures > 0 and r.lost_s > 0
    assert [x.step for x in r.records] == list(range(1, 41))  # every step completed once in the end
    assert r.wall_s > calm.wall_s + r.failures * 30.0 * 0.99
    assert r.wall_s == r.records[-1].learn_end  # the run ends with its last step, not at a failure drawn later
    # failures faster than checkpoints: the run cannot end, and the simulation says so instead of looping
    doomed = spec(failures={"node_mtbf_h": 0.01, "save_every": 10, "max_failures": 50})
    with pytest.raises(RuntimeError, match="too often for save_every=10"):
        simulate(doomed)


def test_trace_json_has_a_real_runs_format(tmp_path):
    from tidal.plan.trace_out import write_trace

    r = simulate(spec(sim={"steps": 3}))
    n = write_trace(r, tmp_path / "trace.json", max_episode_events=16)
    data = json.loads((tmp_path / "trace.json").read_text())
    events = data["traceEvents"]
    assert n == len(events) and data["displayTimeUnit"] == "ms"
    spans = {(e["name"], e["cat"]) for e in events if e["ph"] == "X"}
    # the names and categories tidal/runtime/controller.py records
    assert {("rollout", "generate"), ("train", "train"), ("sync", "sync")} <= spans
    begins = [e for e in events if e["ph"] == "b"]
    ends = {e["id"] for e in events if e["ph"] == "e"}
    assert len(begins) == 3 * 16 and {e["id"] for e in begins} == ends
    assert all(e["id"].startswith("s") and "-p" in e["id"] for e in begins)


def test_calibration_recovers_a_known_cost_law(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from tidal.plan.calibrate import calibrate

    rng = np.random.default_rng(0)
    a, b, c, t0, t1 = 0.004, 0.0005, 0.3, 0.2, 0.0002  # s/iteration, s/token, s/rollout, s/step, s/trained token
    (tmp_path / "episodes").mkdir()
    metrics = []
    for step in range(1, 9):
        lengths = rng.geometric(1 / 40, 64).clip(1, 256)
        masks = [[False] * 10 + [True] * int(n) for n in lengths]
        pq.write_table(pa.table({"loss_mask": masks, "prompt_len": [10] * 64}),
                       tmp_path / "episodes" / f"step_{step:06d}.parquet")
        prefill = 640 * t1 / 3  # the model's prefill: 64 prompts of 10 tokens, a forward pass each at the training rate
        metrics.append({"step": step, "time/rollout_s": a * lengths.max() + b * lengths.sum() + c + prefill,
                        "time/train_s": t0 + t1 * (lengths.sum() + 640), "time/weight_sync_s": 0.05})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"path": "default"}, "engine": {"replicas": 1}}))
    # a trace whose train spans are the metrics' timers, but for step 3's (20% longer)
    events = [{"name": "train", "ph": "X", "ts": 0, "dur": (m["time/train_s"] * (1.2 if m["step"] == 3 else 1)) * 1e6,
               "pid": 1, "tid": 1, "args": {"step": m["step"]}} for m in metrics]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    cal = calibrate(tmp_path, skip_steps=0)
    assert cal["trace_check"]["spans"] == 8 and cal["trace_check"]["max_rel_diff"] == pytest.approx(0.2)
    f = cal["fit"]
    assert f["decode_iteration_s"] == pytest.approx(a, rel=1e-6)
    assert f["token_s"] == pytest.approx(b, rel=1e-6)
    assert f["rollout_fixed_s"] == pytest.approx(c, rel=1e-6)
    assert f["train_token_s"] == pytest.approx(t1, rel=1e-6) and f["train_fixed_s"] == pytest.approx(t0, rel=1e-6)


def _one_thread_run(run_dir, t1: float):
    """A run of the default model on one-thread Ray actors whose training costs t1 s per token (prompts and
    responses) and whose rollout costs 2 ms per decode iteration."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    rng = np.random.default_rng(1)
    (run_dir / "episodes").mkdir()
    metrics = []
    for step in range(1, 7):
        lengths = rng.geometric(1 / 30, 64).clip(1, 128)
        masks = [[False] * 10 + [True] * int(n) for n in lengths]
        pq.write_table(pa.table({"loss_mask": masks, "prompt_len": [10] * 64}),
                       run_dir / "episodes" / f"step_{step:06d}.parquet")
        metrics.append({"step": step, "time/rollout_s": 0.002 * lengths.max() + 640 * t1 / 3,
                        "time/train_s": t1 * (lengths.sum() + 640), "time/weight_sync_s": 0.01})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    cfg = {"model": {"path": "default"}, "engine": {"replicas": 1},
           "rollout": {"prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 128},
           "placement": {"mode": "ray", "trainer": {"num_cpus": 1}, "engine": {"num_cpus": 1}}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    return cfg


def test_thread_counts_come_from_the_run_config():
    from tidal.plan.threads import run_threads

    ray = {"placement": {"mode": "ray", "trainer_ranks": 2, "trainer": {"num_cpus": 0.5}, "engine": {"num_cpus": 3}}}
    assert run_threads(ray, cores=16) == {"trainer": 2.0, "engine": 3.0}  # actors: round(num_cpus), at least 1
    assert run_threads({"placement": {"mode": "local"}, "run": {"threads": 0}}, cores=2) == {"trainer": 2.0, "engine": 2.0}
    assert run_threads({"run": {"threads": 3}}, cores=2) == {"trainer": 3.0, "engine": 3.0}


@pytest.mark.parametrize("p", [0.5, 0.72])
def test_calibration_carries_to_other_thread_counts_by_the_law(tmp_path, p):
    """Calibrated on one-thread actors, a two-thread local run of the same shape trains faster by exactly
    Amdahl's speed-up 1/((1-p) + p/2); the one-thread run itself is predicted unchanged."""
    from tidal.plan.calibrate import calibrate, spec_for_run
    from tidal.plan.threads import speedup

    t1 = 4e-4
    cfg = _one_thread_run(tmp_path, t1)
    cal = calibrate(tmp_path, skip_steps=0, cores=2)
    assert cal["threads"] == {"trainer": 1.0, "engine": 1.0}
    dev = {"trainer_gpus": 1, "engine_gpus": 1, "colocate": False, "max_staleness": 0, "sync": "broadcast"}
    law = {"train": p, "decode": 0.0}
    same = summarize(simulate(load_spec(data=spec_for_run(cal, cfg, dev, 8, cores=2, law=law))))
    local = {**cfg, "placement": {"mode": "local"}, "run": {"threads": 0}}
    two = summarize(simulate(load_spec(data=spec_for_run(cal, local, dev, 8, cores=2, law=law))))
    # the calibration reproduces its own run: t1 per trained token; 10% for the simulator's resampled
    # lengths (8 steps drawn from 6) and the causal attention FLOPs it adds (about 1%)
    per_step = [json.loads(x)["time/train_s"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert same.train_s == pytest.approx(np.mean(per_step), rel=0.1)
    # the law, to rounding: a broken scaling (none, or the wrong direction) is off by 1.33x or more
    assert same.train_s / two.train_s == pytest.approx(speedup(2, p), rel=1e-4)
    assert speedup(2, p) >= 1.33
    # the rollout changes by its prefill alone (64 prompts of 10 tokens at a third of t1, on the engine at
    # the training law): decode, at p = 0, does not change with the engine's threads
    assert same.rollout_s - two.rollout_s == pytest.approx(640 * t1 / 3 * (1 - 1 / speedup(2, p)), rel=1e-3)


def test_plan_config_loads_in_tidal(tmp_path):
    from tidal.config import load_config
    from tidal.plan.output import write_config
    from tidal.plan.search import search

    s = spec(search={"max_staleness": [0, 1], "trainer_fractions": [0.25, 0.5], "colocate": [False, True],
                     "engine_tp": [1, 2], "train_tp": [1, 2], "sync": ["broadcast", "shard"], "steps": 6})
    plans, _ = search(s, progress=False)
    assert len(plans) >= 8 and plans[0].summary.samples_per_s >= plans[-1].summary.samples_per_s
    for plan in plans[:4] + [x for x in plans if x.placement.train_tp == 2 and not x.placement.colocate][:1]:
        p = plan.placement
        path = write_config(s, plan, tmp_path / "plan.yaml")
        cfg = load_config(str(path))
        assert cfg.rollout.max_staleness == p.max_staleness
        assert cfg.placement.colocate == p.colocate
        # the trainer's mesh and the engines' tensor parallelism are tidal settings, not header notes
        assert cfg.placement.trainer_ranks == p.trainer_gpus and cfg.train.parallel.tp == p.train_tp
        assert cfg.engine.tensor_parallel == p.engine_tp
        if not p.colocate:
            want = {"shard": "shard", "broadcast": "slices" if p.engine_tp > 1 else "broadcast"}[p.sync]
            assert cfg.placement.weight_sync == want


def test_slices_sync_sends_each_engine_rank_its_share_from_rank_0():
    """tidal's `slices` transport: every engine rank of a TP g replica receives 1/g of the weights, trainer
    rank 0 sends the whole model to each replica (no relay): slower than shard-to-shard as replicas grow."""
    from tidal.plan.sync_model import expected_bytes

    b = expected_bytes(800.0, 4, 8, "slices")
    assert (b.per_engine_rank, b.per_trainer_rank, b.gathered) == (100.0, 800.0, 600.0)
    one = spec(placement={"engine_gpus": 8, "engine_tp": 8, "sync": "slices"})
    four = spec(placement={"engine_gpus": 32, "engine_tp": 8, "sync": "slices"})
    t = lambda x, tr=None: sync_cost(x.model, accelerator(x.cluster.gpu), x.efficiency, x.cluster, x.placement,
                                     tr).transfer_s
    assert t(four) == pytest.approx(4 * t(one))  # rank 0's link carries every replica's model
    assert t(four, "shard") < t(four)


def test_errors_name_the_key_and_the_missing_extra(tmp_path, monkeypatch, capsys):
    from tidal.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {params_b: 7, layers: 28, hidden: 3584}\ncluster: {gpus: 8, gpu_count: 3}\n")
    assert main(["plan", str(bad)]) == 2
    assert "cluster.gpu_count" in capsys.readouterr().err
    with pytest.raises(PlanSpecError, match="uses 16 GPUs"):
        spec(cluster={"gpus": 8}, placement={"trainer_gpus": 8, "engine_gpus": 8})
    with pytest.raises(PlanSpecError, match="not a multiple"):
        spec(placement={"engine_gpus": 12, "engine_tp": 8})
    monkeypatch.setitem(sys.modules, "simpy", None)  # as if the extra were not installed
    assert main(["plan", str(bad)]) == 2
    assert "pip install 'tidal[plan]'" in capsys.readouterr().err


def test_chunked_rollout_agrees_with_the_exact_one_turn_rollout():
    """The general (chunked, multi-turn) path against the exact one-turn pass on the same episodes: they
    differ only by the chunking of decode iterations."""
    from tidal.plan.rollout_model import simulate_rollout
    from tidal.plan.workload import LengthSampler, step_work

    s = spec()
    work = step_work(s.workload, LengthSampler(s.workload.lengths, 3), 32, np.random.default_rng(3))
    args = (work, 16, s.model, accelerator("H100"), s.efficiency, 1, 1, 512, 8, True)
    exact = simulate_rollout(*args)
    chunked = simulate_rollout(*args, chunks=512, exact_single_turn=False)
    assert exact.tokens == chunked.tokens == work.lengths.sum()
    # 512 chunks of a turn: a sequence's end is placed within 1/512 of the longest turn
    assert chunked.duration_s == pytest.approx(exact.duration_s, rel=0.01)
    assert np.allclose(np.sort(chunked.finish_s), np.sort(exact.finish_s), rtol=0.02)


def test_colocated_roles_take_turns():
    """On shared GPUs a rollout never runs while a handed-over step waits to be trained: k > 0 buys no
    overlap and no staleness; apart, the same k overlaps the two stages."""
    both = {"trainer_gpus": 64, "colocate": True, "sync": "inprocess"}
    r0, r1 = (simulate(spec(placement={**both, "max_staleness": k})) for k in (0, 1))
    assert summarize(r1).samples_per_s == pytest.approx(summarize(r0).samples_per_s, rel=1e-9)
    assert max(x.staleness_max for x in r1.records) == 0
    for a, b in zip(r1.records, r1.records[1:]):
        assert b.rollout_start >= a.sync_end  # the next rollout starts after this step's training and sync


def test_the_command_searches_writes_and_simulates(tmp_path, capsys):
    import yaml

    from tidal.cli import main

    data = {"model": MODEL, "cluster": {"gpu": "H100", "gpus": 16},
            "workload": {"prompts_per_step": 8, "samples_per_prompt": 4, "lengths": {"mean": 256, "max": 1024}},
            "placement": {"trainer_gpus": 8, "engine_gpus": 8, "max_staleness": 1},
            "sim": {"steps": 6},
            "search": {"max_staleness": [0, 1], "trainer_fractions": [0.5], "engine_tp": [1], "train_tp": [1],
                       "sync": ["broadcast"], "steps": 4}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", str(path), "--out", str(tmp_path / "out"), "--explain", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "1. " in out and "samples/s" in out and "A: " in out  # the best plans, and why one beats another
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"plan.yaml", "plan.png", "plans.json"}
    assert main(["plan", str(path), "--simulate", "--out", str(tmp_path / "sim")]) == 0
    trace = json.loads((tmp_path / "sim" / "trace.json").read_text())
    assert sum(e["name"] == "train" for e in trace["traceEvents"]) == 6


def test_prefix_sharing_and_env_workers_never_slow_a_rollout():
    """A group's prompt prefilled once costs no more than once per sample; more environment slots never
    lengthen a multi-turn rollout (the same seed: the same episodes and latencies)."""
    long_prompts = {"prompt_tokens": 4096}
    shared, unshared = (summarize(simulate(spec(workload={**long_prompts, "prefix_sharing": v},
                                                placement={"max_staleness": 0}))).rollout_s for v in (True, False))
    assert shared < unshared
    multi = {"turns": 3, "env_latency_s": 5.0, "env_concurrency": 4, "obs_tokens": 64,
             "lengths": {"kind": "lognormal", "mean": 256, "max": 2048}}
    by_workers = [summarize(simulate(spec(workload=multi, placement={"env_workers": n, "max_staleness": 0},
                                          sim={"steps": 6}))).rollout_s for n in (1, 8, 64)]
    assert by_workers[0] > by_workers[1] > by_workers[2]

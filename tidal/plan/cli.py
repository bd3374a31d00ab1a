"""`tidal plan`: the command-line face of the planner.

    tidal plan SPEC.yaml [--out DIR] [--explain] [--no-progress]     search placements, write the best
    tidal plan SPEC.yaml --simulate [--out DIR] [--steps N]          simulate the spec's own placement
    tidal plan calibrate RUN_DIR [--out CALIB.yaml]                  fit the cost model to a run

The simulator needs SimPy (`pip install 'tidal[plan]'`); without it the command says so and stops.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml


class MissingPlanExtra(RuntimeError):
    pass


def require_extra() -> None:
    try:
        import simpy  # noqa: F401
    except ImportError:
        raise MissingPlanExtra("tidal plan needs SimPy, in the `plan` extra: pip install 'tidal[plan]'") from None


def add_parser(sub) -> None:
    pp = sub.add_parser("plan", help="simulate a run on a cluster and choose its placement (pip install "
                        "'tidal[plan]'); `tidal plan calibrate RUN_DIR` fits the cost model to a run")
    pp.add_argument("target", help="SPEC.yaml, or `calibrate`")
    pp.add_argument("run_dir", nargs="?", help="calibrate: the run's directory")
    pp.add_argument("--out", default=None, help="where to write (default: plan/ beside the spec; calibrate: stdout)")
    pp.add_argument("--simulate", action="store_true", help="simulate the spec's placement only (no search)")
    pp.add_argument("--steps", type=int, default=None, help="steps to simulate (default: sim.steps)")
    pp.add_argument("--explain", action="store_true", help="say why the best plan beats the runner-up")
    pp.add_argument("--no-progress", action="store_true", help="no progress bar")
    pp.set_defaults(fn=cmd_plan, args=[])


def cmd_plan(ns: argparse.Namespace) -> int:
    require_extra()
    if ns.target == "calibrate":
        return _calibrate(ns)
    # The planner's modules import SimPy and matplotlib (the `plan` extra): loaded once
    # require_extra has said what to install when they are missing.
    from tidal.plan.spec import load_spec

    spec = load_spec(ns.target)
    out = Path(ns.out) if ns.out else Path(ns.target).with_suffix("").parent / (Path(ns.target).stem + "-plan")
    out.mkdir(parents=True, exist_ok=True)
    return _simulate(spec, out, ns.steps) if ns.simulate else _search(spec, out, ns)


def _print_summary(s) -> None:
    print(f"  {s.samples_per_s:.2f} samples/s, {s.tokens_per_s_per_gpu:.1f} generated tokens/s/GPU, "
          f"step {s.step_s:.2f} s (rollout {s.rollout_s:.2f}, train {s.train_s:.2f}, sync {s.sync_s:.2f}), "
          f"staleness mean {s.staleness_mean:.2f} max {s.staleness_max}, bottleneck {s.bottleneck}; idle: "
          + ", ".join(f"{k} {v:.0%}" for k, v in s.idle.items())
          + (f"; {s.failures} failures, {s.lost_s:.0f} s lost" if s.failures else ""))


def _simulate(spec, out: Path, steps: int | None) -> int:
    from tidal.plan.loop import simulate
    from tidal.plan.report import describe, summarize
    from tidal.plan.trace_out import write_trace

    t0, c0 = time.perf_counter(), time.process_time()
    r = simulate(spec, steps)
    took, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = summarize(r)
    # CPU seconds beside the wall clock: on a shared machine the wall clock measures the neighbours too
    print(f"{describe(spec.placement)}: {len(r.records)} steps simulated in {took:.1f} s ({cpu:.1f} CPU s)")
    _print_summary(s)
    n = write_trace(r, out / "trace.json")
    (out / "summary.json").write_text(json.dumps({"summary": s.as_dict(), "costs": r.costs,
                                                  "simulated_in_s": took, "cpu_s": cpu}, indent=1))
    print(f"wrote {out / 'trace.json'} ({n} events) and {out / 'summary.json'}")
    return 0


def _search(spec, out: Path, ns) -> int:
    from tidal.plan.output import write_config, write_plans, write_plot
    from tidal.plan.search import distinct, explain, search

    plans, rejected = search(spec, progress=not ns.no_progress)
    if not plans:
        reasons = sorted({why for _, why in rejected})
        print("tidal plan: no placement fits: " + "; ".join(reasons), file=sys.stderr)
        return 2
    print(f"{len(plans)} plans simulated ({spec.search.steps} steps each), {len(rejected)} rejected; the best:")
    groups = distinct(plans)
    for i, (x, same) in enumerate(groups[: spec.search.top], 1):
        print(f"{i}. {x.name}" + (f" (the same with k={', '.join(str(y.placement.max_staleness) for y in same)})"
                                  if same else ""))
        _print_summary(x.summary)
    cfg = write_config(spec, plans[0], out / "plan.yaml")
    png = write_plot(plans, out / "plan.png")
    js = write_plans(plans, rejected, out / "plans.json")
    print(f"wrote {cfg}, {js}" + (f", {png}" if png else " (no plot: matplotlib is not installed)"))
    if ns.explain and len(groups) > 1:
        print("\n" + explain(groups[0][0], groups[1][0]))
        other = next((x for x, _ in groups if x.placement.colocate != plans[0].placement.colocate), None)
        if other is not None and other is not groups[1][0]:
            print("\n" + explain(groups[0][0], other))
    return 0


def _calibrate(ns) -> int:
    from tidal.plan.calibrate import calibrate

    if not ns.run_dir:
        raise FileNotFoundError("tidal plan calibrate RUN_DIR: give the run's directory")
    c = calibrate(ns.run_dir)
    text = yaml.safe_dump({"cluster": {"accelerator": c["accelerator"]},
                           "efficiency": {**c["efficiency"], "rollout_overhead_s": c["rollout_fixed_s"]},
                           "fit": c["fit"], "model": c["model"], "threads": c["threads"],
                           "trace_check": c["trace_check"]},
                          sort_keys=False)
    if ns.out:
        Path(ns.out).write_text(text)
        print(f"wrote {ns.out}")
    else:
        print(text)
    return 0

"""Sandbox throughput: executions/s of a trivial Python snippet, sandboxed vs a bare subprocess.

    python benchmarks/sandbox.py [--seconds 3] [--rounds 5] [--out benchmarks/results/sandbox.json]

The bare baseline is `python <same flags> -c SNIPPET` started by `subprocess.run` (from
asyncio worker threads), with the interpreter the sandbox runs, so the ratio is the
sandbox's own cost, not a difference of interpreters. Each round measures, back to back,
bare and sandboxed (warm pool, and cold: `warm=0`) at concurrency 1 and 2, for
`--seconds` each; ratios are taken within a round and their median reported, because
this machine is shared and noisy. The warm pool keeps 4 sandboxes per concurrent run; in
steady state those started before a measurement balance those started, unused, at its
end. Writes the raw figures as JSON and prints a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from tidal.sandbox import SandboxConfig, SandboxPool, SandboxStatus
from tidal.sandbox.launch import python_flags, resolve_python

SNIPPET = "print(sum(range(100)))"
EXPECTED = "4950\n"
WARM_PER_SLOT = 4  # warm sandboxes per concurrent run (SandboxConfig.warm's guidance)


async def _rate(run_one, concurrency: int, seconds: float) -> float:
    """Executions per second with `concurrency` workers looping on `run_one` for `seconds`."""
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            out = await run_one()
            if out != EXPECTED:
                raise RuntimeError(f"benchmark snippet printed {out!r}")
            count += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return count / (time.perf_counter() - t0)


async def _bare_once(argv: list[str]) -> str:
    # subprocess.run on a worker thread: the cheapest way to start a process from asyncio
    # (asyncio's own subprocess support adds a watcher thread per process).
    done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, check=True)
    return done.stdout.decode()


async def _sandboxed_rate(config: SandboxConfig, concurrency: int, seconds: float) -> float:
    async with SandboxPool(config.model_copy(update={"max_concurrency": concurrency})) as pool:
        await asyncio.sleep(0.2)  # let the warm sandboxes start, as they would between steps

        async def once() -> str:
            result = await pool.run_python(SNIPPET)
            if result.status is not SandboxStatus.OK:
                raise RuntimeError(f"sandboxed benchmark run failed: {result} {result.stderr[-500:]}")
            return result.stdout

        return await _rate(once, concurrency, seconds)


async def measure(seconds: float, rounds: int) -> dict:
    base = SandboxConfig()
    python = resolve_python(base)
    bare_argv = [python.executable, *python_flags(base.python_site_packages), "-c", SNIPPET]
    variants = {
        "bare": lambda c: _rate(lambda: _bare_once(bare_argv), c, seconds),
        "sandbox_warm": lambda c: _sandboxed_rate(base.model_copy(update={"warm": WARM_PER_SLOT * c}), c, seconds),
        "sandbox_cold": lambda c: _sandboxed_rate(base.model_copy(update={"warm": 0}), c, seconds),
    }
    raw: dict[str, dict[str, list[float]]] = {name: {"1": [], "2": []} for name in variants}
    for r in range(rounds):
        for concurrency in (1, 2):
            for name, rate in variants.items():
                raw[name][str(concurrency)].append(await rate(concurrency))
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{n}@{c}={raw[n][c][-1]:.0f}/s" for c in ("1", "2") for n in variants), flush=True)
    summary = {}
    for concurrency in ("1", "2"):
        bare = raw["bare"][concurrency]
        summary[concurrency] = {
            name: {"median_per_s": statistics.median(raw[name][concurrency]),
                   "ratio_to_bare_median": statistics.median(x / b for x, b in zip(raw[name][concurrency], bare))}
            for name in variants}
    return {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "interpreter": python.executable, "flags": python_flags(base.python_site_packages), "snippet": SNIPPET,
            "seconds_per_measurement": seconds, "rounds": rounds, "warm_sandboxes": f"{WARM_PER_SLOT} x concurrency",
            "raw_per_s": raw, "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=3.0, help="length of one measurement")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/sandbox.json")
    ns = p.parse_args()
    result = asyncio.run(measure(ns.seconds, ns.rounds))
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1))
    print("\n| concurrency | bare `python -c` | sandbox, warm pool | ratio | sandbox, cold (warm=0) | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c, s in result["summary"].items():
        print(f"| {c} | {s['bare']['median_per_s']:.0f}/s | {s['sandbox_warm']['median_per_s']:.0f}/s "
              f"| {s['sandbox_warm']['ratio_to_bare_median']:.2f}× | {s['sandbox_cold']['median_per_s']:.0f}/s "
              f"| {s['sandbox_cold']['ratio_to_bare_median']:.2f}× |")


if __name__ == "__main__":
    main()

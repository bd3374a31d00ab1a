"""Sandbox throughput: executions/s of a trivial Python snippet, sandboxed vs a bare subprocess.

    python benchmarks/sandbox.py [--seconds 3] [--rounds 5] [--out benchmarks/results/sandbox.json]
    python benchmarks/sandbox.py --against TREE [--runs 150] [--rounds 8] [--out benchmarks/results/sandbox_ab.json]

The bare baseline is `python <same flags> -c SNIPPET` started by `subprocess.run` (from
asyncio worker threads), with the interpreter the sandbox runs, so the ratio is the
sandbox's own cost, not a difference of interpreters. Each round measures, back to back,
bare and sandboxed (warm pool, and cold: `warm=0`) at concurrency 1 and 2, for
`--seconds` each, and with `--unhardened` also a warm pool without the syscall filter and
the per-run cgroups (`seccomp=False, cgroups=False`: what those two cost); ratios are taken within a round and their median reported, because
this machine is shared and noisy. The warm pool keeps 4 sandboxes per concurrent run; in
steady state those started before a measurement balance those started, unused, at its
end. Writes the raw figures as JSON and prints a Markdown table for BENCHMARKS.md.

`--against TREE` compares this checkout's sandbox with another source tree's (a `git worktree`
of an older commit, say) head to head: one long-lived worker process per tree, each with its
own warm pool (same config) and its own CPU cgroup, takes turns at `--runs` executions, the
order reversed every round. Ratios (this ÷ TREE) are taken within a round, and their medians
reported: the two trees see the same machine at nearly the same moment, which is what makes a
few-percent difference measurable on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tidal.sandbox import SandboxConfig, SandboxPool, SandboxStatus
from tidal.sandbox.launch import python_flags, resolve_python

SNIPPET = "print(sum(range(100)))"
EXPECTED = "4950\n"
DEFAULT_OUT = "benchmarks/results/sandbox.json"
WARM_PER_SLOT = 4  # warm sandboxes per concurrent run (SandboxConfig.warm's guidance)


class CgroupCpu:
    """CPU time used by this process and all it starts (sandboxes included, also those the
    host's init adopts), read from a cgroup made for the benchmark and removed after it.
    Unlike a rate, this does not depend on what else the machine runs. Needs root and
    cgroup CPU accounting (v1 cpuacct or v2); `read()` is None without them."""

    def __init__(self) -> None:
        self.dir: Path | None = None
        self.home: Path | None = None
        v1, v2 = Path("/sys/fs/cgroup/cpuacct"), Path("/sys/fs/cgroup")
        if (v1 / "cpuacct.usage").exists():
            self.mount, self.usage_file = v1, "cpuacct.usage"
        elif (v2 / "cgroup.controllers").exists():
            self.mount, self.usage_file = v2, "cpu.stat"
        else:
            return
        own = [line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
               if line.split(":", 2)[1] in (("cpuacct", "cpu,cpuacct", "cpuacct,cpu") if v1 == self.mount else ("",))]
        try:
            self.home = self.mount / own[0].lstrip("/")
            self.dir = self.home / f"tidal-bench-{os.getpid()}"
            self.dir.mkdir()
            (self.dir / "cgroup.procs").write_text(str(os.getpid()))
        except (OSError, IndexError):
            self.dir = None

    def read(self) -> float | None:
        """CPU seconds so far."""
        if self.dir is None:
            return None
        text = (self.dir / self.usage_file).read_text()
        if self.usage_file == "cpuacct.usage":
            return int(text) / 1e9
        return int(dict(line.split() for line in text.splitlines())["usage_usec"]) / 1e6

    def remove(self) -> None:
        if self.dir is None:
            return
        (self.home / "cgroup.procs").write_text(str(os.getpid()))
        for _ in range(100):  # finished sandboxes' last processes may still be on their way out
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.05)
        print(f"could not remove {self.dir}: processes are still in it", flush=True)


async def _rate(run_one, concurrency: int, seconds: float, cpu: CgroupCpu) -> tuple[float, float | None]:
    """Executions per second with `concurrency` workers looping on `run_one` for `seconds`,
    and CPU milliseconds per execution."""
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            out = await run_one()
            if out != EXPECTED:
                raise RuntimeError(f"benchmark snippet printed {out!r}")
            count += 1

    t0, cpu0 = time.perf_counter(), cpu.read()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    rate, cpu1 = count / (time.perf_counter() - t0), cpu.read()
    return rate, None if cpu0 is None else (cpu1 - cpu0) * 1000 / count


async def _bare_once(argv: list[str]) -> str:
    # subprocess.run on a worker thread: the cheapest way to start a process from asyncio
    # (asyncio's own subprocess support adds a watcher thread per process).
    done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, check=True)
    return done.stdout.decode()


async def _sandboxed_rate(config: SandboxConfig, concurrency: int, seconds: float,
                          cpu: CgroupCpu) -> tuple[float, float | None]:
    async with SandboxPool(config.model_copy(update={"max_concurrency": concurrency})) as pool:
        await asyncio.sleep(0.2)  # let the warm sandboxes start, as they would between steps

        async def once() -> str:
            result = await pool.run_python(SNIPPET)
            if result.status is not SandboxStatus.OK:
                raise RuntimeError(f"sandboxed benchmark run failed: {result} {result.stderr[-500:]}")
            return result.stdout

        return await _rate(once, concurrency, seconds, cpu)


async def measure(seconds: float, rounds: int, unhardened: bool = False) -> dict:
    base = SandboxConfig()
    python = resolve_python(base)
    bare_argv = [python.executable, *python_flags(base.python_site_packages), "-c", SNIPPET]
    cpu = CgroupCpu()
    variants = {
        "bare": lambda c: _rate(lambda: _bare_once(bare_argv), c, seconds, cpu),
        "sandbox_warm": lambda c: _sandboxed_rate(base.model_copy(update={"warm": WARM_PER_SLOT * c}), c, seconds, cpu),
        "sandbox_cold": lambda c: _sandboxed_rate(base.model_copy(update={"warm": 0}), c, seconds, cpu),
    }
    if unhardened and "seccomp" in SandboxConfig.model_fields:
        variants["sandbox_warm_unhardened"] = lambda c: _sandboxed_rate(
            base.model_copy(update={"warm": WARM_PER_SLOT * c, "seccomp": False, "cgroups": False}), c, seconds, cpu)
    raw: dict[str, dict[str, list[float]]] = {name: {"1": [], "2": []} for name in variants}
    raw_cpu: dict[str, dict[str, list[float | None]]] = {name: {"1": [], "2": []} for name in variants}
    loads = []
    try:
        for r in range(rounds):
            loads.append(os.getloadavg()[0])
            for concurrency in ("1", "2"):
                for name, measure_variant in variants.items():
                    rate, cpu_ms = await measure_variant(int(concurrency))
                    raw[name][concurrency].append(rate)
                    raw_cpu[name][concurrency].append(cpu_ms)
            print(f"round {r + 1}/{rounds} (load {loads[-1]:.1f}): " + ", ".join(
                f"{n}@{c}={raw[n][c][-1]:.0f}/s" for c in ("1", "2") for n in variants), flush=True)
    finally:
        cpu.remove()
    summary = {}
    for concurrency in ("1", "2"):
        bare = raw["bare"][concurrency]
        summary[concurrency] = {
            name: {"median_per_s": statistics.median(raw[name][concurrency]),
                   "ratio_to_bare_median": statistics.median(x / b for x, b in zip(raw[name][concurrency], bare)),
                   "cpu_ms_per_execution_median": (None if None in raw_cpu[name][concurrency]
                                                   else statistics.median(raw_cpu[name][concurrency]))}
            for name in variants}
    return {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "load_average_at_round_start": loads,
            "interpreter": python.executable, "flags": python_flags(base.python_site_packages), "snippet": SNIPPET,
            "seconds_per_measurement": seconds, "rounds": rounds, "warm_sandboxes": f"{WARM_PER_SLOT} x concurrency",
            "raw_per_s": raw, "raw_cpu_ms_per_execution": raw_cpu, "summary": summary}


async def _worker() -> None:
    """`--worker`: one tree's side of `--against`. Reads `CONCURRENCY RUNS` lines on stdin and
    answers each with a JSON line: executions/s and CPU ms per execution of that batch."""
    cpu = CgroupCpu()
    config = SandboxConfig().model_copy(update={"max_concurrency": 2, "warm": WARM_PER_SLOT * 2})
    loop = asyncio.get_running_loop()
    try:
        async with SandboxPool(config) as pool:
            async def once() -> None:
                result = await pool.run_python(SNIPPET)
                if result.status is not SandboxStatus.OK or result.stdout != EXPECTED:
                    raise RuntimeError(f"sandboxed benchmark run failed: {result} {result.stderr[-500:]}")

            print(json.dumps({"ready": True}), flush=True)
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                concurrency, runs = map(int, line.split())
                await asyncio.sleep(0.3)  # the warm sandboxes refill after the other tree's turn
                left = runs
                t0, cpu0 = time.perf_counter(), cpu.read()

                async def loop_runs() -> None:
                    nonlocal left
                    while left > 0:
                        left -= 1
                        await once()

                await asyncio.gather(*(loop_runs() for _ in range(concurrency)))
                elapsed, cpu1 = time.perf_counter() - t0, cpu.read()
                print(json.dumps({"per_s": runs / elapsed,
                                  "cpu_ms": None if cpu0 is None else (cpu1 - cpu0) * 1000 / runs}), flush=True)
    finally:
        cpu.remove()


def against(tree: str, runs: int, rounds: int) -> dict:
    """This checkout's sandbox ÷ `tree`'s, head to head (see the module docstring)."""
    here = str(Path(__file__).resolve().parents[1])
    trees = {"this": here, "against": str(Path(tree).resolve())}
    workers = {}
    for name, root in trees.items():
        env = {**os.environ, "PYTHONPATH": root}
        workers[name] = subprocess.Popen([sys.executable, __file__, "--worker"], cwd=root, env=env, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        for name, w in workers.items():
            if json.loads(w.stdout.readline() or "{}").get("ready") is not True:
                raise RuntimeError(f"the {name} worker ({trees[name]}) did not start")
        raw: dict[str, dict[str, list[dict]]] = {n: {"1": [], "2": []} for n in workers}
        for r in range(rounds):
            order = list(workers) if r % 2 == 0 else list(reversed(workers))
            for concurrency in ("1", "2"):
                for name in order:
                    workers[name].stdin.write(f"{concurrency} {runs}\n")
                    workers[name].stdin.flush()
                    answer = workers[name].stdout.readline()
                    if not answer:
                        raise RuntimeError(f"the {name} worker ({trees[name]}) died")
                    raw[name][concurrency].append(json.loads(answer))
            print(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{n}@{c}={raw[n][c][-1]['per_s']:.1f}/s {raw[n][c][-1]['cpu_ms'] or float('nan'):.1f}ms"
                for c in ("1", "2") for n in workers), flush=True)
    finally:
        for w in workers.values():
            w.stdin.close()
        for w in workers.values():
            w.wait(timeout=60)
    summary = {}
    for c in ("1", "2"):
        this, other = raw["this"][c], raw["against"][c]
        entry = {"rate_ratio_median": statistics.median(a["per_s"] / b["per_s"] for a, b in zip(this, other)),
                 "this_per_s_median": statistics.median(a["per_s"] for a in this),
                 "against_per_s_median": statistics.median(b["per_s"] for b in other)}
        if all(x["cpu_ms"] is not None for x in this + other):
            entry |= {"cpu_ratio_median": statistics.median(a["cpu_ms"] / b["cpu_ms"] for a, b in zip(this, other)),
                      "this_cpu_ms_median": statistics.median(a["cpu_ms"] for a in this),
                      "against_cpu_ms_median": statistics.median(b["cpu_ms"] for b in other)}
        summary[c] = entry
    return {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "trees": trees,
            "snippet": SNIPPET, "runs_per_turn": runs, "rounds": rounds, "raw": raw, "summary": summary}


def main() -> None:
    if sys.argv[1:] == ["--worker"]:
        asyncio.run(_worker())
        return
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=3.0, help="length of one measurement")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--unhardened", action="store_true", help="also a warm pool without syscall filter and cgroups")
    p.add_argument("--against", metavar="TREE", help="compare head to head with the sandbox of another source tree")
    p.add_argument("--runs", type=int, default=150, help="--against: executions per turn")
    ns = p.parse_args()
    if ns.against:
        result = against(ns.against, ns.runs, ns.rounds)
        out = Path(ns.out if ns.out != DEFAULT_OUT else "benchmarks/results/sandbox_ab.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"\nthis ({result['trees']['this']}) ÷ against ({result['trees']['against']}), medians of {ns.rounds} "
              "rounds:\n| concurrency | rate ratio | CPU ratio | CPU ms per execution, this / against |\n| --- | --- | --- | --- |")
        for c, s in result["summary"].items():
            cpu = (f"{s['cpu_ratio_median']:.2f}×", f"{s['this_cpu_ms_median']:.1f} / {s['against_cpu_ms_median']:.1f}"
                   ) if "cpu_ratio_median" in s else ("n/a", "n/a")
            print(f"| {c} | {s['rate_ratio_median']:.2f}× | {cpu[0]} | {cpu[1]} |")
        return
    result = asyncio.run(measure(ns.seconds, ns.rounds, ns.unhardened))
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1))
    print("\n| concurrency | bare `python -c` | sandbox, warm pool | ratio | sandbox, cold (warm=0) | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c, s in result["summary"].items():
        print(f"| {c} | {s['bare']['median_per_s']:.0f}/s | {s['sandbox_warm']['median_per_s']:.0f}/s "
              f"| {s['sandbox_warm']['ratio_to_bare_median']:.2f}× | {s['sandbox_cold']['median_per_s']:.0f}/s "
              f"| {s['sandbox_cold']['ratio_to_bare_median']:.2f}× |")
    if "sandbox_warm_unhardened" in result["summary"]["1"]:
        for c, s in result["summary"].items():
            u = s["sandbox_warm_unhardened"]
            print(f"without filter and cgroups, concurrency {c}: {u['median_per_s']:.0f}/s "
                  f"({u['ratio_to_bare_median']:.2f}× bare)")
    if result["summary"]["1"]["bare"]["cpu_ms_per_execution_median"] is not None:
        print("\nCPU ms per execution (median):")
        for c, s in result["summary"].items():
            print(f"  concurrency {c}: " + ", ".join(f"{n} {v['cpu_ms_per_execution_median']:.1f}" for n, v in s.items()))


if __name__ == "__main__":
    main()

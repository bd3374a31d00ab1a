"""The dashboard on a run of a million episodes: does the page stay responsive?

    python benchmarks/dashboard.py [--episodes 1000000] [--steps 1000] [--rounds 3]
                                   [--keep DIR] [--out benchmarks/results/dashboard.json]

Two run directories are made with the same generator (tidal/monitor/dashboard/synthetic.py:
real Episode records of the default task's shape, tokenized with the default model's
tokenizer, through the store's own writer): a small one (1,000 episodes) and a large one
(`--episodes`, over `--steps` steps, each with its metrics.jsonl row and some alert events).
Then, in alternating rounds, each in a fresh browser context of Debian's headless Chromium
(Playwright):

- page load: navigation until the page says it is ready (curves drawn, the first episode
  page listed);
- a text filter over every episode's text, typed into the page, until the table shows it;
- opening an episode from the table, until its tokens are drawn;
- a step-range filter.

The first load of each directory (the server's Parquet footer cache cold) is reported apart.
Ratios large/small say how the page scales; beside them, what a user without the dashboard
would do to see the same first page: read the store's list columns with pyarrow (whole
columns: pyarrow's dataset reader) and take the newest 50 rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tidal.monitor.dashboard.server import DashboardServer
from tidal.monitor.dashboard.synthetic import make_run

CHROMIUM = "/usr/lib/chromium/chromium-headless-shell"


def timed_page(browser, url: str) -> dict[str, float]:
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    out = {}
    t0 = time.perf_counter()
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=120_000)
    out["load_s"] = time.perf_counter() - t0
    page.click("button[data-tab=episodes]")
    before = page.text_content("#episode-summary")
    t0 = time.perf_counter()
    page.fill("input[name=text]", "<tool_call>sub(1")
    page.click("#episode-filters button[type=submit]")
    page.wait_for_function("(b) => document.querySelector('#episode-summary').textContent !== b", arg=before,
                           timeout=120_000)
    out["text_filter_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    page.click("tr.episode-row")
    page.wait_for_selector(".tokens span.tok", timeout=120_000)
    out["open_episode_s"] = time.perf_counter() - t0
    before = page.text_content("#episode-summary")
    page.fill("input[name=text]", "")
    page.fill("input[name=step_min]", "3")
    page.fill("input[name=step_max]", "4")
    t0 = time.perf_counter()
    page.click("#episode-filters button[type=submit]")
    page.wait_for_function("(b) => document.querySelector('#episode-summary').textContent !== b", arg=before,
                           timeout=120_000)
    out["step_filter_s"] = time.perf_counter() - t0
    ctx.close()
    return out


def pyarrow_first_page(run: Path) -> float:
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    t0 = time.perf_counter()
    table = ds.dataset(str(run / "episodes"), format="parquet").to_table(
        columns=["step", "episode_id", "env", "status", "reward", "error", "prompt_len"])
    table.take(pc.sort_indices(table, [("step", "descending"), ("episode_id", "ascending")])[:50])
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--small", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--keep", default=None, help="make (or reuse) the runs here instead of a temporary directory")
    p.add_argument("--out", default="benchmarks/results/dashboard.json")
    a = p.parse_args()
    from playwright.sync_api import sync_playwright

    base = Path(a.keep or tempfile.mkdtemp(prefix="tidal-dashboard-bench-"))
    runs = {"small": (base / f"small-{a.small}", a.small, 10), "large": (base / f"large-{a.episodes}", a.episodes,
                                                                           a.steps)}
    made = {}
    for name, (d, n, steps) in runs.items():
        if not (d / "metrics.jsonl").is_file():
            t0 = time.perf_counter()
            make_run(d, episodes=n, steps=steps, progress=True)
            made[name] = round(time.perf_counter() - t0, 1)
        size = sum(f.stat().st_size for f in (d / "episodes").glob("*.parquet"))
        print(f"{name}: {n} episodes, {steps} steps, {size / 2**20:.1f} MiB of Parquet", flush=True)
    servers = {name: DashboardServer([d]) for name, (d, _, _) in runs.items()}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    first: dict[str, dict[str, float]] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        for name in runs:  # the first load of each: the server's Parquet footer cache cold
            first[name] = timed_page(browser, servers[name].url)
            print(f"first load {name}: {first[name]}", flush=True)
        for r in range(a.rounds):
            for name in (("small", "large") if r % 2 == 0 else ("large", "small")):
                m = timed_page(browser, servers[name].url)
                results[name].append(m)
                print(f"round {r + 1} {name}: " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()), flush=True)
        browser.close()
    for s in servers.values():
        s.close()
    pyarrow = {name: min(pyarrow_first_page(d) for _ in range(a.rounds)) for name, (d, _, _) in runs.items()}
    med = {name: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for name, ms in results.items()}
    summary = {
        "episodes": {name: n for name, (_, n, _) in runs.items()},
        "median_s": med, "first_load_s": first,
        "ratio_large_over_small": {k: med["large"][k] / med["small"][k] for k in med["large"]},
        "pyarrow_first_page_s": pyarrow,
        "rounds": results, "made_s": made,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "command": "python benchmarks/dashboard.py " + " ".join(sys.argv[1:]),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("median_s", "ratio_large_over_small", "pyarrow_first_page_s",
                                              "first_load_s")}, indent=1))


if __name__ == "__main__":
    main()

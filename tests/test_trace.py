"""run.trace: RUN/trace.json holds every role's spans in Chrome's trace event format, checked
against that format's rules (the event kinds, their fields, complete events nesting per thread,
every async begin closed by its end), locally and, slow, with spans from Ray actors."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from tidal.config import load_config
from tidal.monitor import trace
from tidal.runtime.controller import Controller


def check_chrome_trace(doc: dict) -> list[dict]:
    """Raise AssertionError where `doc` breaks the Chrome trace event format (JSON object
    form) as Perfetto and chrome://tracing read it; return its events."""
    assert set(doc) <= {"traceEvents", "displayTimeUnit", "otherData"} and isinstance(doc["traceEvents"], list)
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    events = doc["traceEvents"]
    complete: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    open_async: dict[tuple, list[str]] = defaultdict(list)
    for e in events:
        assert isinstance(e.get("name"), str) and e["name"], e
        assert e.get("ph") in ("X", "b", "e", "M"), e
        assert isinstance(e.get("pid"), int) and isinstance(e.get("tid"), int), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name") and isinstance(e["args"]["name"], str), e
            continue
        assert isinstance(e.get("ts"), (int, float)) and e["ts"] > 0, e
        assert "args" not in e or isinstance(e["args"], dict), e
        if e["ph"] == "X":
            assert isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0, e
            complete[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
        else:
            assert isinstance(e.get("cat"), str) and isinstance(e.get("id"), (str, int)), e
            stack = open_async[(e["pid"], e["cat"], e["id"])]
            if e["ph"] == "b":
                stack.append(e["name"])
            else:
                assert stack and stack.pop() == e["name"], f"async end without its begin: {e}"
    assert not {k: v for k, v in open_async.items() if v}, "async spans never ended"
    # Complete events on one thread nest: each pair is disjoint or one holds the other
    # (1 µs of slack: start and duration come from two clocks).
    for spans in complete.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[float] = []
        for start, end in spans:
            while stack and start >= stack[-1] - 1.0:
                stack.pop()
            assert not stack or end <= stack[-1] + 1.0, f"overlapping complete events on one thread: {spans}"
            stack.append(end)
    return events


def test_the_checker_rejects_what_breaks_the_format():
    good = {"traceEvents": [{"name": "a", "ph": "X", "ts": 10.0, "dur": 5.0, "pid": 1, "tid": 1}]}
    check_chrome_trace(good)
    overlapping = {"traceEvents": [{"name": "a", "ph": "X", "ts": 10.0, "dur": 5.0, "pid": 1, "tid": 1},
                                   {"name": "b", "ph": "X", "ts": 12.0, "dur": 10.0, "pid": 1, "tid": 1}]}
    unclosed = {"traceEvents": [{"name": "a", "ph": "b", "ts": 10.0, "cat": "c", "id": "x", "pid": 1, "tid": 1}]}
    no_dur = {"traceEvents": [{"name": "a", "ph": "X", "ts": 10.0, "pid": 1, "tid": 1}]}
    for bad in (overlapping, unclosed, no_dur):
        with pytest.raises(AssertionError):
            check_chrome_trace(bad)


def run_traced(tmp_path, *overrides: str, steps: int = 2) -> list[dict]:
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"train.steps={steps}", "rollout.prompts_per_step=4",
                             "rollout.samples_per_prompt=4", "run.eval_every=2", "eval.n=8", "run.progress=false",
                             "run.save_every=2", "run.trace=true", *overrides])
    ctl = Controller(cfg)
    try:
        ctl.train()
    finally:
        ctl.close()
    return check_chrome_trace(json.loads((ctl.paths.root / "trace.json").read_text()))


def test_a_local_run_traces_every_stage(tmp_path):
    events = run_traced(tmp_path)
    names = Counter((e["ph"], e["name"]) for e in events)
    for stage in ("rollout", "train", "forward_backward", "optim_step", "sync", "eval", "save"):
        assert names[("X", stage)] >= 1, stage
    assert names[("X", "rollout")] == names[("X", "sync")] == 2 and names[("X", "save")] == 1
    # Per episode: one engine call, one env step and one reward each (single-turn), training and eval.
    assert names[("b", "generate")] == names[("b", "env.step")] == names[("b", "reward")] == 2 * 16 + 8
    assert [e["args"]["name"] for e in events if e["ph"] == "M"] == ["driver"]
    assert not trace.enabled()  # closed with the run


def test_no_trace_unless_asked(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "train.steps=1", "rollout.prompts_per_step=2",
                             "run.eval_every=0", "run.progress=false"])
    ctl = Controller(cfg)
    try:
        ctl.train()
    finally:
        ctl.close()
    assert not (ctl.paths.root / "trace.json").exists() and not trace.drain()


@pytest.mark.slow  # starts Ray and its actors (tens of seconds here)
def test_a_ray_run_traces_spans_from_the_actors_processes(tmp_path):
    events = run_traced(tmp_path, "placement.mode=ray", "placement.colocate=true", "placement.env_workers=1",
                        "placement.env.num_cpus=0.25", "placement.trainer.num_cpus=0.5", "placement.call_timeout_s=120")
    roles = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert sorted(roles.values()) == ["driver", "env worker", "trainer rank 0"] and len(roles) == 3
    by_role = defaultdict(set)
    for e in events:
        if e["ph"] != "M":
            by_role[roles[e["pid"]]].add(e["name"])
    assert {"forward_backward", "optim_step"} <= by_role["trainer rank 0"]
    assert "env.step" in by_role["env worker"] and "env.reset" in by_role["env worker"]
    assert {"rollout", "train", "sync", "generate", "reward"} <= by_role["driver"]

"""`tidal dashboard` (tidal/monitor/dashboard): its routes against the run directories of
two real training runs (each value compared with what the run wrote, read back with pyarrow
and json), its refusals, and its security checks. The page itself is tested in a real
browser in tests/test_dashboard_browser.py."""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys

import pyarrow.dataset as ds
import pytest
from dashboard_vlm_run import make_vlm_run
from starlette.testclient import TestClient

from tidal.cli import main as cli_main
from tidal.models import load_tokenizer
from tidal.models.vision import image_runs
from tidal.monitor.dashboard.data import DashboardError, RunView
from tidal.monitor.dashboard.server import COOKIE, DashboardServer, build_app
from tidal.monitor.episodes import EpisodeWriter
from tidal.types import Episode, Turn

pytest.importorskip("duckdb", reason="the dashboard extra (duckdb, plotly) is in the dev extra")


@pytest.fixture(scope="module")
def runs(dashboard_runs):
    return dashboard_runs


@pytest.fixture(scope="module")
def client(runs):
    return TestClient(build_app([RunView(runs[0]), RunView(runs[1])]), base_url="http://127.0.0.1")


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def store(run_dir):
    return ds.dataset(str(run_dir / "episodes"), format="parquet").to_table().to_pylist()


def test_metrics_are_the_runs_metrics_jsonl(client, runs):
    for i, run in enumerate(runs):
        got = client.get("/api/metrics", params={"run": i}).json()
        rows = jsonl(run / "metrics.jsonl")
        assert got["steps"] == [r["step"] for r in rows]
        keys = {k for r in rows for k in r if k != "step"}
        assert set(got["columns"]) == keys
        for key in keys:
            want = [r.get(key) for r in rows]
            want = [None if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v) for v in want]
            assert got["columns"][key] == want, key  # exact: JSON floats round-trip
    # run a evaluated its starting weights: a step-0 row with only eval metrics
    a = client.get("/api/metrics", params={"run": 0}).json()
    assert a["steps"][0] == 0 and a["columns"]["reward"][0] is None and a["columns"]["eval/accuracy"][0] is not None


def test_metrics_are_read_as_they_are_written(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.6}\n')
    view = RunView(tmp_path)
    first = view.metrics()
    assert first["steps"] == [1, 2] and first["columns"]["reward"] == [0.5, 0.6]
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "rew')  # a line still being written is not read
        f.flush()
        assert view.metrics(since=2)["steps"] == []
        f.write('ard": 0.7, "kl": NaN}\n')
    third = view.metrics(since=2, generation=first["generation"])
    assert third["steps"] == [3] and third["columns"] == {"reward": [0.7], "kl": [None]} and not third["reset"]
    # a resume that lost its last checkpoint logs step 2 again: rows from step 2 on are replaced
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "reward": 0.9}\n')
    again = view.metrics(since=3, generation=first["generation"])
    assert again["reset"] and again["steps"] == [1, 2] and again["columns"]["reward"] == [0.5, 0.9]
    assert again["columns"]["kl"] == [None, None]


def test_events_are_alerts_and_hacking_events(client):
    events = client.get("/api/events", params={"run": 1}).json()["events"]
    assert [(e["kind"], e["name"], e["step"]) for e in events] == [("alert", "kl_spike", 2),
                                                                   ("hacking", "part_dominance", 3)]
    assert events[0]["message"] == "kl 0.5 at step 2"
    assert client.get("/api/events", params={"run": 0}).json()["events"] == []


def test_a_restart_is_an_event_of_its_own_kind(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    (tmp_path / "events.jsonl").write_text(json.dumps(
        {"kind": "restart", "step": 3, "role": "trainer rank 1", "checkpoint": "c", "restart": 1,
         "message": "trainer rank 1 lost at step 3"}) + "\n")
    assert RunView(tmp_path).events() == [{"kind": "restart", "name": "trainer rank 1", "step": 3,
                                           "message": "trainer rank 1 lost at step 3"}]


def test_the_config_diff_names_what_differs(client, runs):
    got = client.get("/api/config").json()
    diff = {d["key"]: d["values"] for d in got["diff"]}
    assert diff["train.lr"] == [3e-4, 1e-4]
    assert diff["train.steps"] == [4, 3]
    assert diff["run.dir"] == [str(runs[0]), str(runs[1])]
    assert all(len({json.dumps(v) for v in values}) > 1 for values in diff.values())
    assert "model.path" not in diff and got["configs"][0]["model.path"] == got["configs"][1]["model.path"]


@pytest.mark.parametrize("params, keep", [
    ({}, lambda e: True),
    ({"step_min": 2, "step_max": 3}, lambda e: 2 <= e["step"] <= 3),
    ({"reward_min": 1.0}, lambda e: e["reward"] >= 1.0),
    ({"reward_max": 0.5, "step_min": 4}, lambda e: e["reward"] <= 0.5 and e["step"] >= 4),
    ({"status": "ok"}, lambda e: e["status"] == "ok"),
    ({"status": "truncated,timeout"}, lambda e: e["status"] in ("truncated", "timeout")),
    ({"env": "arithmetic"}, lambda e: e["env"] == "arithmetic"),
    ({"env": "nothing-like-it"}, lambda e: False),
    ({"text": "WHAT IS 1"}, lambda e: "what is 1" in e["text"].lower()),
    ({"text": "s3-p1-"}, lambda e: "s3-p1-" in e["episode_id"]),
])
def test_episode_filters_match_the_store(client, runs, params, keep):
    want = [e for e in store(runs[0]) if keep(e)]
    got = client.get("/api/episodes", params={"run": 0, "limit": 500, **params}).json()
    assert got["total"] == len(want)
    assert sorted(r["episode_id"] for r in got["rows"]) == sorted(e["episode_id"] for e in want)
    steps = [r["step"] for r in got["rows"]]
    assert steps == sorted(steps, reverse=True)  # newest first
    by_id = {e["episode_id"]: e for e in want}
    for r in got["rows"]:
        e = by_id[r["episode_id"]]
        assert (r["reward"], r["status"], r["n_tokens"], r["policy_tokens"]) == (
            e["reward"], e["status"], len(e["tokens"]), sum(e["loss_mask"]))


def test_episode_pages_do_not_overlap(client, runs):
    total = len(store(runs[0]))
    seen = []
    for offset in range(0, total, 50):
        seen += [r["episode_id"] for r in client.get("/api/episodes", params={"run": 0, "offset": offset,
                                                                              "order": "oldest"}).json()["rows"]]
    assert len(seen) == total == len(set(seen))


def test_an_episode_is_shown_token_by_token(client, runs):
    tokenizer = load_tokenizer("default")  # the runs' model
    recorded = next(e for e in store(runs[0]) if e["step"] == 3)
    got = client.get("/api/episode", params={"run": 0, "id": recorded["episode_id"], "step": 3}).json()
    assert got["tokens"] == recorded["tokens"] and got["loss_mask"] == recorded["loss_mask"]
    assert got["versions"] == recorded["versions"] and got["prompt_len"] == recorded["prompt_len"]
    assert got["logprobs"] == pytest.approx(recorded["logprobs"], abs=0)  # float32 in the store, exact in JSON
    assert got["seed"] == str(recorded["seed"])  # a 64-bit seed as text: past what a JavaScript number holds
    assert len(got["pieces"]) == len(got["tokens"]) and got["pieces_note"] is None
    assert got["pieces"] == [tokenizer.decode([t]) for t in recorded["tokens"]]
    assert "".join(got["pieces"]) == recorded["text"]  # as the model saw it (special tokens kept)
    assert got["turns"][0]["start"] == recorded["prompt_len"]
    assert got["images"] == [] and got["image_runs"] == [] and got["images_note"] is None  # a text model's


@pytest.mark.parametrize("path, params, names", [
    ("/api/episodes", {"limit": 0}, "limit"),
    ("/api/episodes", {"limit": 501}, "limit"),
    ("/api/episodes", {"offset": -1}, "offset"),
    ("/api/episodes", {"step_min": "two"}, "step_min"),
    ("/api/episodes", {"reward_max": "high"}, "reward_max"),
    ("/api/episodes", {"status": "fine"}, "status"),
    ("/api/episodes", {"order": "random; DROP TABLE x"}, "order"),
    ("/api/episodes", {"run": 7}, "no run 7"),
    ("/api/metrics", {"run": -1}, "no run -1"),
    ("/api/episode", {}, "id"),
    ("/api/episode", {"id": "s1-p0-e0' OR '1'='1"}, "no episode"),
    ("/api/episode", {"id": "s1-p0-e0", "step": 99}, "at step 99"),
])
def test_bad_requests_name_what_is_wrong(client, path, params, names):
    r = client.get(path, params=params)
    assert r.status_code == 400
    assert names in r.json()["error"]


def test_a_text_filter_is_a_parameter_not_sql(client, runs):
    total = len(store(runs[0]))
    for text in ("' OR 1=1 --", "%", "_", "\\"):
        got = client.get("/api/episodes", params={"run": 0, "text": text}).json()
        assert got["total"] == sum(text in e["text"].lower() or text in e["episode_id"] for e in store(runs[0]))
        assert got["total"] < total or text in ("%", "_")


def test_off_loopback_a_token_is_required(runs):
    with pytest.raises(DashboardError, match="needs a token"):
        DashboardServer([runs[0]], host="0.0.0.0")
    c = TestClient(build_app([RunView(runs[0])], token="s3cret"), base_url="http://10.1.2.3:8765")
    for path in ("/", "/api/runs", "/api/metrics", "/api/episodes", "/api/image", "/static/app.js",
                 "/static/plotly.min.js"):
        assert c.get(path).status_code == 401, path
    assert c.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert c.get("/?token=wrong", follow_redirects=False).status_code == 401
    opened = c.get("/?token=s3cret", follow_redirects=False)
    assert opened.status_code == 303 and opened.headers["location"] == "/"  # the token leaves the address
    assert "httponly" in opened.headers["set-cookie"].lower() and "samesite=strict" in opened.headers[
        "set-cookie"].lower()
    assert c.cookies.get(COOKIE) == "s3cret"
    assert c.get("/api/runs").status_code == 200 and c.get("/").status_code == 200


def test_on_loopback_other_host_names_are_refused(runs):
    """A page on another site that rebinds its DNS name to 127.0.0.1 sends its own Host."""
    app = build_app([RunView(runs[0])])
    for host in ("127.0.0.1", "localhost:8765", "[::1]:8765"):
        assert TestClient(app, base_url=f"http://{host}").get("/api/runs").status_code == 200, host
    for host in ("evil.example", "evil.example:8765", "127.0.0.1.evil.example"):
        r = TestClient(app, base_url=f"http://{host}").get("/api/runs")
        assert r.status_code == 403 and "not a loopback name" in r.json()["error"], host


def test_pages_forbid_inline_script_and_framing(client):
    r = client.get("/")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
    assert client.get("/static/../../config.yaml").status_code == 404
    assert client.get("/static/index.html").status_code == 404  # only the page's assets, by name


def test_the_cli_names_a_missing_run_directory(tmp_path, capsys):
    assert cli_main(["dashboard", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli_main(["dashboard", str(tmp_path / "empty")]) == 2
    assert "not a tidal run directory" in capsys.readouterr().err


@pytest.mark.parametrize("order", ["newest", "oldest"])
@pytest.mark.parametrize("params", [{}, {"reward_min": 1.0}, {"text": "what is 1"}])
def test_pages_in_step_order_are_a_sort_of_the_store_when_steps_span_files(runs, tmp_path, order, params):
    """Pages in step order read only the steps they hold; with a step's episodes split over
    several files (parts), the pages still concatenate to one sort of all matching episodes."""
    from tidal.monitor.episodes import EpisodeWriter, iter_episodes

    run = tmp_path / "parts"
    (run / "episodes").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    with EpisodeWriter(run / "episodes", load_tokenizer("default"), max_file_episodes=7, row_group_episodes=3) as w:
        for e in iter_episodes(runs[0] / "episodes"):
            w.add(e)
    assert len(list((run / "episodes").glob("step_000003.part*.parquet"))) > 3
    keep = {"reward_min": lambda e: e["reward"] >= 1.0, "text": lambda e: "what is 1" in e["text"].lower()}
    want = [e for e in store(run) if all(keep[k](e) for k in params)]
    want.sort(key=lambda e: e["episode_id"])
    want.sort(key=lambda e: e["step"], reverse=order == "newest")
    c = TestClient(build_app([RunView(run)]), base_url="http://127.0.0.1")
    got, offset = [], 0
    while True:
        page = c.get("/api/episodes", params={"order": order, "limit": 13, "offset": offset, **params}).json()
        assert page["total"] == len(want)
        if not page["rows"]:
            break
        got += [r["episode_id"] for r in page["rows"]]
        offset += 13
    assert got == [e["episode_id"] for e in want]


def test_a_missing_extra_is_named_with_its_pip_command(runs, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "duckdb", None)  # as if `tidal[dashboard]` were not installed
    assert cli_main(["dashboard", str(runs[0]), "--port", "0"]) == 2
    assert "pip install 'tidal[dashboard]'" in capsys.readouterr().err


# -- a vision-language run: its pictures ------------------------------------------------


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return make_vlm_run(tmp_path_factory.mktemp("vlm"))


def test_a_vlm_episode_says_where_each_image_sits(vlm):
    c = TestClient(build_app([RunView(vlm.dir)]), base_url="http://127.0.0.1")
    got = c.get("/api/episode", params={"id": vlm.episode.episode_id}).json()
    runs = image_runs(vlm.episode.tokens, vlm.pad_id)
    assert [e - s for s, e in runs] == [8, 4]  # 100x60 and 56x56 pixels: two runs of pads, told apart
    assert got["images"] == [b.id for b in vlm.blobs] and got["images_note"] is None
    assert got["image_runs"] == [{"start": s, "end": e, "id": b.id} for (s, e), b in zip(runs, vlm.blobs)]
    assert all(got["pieces"][i] == "<|image_pad|>" for s, e in runs for i in range(s, e))


def test_images_that_do_not_pair_up_with_pad_runs_are_listed_not_placed(vlm, tmp_path):
    """A store whose ids and pad runs disagree (here: the second run cut off) is shown as it is, and says so."""
    ep, cut = vlm.episode, image_runs(vlm.episode.tokens, vlm.pad_id)[1][0]
    short = Episode(**{**ep.__dict__, "tokens": ep.tokens[:cut], "loss_mask": ep.loss_mask[:cut],
                       "logprobs": ep.logprobs[:cut], "versions": ep.versions[:cut], "turns": [],
                       "prompt_len": cut})
    (tmp_path / "config.yaml").write_text((vlm.dir / "config.yaml").read_text())
    with EpisodeWriter(tmp_path / "episodes") as w:
        w.write(1, [short])
    got = TestClient(build_app([RunView(tmp_path)]), base_url="http://127.0.0.1").get(
        "/api/episode", params={"id": ep.episode_id}).json()
    assert got["images"] == ep.images and got["image_runs"] == []
    assert "listed, not placed" in got["images_note"] and "2 image(s) but 1 run(s)" in got["images_note"]


def test_an_image_is_served_as_its_png(vlm):
    c = TestClient(build_app([RunView(vlm.dir)]), base_url="http://127.0.0.1")
    for blob in vlm.blobs:
        r = c.get("/api/image", params={"run": 0, "id": blob.id})
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        assert r.content == blob.png  # the bytes the writer saved
        assert "immutable" in r.headers["cache-control"] and r.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("bad", ["", "../../config.yaml", "X" * 64, "upper", "short", "long", "newline", "dots",
                                 "slash"])
def test_an_image_id_is_64_lowercase_hex_or_refused(vlm, bad):
    good = vlm.blobs[0].id
    image_id = {"upper": good.upper(), "short": good[:63], "long": good + "0", "newline": good + "\n",
                "dots": "../" + good[3:], "slash": good[:2] + "/" + good[3:]}.get(bad, bad)
    assert (vlm.dir / "episodes" / "images" / good[:2] / f"{good}.png").is_file()  # the file is there
    c = TestClient(build_app([RunView(vlm.dir)]), base_url="http://127.0.0.1")
    r = c.get("/api/image", params={"run": 0, "id": image_id})
    assert r.status_code == 400 and "64 lowercase hex" in r.json()["error"], image_id


def test_an_unknown_image_or_run_is_named(vlm):
    c = TestClient(build_app([RunView(vlm.dir)]), base_url="http://127.0.0.1")
    unknown = hashlib.sha256(b"no such picture").hexdigest()
    r = c.get("/api/image", params={"run": 0, "id": unknown})
    assert r.status_code == 404 and unknown in r.json()["error"]
    r = c.get("/api/image", params={"run": 1, "id": vlm.blobs[0].id})
    assert r.status_code == 400 and "no run 1" in r.json()["error"]


def test_an_image_needs_the_token_off_loopback_and_a_loopback_host_on_it(vlm):
    params = {"run": 0, "id": vlm.blobs[1].id}
    c = TestClient(build_app([RunView(vlm.dir)], token="s3cret"), base_url="http://10.1.2.3:8765")
    assert c.get("/api/image", params=params).status_code == 401
    r = c.get("/api/image", params=params, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.content == vlm.blobs[1].png
    r = TestClient(build_app([RunView(vlm.dir)]), base_url="http://evil.example").get("/api/image", params=params)
    assert r.status_code == 403


def test_an_episode_shows_its_prompt_and_the_reference_it_was_judged_against(client, runs):
    recorded = next(e for e in store(runs[0]) if e["step"] == 2)
    got = client.get("/api/episode", params={"run": 0, "id": recorded["episode_id"], "step": 2}).json()
    assert got["prompt_text"] == load_tokenizer("default").decode(recorded["tokens"][: recorded["prompt_len"]])
    # the arithmetic row's answer, checked against the question in the prompt itself
    a, op, b = re.search(r"What is (\d+) ([+\-*]) (\d+)\?", got["prompt_text"]).groups()
    want = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    assert int(got["reference_fields"]["answer"]) == want
    assert got["reference_fields"]["task_id"] == recorded["task_id"] and "prompt" not in got["reference_fields"]


def test_a_tool_call_shows_its_output(tmp_path):
    """The tools' answers as the policy got them (tidal/envs/tools.py keeps them on each call's
    record), in the store and in the episode view, with the observation that followed the turn."""
    import asyncio

    from tidal.envs.tools import execute, parse_tool_calls

    def lookup(city: str) -> str:
        """The weather of a city."""
        return f"sunny in {city}"

    text = '<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>'
    calls = parse_tool_calls(text).calls + parse_tool_calls('<tool_call>{"name": "nope", "arguments": {}}</tool_call>').calls
    ex = asyncio.run(execute(calls, [lookup]))
    assert [r.output for r in ex.records] == ["sunny in Oslo", ex.messages[1]["content"]]
    assert ex.records[1].status == "unknown" and ex.records[1].output.startswith("error: unknown tool `nope`")
    tok = load_tokenizer("default")
    prompt, turn, obs = tok.encode("What is the weather?"), tok.encode(text), tok.encode("sunny in Oslo")
    tokens = prompt + turn + obs
    ep = Episode("s1-p0-e0", "s1-p0", "t0", "weather", tokens=tokens, loss_mask=[False] * len(prompt) + [True] * len(turn)
                 + [False] * len(obs), logprobs=[0.0] * len(tokens), versions=[0] * len(tokens), prompt_len=len(prompt),
                 step=1, reference='{"city": "Oslo"}',
                 turns=[Turn(0, len(prompt), len(prompt) + len(turn), len(tokens), text, "stop", 0.0, ex.records, 0)])
    run = tmp_path / "run"
    (run / "episodes").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    with EpisodeWriter(run / "episodes", tok) as w:
        w.add(ep)
    got = TestClient(build_app([RunView(run)]), base_url="http://127.0.0.1").get(
        "/api/episode", params={"id": "s1-p0-e0"}).json()
    (t,) = got["turns"]
    assert [c["output"] for c in t["tool_calls"]] == [r.output for r in ex.records]
    assert t["observation"] == tok.decode(obs) and got["reference_fields"] == {"city": "Oslo"}


def test_run_status_is_read_from_the_run_directory(tmp_path):
    """running while a live process holds run.lock (never taken by the reader), the exit code
    `tidal train` recorded once it ended, `ended` for a holder that died without releasing it."""
    import os
    import socket
    import subprocess

    from tidal.monitor.run_status import run_status, write_exit

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    lock = run / "run.lock"
    assert run_status(run)["state"] == "unknown"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "now"}))
    client = TestClient(build_app([RunView(run)]), base_url="http://127.0.0.1")
    assert client.get("/api/runs").json()["runs"][0]["status"]["state"] == "running"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "then"}))
    assert run_status(run)["state"] == "ended" and "no exit code was recorded" in run_status(run)["message"]
    lock.write_text("")  # released, as the run does when it ends
    write_exit(run, 3, "RunFailed: 60% of the episodes failed for 3 steps")
    got = client.get("/api/runs").json()["runs"][0]["status"]
    assert (got["state"], got["exit_code"]) == ("failed", 3) and "60% of the episodes" in got["message"]
    write_exit(run, 0)
    assert run_status(run)["state"] == "finished"

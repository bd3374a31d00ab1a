"""The dashboard's page in a real browser: Debian's headless Chromium driven by Playwright,
against `tidal dashboard`'s server over two real runs (tests/conftest.py `dashboard_runs`).
Screenshots are checked for the runs' colors, not only taken; with TIDAL_SCREENSHOTS=DIR they
are also kept there."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest
from browser_support import require_chromium
from dashboard_vlm_run import make_vlm_run

from tidal.models.vision import image_runs
from tidal.monitor.dashboard.server import DashboardServer
from tidal.monitor.episodes import EpisodeWriter, iter_episodes
from tidal.monitor.run_status import write_exit
from tidal.types import Episode, Status, ToolCallRecord, Turn

pytest.importorskip("duckdb", reason="the dashboard extra (duckdb, plotly) is in the dev extra")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
Image = pytest.importorskip("PIL.Image")

RUN_COLORS = {0: (0x1F, 0x77, 0xB4), 1: (0xD6, 0x27, 0x28)}  # app.js COLORS[0], COLORS[1]
POLICY_COLOR = (0xCF, 0xE3, 0xFF)  # app.js tokenColor, mode "mask", a trained token


@pytest.fixture(scope="module")
def browser():
    path = require_chromium()
    with playwright.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, args=["--no-sandbox"])  # root: Chromium's own sandbox needs a user
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(dashboard_runs):
    with DashboardServer(list(dashboard_runs)) as s:
        yield s


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    p = ctx.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    yield p
    ctx.close()
    assert errors == [], f"the page raised: {errors}"


def shot(locator, name: str, tmp_path: Path) -> Image.Image:
    png = locator.screenshot()
    (tmp_path / f"{name}.png").write_bytes(png)
    keep = os.environ.get("TIDAL_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"dashboard-{name}.png").write_bytes(png)
    return Image.open(io.BytesIO(png)).convert("RGB")


def pixels_near(img: Image.Image, rgb: tuple[int, int, int], tol: int = 24) -> int:
    """Pixels within `tol` of `rgb` in every channel (anti-aliasing blends line edges)."""
    a = np.asarray(img, dtype=np.int16)
    return int((np.abs(a - np.array(rgb, dtype=np.int16)) <= tol).all(axis=-1).sum())


def load(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("body[data-ready]", timeout=60_000)
    assert page.evaluate("document.body.dataset.ready") == "1", page.text_content("#status")


def chart(page, metric: str):
    return page.locator(f'div.chart[data-metric="{metric}"]')


def store(run_dir):
    return ds.dataset(str(run_dir / "episodes"), format="parquet").to_table().to_pylist()


def test_the_page_draws_both_runs_curves(page, server, dashboard_runs, tmp_path):
    load(page, server.url)
    reward = chart(page, "reward")
    steps = [sum(1 for line in (r / "metrics.jsonl").read_text().splitlines() if '"reward"' in line)
             for r in dashboard_runs]
    assert steps == [4, 3]
    assert reward.get_attribute("data-points") == str(sum(steps))
    # smoothing on: a faint raw and a smoothed line per run, each an SVG path with points
    lines = reward.locator(".scatterlayer .trace path.js-line")
    assert lines.count() == 4
    assert all(len(lines.nth(i).get_attribute("d") or "") > 10 for i in range(4))
    # a metric logged on some steps only (run a evaluates at steps 0, 2 and 4): its points joined and marked
    evals = chart(page, "eval/accuracy")
    assert evals.get_attribute("data-points") == "3"
    traces = evals.locator(".scatterlayer .trace")  # run a's line as measured (not smoothed), the events' markers
    assert traces.count() == 2
    assert traces.nth(0).locator("path.point").count() == 3 and len(traces.nth(0).locator("path.js-line")
                                                                   .get_attribute("d")) > 10
    img = shot(reward, "curves", tmp_path)
    for r, rgb in RUN_COLORS.items():
        assert pixels_near(img, rgb) > 100, f"run {r}'s line is not drawn in {rgb}"
    shot(page.locator("body"), "page", tmp_path)


def test_smoothing_and_the_wall_clock_axis(page, server):
    load(page, server.url)
    page.eval_on_selector("#smoothing", "(e) => { e.value = '0'; e.dispatchEvent(new Event('input')); }")
    lines = chart(page, "reward").locator(".scatterlayer .trace path.js-line")
    assert lines.count() == 2  # raw only: one line per run
    assert chart(page, "reward").locator(".g-xtitle").text_content() == "step"
    page.select_option("#xaxis", "wall")
    assert chart(page, "reward").locator(".g-xtitle").text_content() == "wall clock (s)"


def test_sparse_evaluations_are_drawn_as_measured(page, server, dashboard_runs):
    """Smoothing averages a metric logged every step; the evaluations (a few points far apart)
    are drawn as measured: an average over them drew 0.40 where an evaluation gave 0.64."""
    load(page, server.url)
    assert page.eval_on_selector("#smoothing", "(e) => Number(e.value)") > 0  # smoothing is on (the default)
    drawn = page.evaluate("() => document.querySelector('div.chart[data-metric=\"eval/accuracy\"]').data[0].y")
    rows = [json.loads(line) for line in (dashboard_runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert drawn == [r.get("eval/accuracy") for r in rows]
    # the case of the report: an evaluation series that moves, under the page's own functions
    ys = [None, 0.2, None, None, 0.4, None, 0.64]
    assert page.evaluate("(ys) => drawnValues(ys, 0.6)", ys) == ys  # no evaluation has a logged neighbour
    assert page.evaluate("(ys) => smooth(ys, 0.6)", ys)[-1] < 0.5  # what smoothing would have drawn
    every_step = [None, 0.1, 0.9, 0.2, 0.8]  # a step-0 row of evaluations only: the rest is smoothed as before
    assert page.evaluate("(ys) => drawnValues(ys, 0.6)", every_step) == page.evaluate("(ys) => smooth(ys, 0.6)",
                                                                                       every_step) != every_step


@pytest.mark.parametrize("width", [700, 1400])
def test_the_plot_toolbar_leaves_the_titles_free(browser, server, width):
    """Plotly's toolbar (the modebar, shown on hover) and a chart's title do not overlap, on the
    narrowest chart the grid makes (420 px) and on a wide one, for the longest default title."""
    ctx = browser.new_context(viewport={"width": width, "height": 1000})
    page = ctx.new_page()
    try:
        load(page, server.url)
        div = chart(page, "episodes/failed_frac")
        div.hover()
        page.wait_for_selector('div.chart[data-metric="episodes/failed_frac"] .modebar', state="visible")
        title, bar = div.locator(".gtitle").bounding_box(), div.locator(".modebar").bounding_box()
        assert title and bar
        apart = (title["x"] + title["width"] <= bar["x"] or bar["x"] + bar["width"] <= title["x"]
                 or title["y"] + title["height"] <= bar["y"] or bar["y"] + bar["height"] <= title["y"])
        assert apart, f"the toolbar {bar} covers the title {title}"
    finally:
        ctx.close()


def test_alert_and_hacking_events_are_marked(page, server):
    load(page, server.url)
    reward = chart(page, "reward")
    assert reward.get_attribute("data-events") == "2"  # run b: an alert at step 2, a hacking event at step 3
    assert reward.locator(".shapelayer path").count() == 2
    page.uncheck("#show-events")
    assert reward.get_attribute("data-events") == "0"
    assert reward.locator(".shapelayer path").count() == 0


def test_any_metric_can_be_drawn(page, server):
    load(page, server.url)
    assert chart(page, "lr").count() == 0
    page.fill("#metric-filter", "lr")
    page.locator("#metric-list label", has_text="lr").first.locator("input").check()
    assert chart(page, "lr").get_attribute("data-points") == "7"


def test_episodes_are_filtered_and_opened(page, server, dashboard_runs, tmp_path):
    load(page, server.url)
    page.click("button[data-tab=episodes]")
    episodes = store(dashboard_runs[0])
    assert page.locator("tr.episode-row").count() == 50 and str(len(episodes)) in page.text_content(
        "#episode-summary")
    want = sorted(e["episode_id"] for e in episodes if e["step"] == 3 and e["reward"] >= 1.0)
    before = page.text_content("#episode-summary")
    page.fill("input[name=step_min]", "3")
    page.fill("input[name=step_max]", "3")
    page.fill("input[name=reward_min]", "1")
    page.click("#episode-filters button[type=submit]")
    page.wait_for_function("(b) => document.querySelector('#episode-summary').textContent !== b", arg=before)
    rows = page.locator("tr.episode-row")
    assert sorted(rows.nth(i).get_attribute("data-id") for i in range(rows.count())) == want
    page.fill("input[name=text]", "what is 1")
    before = page.text_content("#episode-summary")
    page.click("#episode-filters button[type=submit]")
    page.wait_for_function("(b) => document.querySelector('#episode-summary').textContent !== b", arg=before)
    want = sorted(e["episode_id"] for e in episodes if e["step"] == 3 and e["reward"] >= 1.0
                  and "what is 1" in e["text"].lower())
    assert 0 < len(want) and sorted(rows.nth(i).get_attribute("data-id") for i in range(rows.count())) == want

    first = rows.nth(0).get_attribute("data-id")
    rows.nth(0).click()
    page.wait_for_selector(".tokens span.tok")
    recorded = next(e for e in episodes if e["episode_id"] == first)
    assert page.locator(".tokens span.tok").count() == len(recorded["tokens"])
    assert page.locator(".tokens span.tok-policy").count() == sum(recorded["loss_mask"])
    assert page.locator(".tokens span.tok-prompt").count() == recorded["prompt_len"]
    assert page.text_content(".tokens") == recorded["text"]  # as the model saw it, special tokens kept
    assert "correct" in page.text_content("#episode-detail .reward-parts table.kv")
    # the prompt as the model saw it, beside the task row's reference answer
    assert "What is" in page.text_content("#episode-detail pre.prompt-text")
    assert "answer" in page.text_content("#episode-detail div.reference table.kv")
    img = shot(page.locator("#episode-detail"), "episode", tmp_path)
    assert pixels_near(img, POLICY_COLOR, tol=6) > 200  # trained tokens on their loss-mask color
    page.select_option("#color-mode", "logprob")
    colors = page.eval_on_selector_all(".tokens span.tok-policy", "(s) => s.map((x) => x.style.backgroundColor)")
    assert all(c.startswith("rgb") and c != "rgb(207, 227, 255)" for c in colors)
    assert page.eval_on_selector_all(".tokens span.tok-prompt", "(s) => s.map((x) => x.style.backgroundColor)") == [
        ""] * recorded["prompt_len"]
    img = shot(page.locator("#episode-detail"), "episode-logprob", tmp_path)
    assert pixels_near(img, POLICY_COLOR, tol=6) < 20


def test_the_config_tab_shows_what_differs(page, server):
    load(page, server.url)
    page.click("button[data-tab=config]")
    page.wait_for_selector("#config-table tbody tr")
    row = page.locator("#config-table tbody tr", has_text="train.lr")
    assert [row.locator("td").nth(i).text_content() for i in range(3)] == ["train.lr", "0.0003", "0.0001"]
    assert page.locator("#config-table tbody tr", has_text="model.path").count() == 0
    page.check("#config-all")
    page.wait_for_selector('#config-table tbody tr:has-text("model.path")')  # drawn after a fetch
    assert page.locator("#config-table tbody tr", has_text="model.path").count() == 1


def test_a_running_runs_new_steps_appear_without_a_reload(browser, dashboard_runs, tmp_path):
    run = tmp_path / "live"
    shutil.copytree(dashboard_runs[0], run)
    with DashboardServer([run]) as srv:
        ctx = browser.new_context()
        page = ctx.new_page()
        load(page, srv.url)
        page.evaluate("window.__same_page = true")
        assert chart(page, "reward").get_attribute("data-last-step") == "4"
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({**rows[-1], "step": 5, "reward": 1.5}) + "\n")
        step4 = [e for e in iter_episodes(run / "episodes") if e.step == 4]
        with EpisodeWriter(run / "episodes") as w:
            w.write(5, [Episode(**{**e.__dict__, "step": 5, "episode_id": e.episode_id.replace("s4", "s5")})
                        for e in step4])
        # (functions, not strings: the page's CSP allows no eval, which Playwright's string form needs)
        page.wait_for_function("() => document.querySelector('div.chart[data-metric=\"reward\"]').dataset.lastStep "
                               "=== '5'", timeout=15_000)
        n = sum(1 for _ in iter_episodes(run / "episodes"))
        page.wait_for_function("(n) => document.querySelector('#runs').textContent.includes(`${n} episodes`)",
                               arg=n, timeout=15_000)
        assert page.evaluate("window.__same_page") is True
        ctx.close()


def test_a_vlm_episode_shows_its_pictures_in_place_of_their_pad_runs(page, tmp_path):
    vlm = make_vlm_run(tmp_path)
    ep, runs = vlm.episode, image_runs(vlm.episode.tokens, vlm.pad_id)
    with DashboardServer([vlm.dir]) as srv:
        load(page, srv.url)
        page.click("button[data-tab=episodes]")
        page.locator("tr.episode-row").first.click()
        page.wait_for_selector(".tokens span.tok-image img")
        pics = page.locator(".tokens span.tok-image img")
        page.wait_for_function("() => [...document.querySelectorAll('.tokens img')].every((i) => i.complete)")
        # the pictures loaded (a broken image has naturalWidth 0), in token order: 100x60, then 56x56 pixels
        assert pics.evaluate_all("(xs) => xs.map((x) => [x.naturalWidth, x.naturalHeight])") == [[100, 60], [56, 56]]
        spans = page.locator(".tokens span.tok-image")
        assert [(int(spans.nth(k).get_attribute("data-start")), int(spans.nth(k).get_attribute("data-end")))
                for k in range(2)] == runs
        # each run of 8 and 4 pads is one element; every other token is as before, one span each
        assert page.locator(".tokens span.tok").count() == len(ep.tokens) - sum(e - s - 1 for s, e in runs)
        text = page.text_content(".tokens")
        assert text.count("<|image_pad|>") == 2 and "<|image_pad|>×8" in text and "<|image_pad|>×4" in text
        assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|>×8<|vision_end|>")
        assert page.locator("ol.images li").evaluate_all("(xs) => xs.map((x) => x.dataset.id)") == ep.images
        assert "images (2)" in page.text_content("#episode-detail")
        img = shot(page.locator(".tokens"), "episode-images", tmp_path)
        assert pixels_near(img, (255, 0, 0), tol=10) > 200  # the red picture drawn (not only loaded)
        small = pics.first.bounding_box()["height"]
        spans.first.click()  # enlarged
        assert pics.first.bounding_box()["height"] > 4 * small
        spans.first.click()
        assert pics.first.bounding_box()["height"] == small


PAYLOAD = '<img src=x onerror="window.__pwned=1">'


def test_model_output_is_shown_as_text_never_run(browser, tmp_path):
    """Episode texts, errors, tool arguments, env names and metric names are written by the
    policy or the user's code: the page shows them literally and runs none of them."""
    run = tmp_path / "hostile"
    (run / "episodes").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5, PAYLOAD: 1.0}) + "\n")
    (run / "events.jsonl").write_text(json.dumps({"kind": "alert", "alert": PAYLOAD, "step": 1,
                                                  "message": "<script>window.__pwned=4</script>"}) + "\n")
    with EpisodeWriter(run / "episodes") as w:
        w.write(1, [Episode(episode_id="s1-p0-e0", group_id="g", task_id=PAYLOAD, env=PAYLOAD, tokens=[5, 6, 7],
                            loss_mask=[False, True, True], logprobs=[0.0, -0.1, -0.2], versions=[-1, 0, 0],
                            reward=0.0, status=Status.REWARD_ERROR, error="<script>window.__pwned=2</script>",
                            reward_parts={PAYLOAD: 0.0}, prompt_len=1, step=1,
                            turns=[Turn(0, 1, 3, 3, PAYLOAD, "stop", 0.0, [
                                ToolCallRecord(PAYLOAD, "<b onmouseover=window.__pwned=3>x</b>", "c", "args",
                                               PAYLOAD, output="<img src=x onerror=window.__pwned=5>")], 0)],
                            reference=json.dumps({"answer": "<img src=x onerror=window.__pwned=6>"}))])
    write_exit(run, 3, "RunFailed: <script>window.__pwned=7</script>")
    with DashboardServer([run]) as srv:
        ctx = browser.new_context()
        page = ctx.new_page()
        load(page, srv.url)
        assert page.locator("#metric-list label", has_text=PAYLOAD).count() == 1
        badge = page.locator("#runs .run-status")  # how the run ended, from its exit.json
        assert badge.text_content() == "failed (exit 3)" and "<script>" in badge.get_attribute("title")
        page.click("button[data-tab=episodes]")
        page.locator("tr.episode-row").first.click()
        page.wait_for_selector("#episode-detail pre.error")
        assert page.text_content("#episode-detail pre.error") == "<script>window.__pwned=2</script>"
        assert PAYLOAD in page.text_content("#episode-detail")
        # the tool's answer under its call, and the reference answer: shown as text
        assert page.text_content("#episode-detail li.call pre.tool-output") == "<img src=x onerror=window.__pwned=5>"
        assert "<img src=x onerror=window.__pwned=6>" in page.text_content("#episode-detail div.reference")
        page.hover("li.call")
        assert page.evaluate("window.__pwned") is None
        assert page.locator("#episode-detail img, #episode-detail script, #episode-detail b[onmouseover]").count() == 0
        ctx.close()

// tidal dashboard: curves, episodes and config of run directories (tidal/monitor/dashboard).
// Data comes from the server's /api routes; Plotly draws. Everything a run wrote (episode
// text, errors, config values) enters the page through textContent only, never as HTML.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const DEFAULT_METRICS = ["reward", "accuracy", "eval/accuracy", "entropy", "kl", "grad_norm", "response_tokens",
                         "episodes/failed_frac", "mismatch_kl", "time/step_s"];
const POLL_MS = 2000;

const state = {
  runs: [],            // from /api/runs
  metrics: [],         // per run: {steps, columns, generation, total}
  events: [],          // per run: [{kind, name, step, message}]
  shown: new Set(),    // metric names with a chart
  visible: new Set(),  // run indexes drawn
  listedMetrics: "",   // the metric list's names, to redraw it only when they change
  page: {offset: 0, limit: 50, total: 0},
  colorMode: "mask",
  episode: null,
  episodeRun: null,    // the run index the open episode came from (its pictures are asked of that run)
};

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

async function getJSON(path, params) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params || {})) {
    if (v !== null && v !== undefined && v !== "") url.searchParams.set(k, v);
  }
  const r = await fetch(url, {credentials: "same-origin"});
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || `${r.status} ${path}`);
  return body;
}

function setStatus(text, bad) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = bad ? "bad" : "";
}

function fmt(v, digits = 4) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "number") {
    if (Number.isInteger(v)) return String(v);
    return Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(2) : v.toFixed(digits);
  }
  return String(v);
}

// ---- curves ---------------------------------------------------------------------------

function smooth(values, weight) {
  // TensorBoard's debiased exponential moving average; gaps (null) are kept as gaps.
  const out = [];
  let last = 0, n = 0;
  for (const v of values) {
    if (v === null || v === undefined) { out.push(null); continue; }
    last = last * weight + (1 - weight) * v;
    n += 1;
    out.push(weight > 0 ? last / (1 - Math.pow(weight, n)) : v);
  }
  return out;
}

function isSparse(values) {
  // A metric not logged every step (the evaluations, or a step-0 row of them): joined, with markers.
  return values.some((v) => v === null || v === undefined);
}

function drawnValues(values, weight) {
  // What a curve draws: each run of consecutive logged steps smoothed on its own, so a point
  // with no logged neighbour (an evaluation every N steps) is drawn as measured. Smoothing
  // across the gaps averaged a handful of evaluations far apart: it drew 0.40 where one gave 0.64.
  if (!(weight > 0)) return values;
  const out = [];
  let run = [];
  const flush = () => { out.push(...(run.length > 1 ? smooth(run, weight) : run)); run = []; };
  for (const v of values) {
    if (v === null || v === undefined) { flush(); out.push(null); } else run.push(v);
  }
  flush();
  return out;
}

function metricNames() {
  const names = new Set();
  for (const m of state.metrics) if (m) for (const k of Object.keys(m.columns)) names.add(k);
  return [...names].sort();
}

function renderMetricList() {
  const names = metricNames();
  const filter = document.getElementById("metric-filter").value.trim().toLowerCase();
  const key = names.join("\n") + "|" + filter;
  if (key === state.listedMetrics) return;
  state.listedMetrics = key;
  const list = document.getElementById("metric-list");
  list.replaceChildren();
  for (const name of names) {
    if (filter && !name.toLowerCase().includes(filter)) continue;
    const box = el("input", {type: "checkbox", onchange: (e) => {
      if (e.target.checked) state.shown.add(name); else state.shown.delete(name);
      drawCharts();
    }});
    box.checked = state.shown.has(name);
    list.append(el("label", {class: "metric"}, box, name));
  }
}

function xValues(m) {
  if (document.getElementById("xaxis").value === "wall") return m.columns["time/elapsed_s"] || m.steps.map(() => null);
  return m.steps;
}

function eventShapes(yref) {
  if (!document.getElementById("show-events").checked) return {shapes: [], marks: []};
  const shapes = [], marks = [];
  const wall = document.getElementById("xaxis").value === "wall";
  state.events.forEach((events, r) => {
    if (!state.visible.has(r) || !events) return;
    const m = state.metrics[r];
    for (const e of events) {
      let x = e.step;
      if (wall) {
        const i = m.steps.indexOf(e.step);
        x = i >= 0 && m.columns["time/elapsed_s"] ? m.columns["time/elapsed_s"][i] : null;
        if (x === null) continue;
      }
      const color = {alert: "#d62728", hacking: "#ff7f0e", restart: "#9467bd"}[e.kind] || "#7f7f7f";
      shapes.push({type: "line", x0: x, x1: x, xref: "x", y0: 0, y1: 1, yref: yref,
                   line: {color, width: 1, dash: "dot"}});
      marks.push({x, text: `${state.runs[r].name}: ${e.kind} ${e.name} at step ${e.step}: ${e.message}`, color});
    }
  });
  return {shapes, marks};
}

function drawCharts() {
  const charts = document.getElementById("charts");
  const wanted = [...state.shown].filter((n) => metricNames().includes(n)).sort();
  for (const div of [...charts.children]) {
    if (!wanted.includes(div.dataset.metric)) { Plotly.purge(div); div.remove(); }
  }
  const weight = Number(document.getElementById("smoothing").value);
  const {shapes, marks} = eventShapes("paper");
  for (const name of wanted) {
    let div = charts.querySelector(`div.chart[data-metric="${CSS.escape(name)}"]`);
    if (!div) {
      div = el("div", {class: "chart", dataset: {metric: name}});
      charts.append(div);
    }
    const traces = [];
    let points = 0, lastStep = null;
    state.metrics.forEach((m, r) => {
      if (!m || !state.visible.has(r) || !m.columns[name]) return;
      const ys = m.columns[name], xs = xValues(m), color = COLORS[r % COLORS.length];
      const kind = ys.length > 2000 ? "scattergl" : "scatter";
      const present = ys.filter((v) => v !== null).length;
      const sparse = isSparse(ys);  // not logged every step (evaluations): joined, with markers, unsmoothed
      points += present;
      lastStep = m.steps.length ? Math.max(lastStep ?? -Infinity, m.steps[m.steps.length - 1]) : lastStep;
      const drawn = drawnValues(ys, weight);
      if (drawn.some((v, i) => v !== ys[i])) {  // smoothing moved a point: the raw curve, faint, behind
        traces.push({x: xs, y: ys, type: kind, mode: "lines", name: `${state.runs[r].name} (raw)`, showlegend: false,
                     line: {color, width: 1}, opacity: 0.25, hoverinfo: "skip", connectgaps: sparse});
      }
      traces.push({x: xs, y: drawn, type: kind, mode: sparse ? "lines+markers" : "lines",
                   name: state.runs[r].name, line: {color, width: 2}, connectgaps: sparse});
    });
    if (marks.length) {
      traces.push({x: marks.map((k) => k.x), y: marks.map(() => 1), yaxis: "y2", type: "scatter", mode: "markers",
                   marker: {symbol: "triangle-down", size: 9, color: marks.map((k) => k.color)},
                   text: marks.map((k) => k.text), hoverinfo: "text", name: "events", showlegend: false});
    }
    const layout = {
      // The title sits just above the plot, at its left, below the band of Plotly's toolbar (the
      // modebar, top right on hover), which covered a centred title on a narrow chart.
      title: {text: name, font: {size: 13}, x: 0, xref: "paper", xanchor: "left", y: 1, yref: "paper",
              yanchor: "bottom", pad: {b: 4}},
      height: 270, margin: {l: 50, r: 10, t: 52, b: 35},
      showlegend: state.visible.size > 1, legend: {orientation: "h", y: -0.2},
      xaxis: {title: {text: document.getElementById("xaxis").value === "wall" ? "wall clock (s)" : "step"}},
      yaxis: {exponentformat: "e"},
      yaxis2: {overlaying: "y", range: [0, 1.05], visible: false, fixedrange: true},
      shapes,
    };
    Plotly.react(div, traces, layout, {displaylogo: false, responsive: true,
                                       modeBarButtonsToRemove: ["select2d", "lasso2d"]});
    div.dataset.points = String(points);
    div.dataset.lastStep = lastStep === null ? "" : String(lastStep);
    div.dataset.events = String(marks.length);
  }
  document.body.dataset.charts = String(wanted.length);
}

async function refreshMetrics() {
  let changed = false;
  await Promise.all(state.runs.map(async (run, r) => {
    const held = state.metrics[r];
    const m = await getJSON("/api/metrics", {run: r, since: held ? held.steps.length : 0,
                                             generation: held ? held.generation : null});
    if (!held || m.reset) {
      state.metrics[r] = {steps: m.steps, columns: m.columns, generation: m.generation};
      changed = true;
    } else if (m.steps.length) {
      const n = held.steps.length;
      held.steps.push(...m.steps);
      for (const [k, vs] of Object.entries(m.columns)) {
        if (!held.columns[k]) held.columns[k] = new Array(n).fill(null);
        held.columns[k].push(...vs);
      }
      for (const col of Object.values(held.columns)) while (col.length < held.steps.length) col.push(null);
      changed = true;
    }
    const ev = await getJSON("/api/events", {run: r});
    if (!state.events[r] || ev.events.length !== state.events[r].length) changed = true;
    state.events[r] = ev.events;
  }));
  return changed;
}

// ---- episodes -------------------------------------------------------------------------

function episodeFilters() {
  const form = document.getElementById("episode-filters");
  const data = Object.fromEntries(new FormData(form).entries());
  data.status = [...form.querySelectorAll("#episode-status input:checked")].map((b) => b.value).join(",");
  return data;
}

async function loadEpisodes() {
  const params = {...episodeFilters(), offset: state.page.offset, limit: state.page.limit};
  const t0 = performance.now();
  let page;
  try {
    page = await getJSON("/api/episodes", params);
  } catch (e) {
    setStatus(e.message, true);
    return;
  }
  state.page.total = page.total;
  const body = document.querySelector("#episode-table tbody");
  body.replaceChildren();
  for (const row of page.rows) {
    body.append(el("tr", {class: `episode-row status-${row.status}`, dataset: {id: row.episode_id, step: row.step},
                          onclick: () => openEpisode(params.run, row.episode_id, row.step)},
      el("td", {}, row.step), el("td", {}, row.episode_id), el("td", {}, row.env), el("td", {}, row.status),
      el("td", {}, fmt(row.reward, 3)), el("td", {}, `${row.policy_tokens}/${row.n_tokens}`), el("td", {}, row.n_turns),
      el("td", {class: "error"}, row.error || "")));
  }
  const end = Math.min(page.offset + page.rows.length, page.total);
  document.getElementById("page-info").textContent = page.total ? `${page.offset + 1}–${end} of ${page.total}` : "none";
  document.getElementById("episode-summary").textContent =
    `${page.total} episodes match (${(performance.now() - t0).toFixed(0)} ms)`;
  document.body.dataset.episodes = String(page.total);
}

function tokenColor(mode, i, ep) {
  if (i < ep.prompt_len) return null;
  if (mode === "mask") return ep.loss_mask[i] ? "#cfe3ff" : "#fff1c2";
  if (!ep.loss_mask[i]) return null;
  if (mode === "logprob") {
    const p = Math.exp(ep.logprobs[i] ?? 0);  // red: unlikely under the sampling policy; green: likely
    return `hsl(${Math.round(120 * p)}, 75%, 80%)`;
  }
  const v = ep.versions[i];  // version: hue by weight version
  return `hsl(${(v * 47) % 360}, 60%, 82%)`;
}

function imageURL(run, id) {
  const url = new URL("/api/image", location.origin);
  url.searchParams.set("run", run);
  url.searchParams.set("id", id);
  return url.pathname + url.search;
}

function renderImageRun(ep, image, k) {
  // One image's run of pad tokens, collapsed: its picture (click to enlarge) and the pad, counted.
  const i = image.start, n = image.end - image.start;
  const kind = i < ep.prompt_len ? "prompt" : ep.loss_mask[i] ? "policy" : "obs";
  const pad = ep.pieces ? ep.pieces[i] : `[${ep.tokens[i]}]`;
  const span = el("span", {class: `tok tok-${kind} tok-image`, dataset: {start: i, end: image.end, id: image.id},
                           title: `#${i}–${image.end - 1} · image ${k + 1} · ${n} × id ${ep.tokens[i]} · ${kind} · ` +
                                  `${image.id} (click to enlarge)`,
                           onclick: () => span.classList.toggle("enlarged")},
    el("img", {class: "thumb", src: imageURL(state.episodeRun, image.id), alt: `image ${k + 1}`}), `${pad}×${n}`);
  const color = tokenColor(state.colorMode, i, ep);
  if (color) span.style.backgroundColor = color;
  return span;
}

function renderTokens(ep) {
  const box = el("div", {class: "tokens", dataset: {mode: state.colorMode}});
  const images = new Map((ep.image_runs || []).map((r, k) => [r.start, [r, k]]));
  const n = ep.tokens.length;
  for (let i = 0; i < n; i++) {
    if (images.has(i)) {
      const [image, k] = images.get(i);
      box.append(renderImageRun(ep, image, k));
      i = image.end - 1;
      continue;
    }
    const text = ep.pieces ? ep.pieces[i] : `[${ep.tokens[i]}]`;
    const kind = i < ep.prompt_len ? "prompt" : ep.loss_mask[i] ? "policy" : "obs";
    const title = `#${i} id ${ep.tokens[i]} · ${kind}` + (ep.loss_mask[i]
      ? ` · log-prob ${fmt(ep.logprobs[i], 4)} · version ${ep.versions[i]}` : "");
    const span = el("span", {class: `tok tok-${kind}`, title}, text);
    const color = tokenColor(state.colorMode, i, ep);
    if (color) span.style.backgroundColor = color;
    box.append(span);
  }
  return box;
}

function imageList(ep) {
  if (!ep.images || !ep.images.length) return null;
  const list = el("ol", {class: "images"});
  ep.images.forEach((id, k) => {
    const r = (ep.image_runs || [])[k];
    list.append(el("li", {dataset: {id}},
      el("a", {href: imageURL(state.episodeRun, id), target: "_blank", rel: "noopener"}, id),
      r ? ` · tokens ${r.start}–${r.end - 1} (${r.end - r.start})` : ""));
  });
  return el("div", {}, el("h3", {}, `images (${ep.images.length})`), list,
    ep.images_note ? el("p", {class: "note"}, ep.images_note) : null);
}

function keyValueTable(obj) {
  const t = el("table", {class: "kv"});
  for (const [k, v] of Object.entries(obj || {})) t.append(el("tr", {}, el("th", {}, k), el("td", {}, fmt(v))));
  return t;
}

function renderEpisode() {
  const ep = state.episode;
  const box = document.getElementById("episode-detail");
  box.classList.remove("hidden");
  const modes = el("select", {id: "color-mode", onchange: (e) => { state.colorMode = e.target.value; renderEpisode(); }},
    el("option", {value: "mask"}, "loss mask"), el("option", {value: "logprob"}, "log-prob"),
    el("option", {value: "version"}, "weight version"));
  modes.value = state.colorMode;
  const turns = el("div", {class: "turns"});
  for (const t of ep.turns || []) {
    const calls = el("ul", {class: "calls"});
    let outputs = 0;
    for (const c of t.tool_calls || []) {
      if (c.output) outputs += 1;
      calls.append(el("li", {class: `call call-${c.status}`},
        `${c.name}(${c.arguments}) → ${c.status}`, c.error ? ` · ${c.error}` : "",
        ` · ${c.output_chars} chars · ${fmt(c.duration_s, 3)} s`,
        c.output ? el("pre", {class: "tool-output"}, c.output) : null));
    }
    // Tools an agent ran itself (no output recorded), or a store from before outputs were kept:
    // the observation that followed the turn, as the model saw it.
    const obs = !outputs && t.observation ? el("details", {class: "observation"},
      el("summary", {}, "observation (as the model saw it)"), el("pre", {class: "tool-output"}, t.observation)) : null;
    turns.append(el("div", {class: "turn"},
      el("b", {}, `turn ${t.index}`), ` tokens ${t.start}–${t.end}` + (t.obs_end > t.end ? `, observation to ${t.obs_end}` : "") +
      ` · ${t.finish_reason} · reward ${fmt(t.reward, 3)} · version ${t.version}`, calls, obs));
  }
  box.replaceChildren(...[
    el("h2", {}, `${ep.episode_id}`, el("button", {class: "close", onclick: () => box.classList.add("hidden")}, "×")),
    el("p", {class: `status-${ep.status}`},
      `step ${ep.step} · env ${ep.env} · task ${ep.task_id} · group ${ep.group_id} · seed ${ep.seed} · `,
      el("b", {}, ep.status), ` · reward ${fmt(ep.reward)}`),
    ep.error ? el("pre", {class: "error"}, ep.error) : null,
    promptAndReference(ep),
    el("div", {class: "cols"},
      el("div", {class: "reward-parts"}, el("h3", {}, "reward parts"), keyValueTable(ep.reward_parts)),
      el("div", {}, el("h3", {}, "metrics"), keyValueTable(ep.metrics))),
    ep.turns && ep.turns.length ? el("div", {}, el("h3", {}, "turns and tool calls"), turns) : null,
    imageList(ep),
    el("h3", {}, "as the model saw it ", el("label", {}, "color by ", modes)),
    el("div", {class: "legend"}, legendFor(state.colorMode)),
    ep.pieces_note ? el("p", {class: "note"}, ep.pieces_note) : null,
    renderTokens(ep)].filter((x) => x !== null));
}

function promptAndReference(ep) {
  // The prompt as the model saw it, beside what the episode was judged against (the task row's
  // other columns: the reference answer, tests, ...).
  const ref = ep.reference_fields ? keyValueTable(ep.reference_fields)
    : el("pre", {class: "reference"}, ep.reference || "– (the task row has no column but its prompt)");
  return el("div", {class: "cols prompt-reference"},
    el("div", {class: "prompt"}, el("h3", {}, "prompt"),
      el("pre", {class: "prompt-text"}, ep.prompt_text ?? "– (the run's tokenizer did not load)")),
    el("div", {class: "reference"}, el("h3", {}, "reference (the task row)"), ref));
}

function legendFor(mode) {
  if (mode === "mask") {
    return el("span", {}, el("span", {class: "tok tok-prompt"}, "prompt"), " ",
      el("span", {class: "tok", style: "background:#cfe3ff"}, "policy (trained)"), " ",
      el("span", {class: "tok", style: "background:#fff1c2"}, "observation (not trained)"));
  }
  if (mode === "logprob") {
    return el("span", {}, "policy tokens by probability under the sampling weights: ",
      el("span", {class: "tok", style: "background:hsl(0,75%,80%)"}, "0"), " ",
      el("span", {class: "tok", style: "background:hsl(60,75%,80%)"}, "0.5"), " ",
      el("span", {class: "tok", style: "background:hsl(120,75%,80%)"}, "1"));
  }
  return el("span", {}, "policy tokens colored by the weight version that generated them (hover for the number)");
}

async function openEpisode(run, id, step) {
  try {
    state.episode = await getJSON("/api/episode", {run, id, step});
    state.episodeRun = run;
  } catch (e) {
    setStatus(e.message, true);
    return;
  }
  renderEpisode();
}

function fillEpisodeFilters() {
  const r = Number(document.getElementById("episode-run").value || 0);
  const facets = state.runs[r].episodes;
  const env = document.getElementById("episode-env");
  const chosen = env.value;
  env.replaceChildren(el("option", {value: ""}, "any"),
    ...Object.entries(facets.envs).map(([e, n]) => el("option", {value: e}, `${e} (${n})`)));
  env.value = chosen in facets.envs ? chosen : "";
  const box = document.getElementById("episode-status");
  const checked = new Set([...box.querySelectorAll("input:checked")].map((b) => b.value));
  box.replaceChildren(el("legend", {}, "status"));
  for (const [s, n] of Object.entries(facets.statuses)) {
    const b = el("input", {type: "checkbox", value: s});
    b.checked = checked.has(s);
    box.append(el("label", {}, b, `${s} (${n})`));
  }
}

// ---- config ---------------------------------------------------------------------------

async function renderConfig() {
  const c = await getJSON("/api/config");
  const all = document.getElementById("config-all").checked;
  const head = document.querySelector("#config-table thead");
  head.replaceChildren(el("tr", {}, el("th", {}, "key"), ...c.runs.map((n) => el("th", {}, n))));
  const body = document.querySelector("#config-table tbody");
  body.replaceChildren();
  const differ = new Set(c.diff.map((d) => d.key));
  const rows = all ? [...new Set(c.configs.flatMap((x) => Object.keys(x)))].sort()
                   .map((key) => ({key, values: c.configs.map((x) => x[key])})) : c.diff;
  for (const row of rows) {
    body.append(el("tr", {class: differ.has(row.key) ? "differs" : ""}, el("td", {}, row.key),
      ...row.values.map((v) => el("td", {}, v === undefined || v === null ? "–" : JSON.stringify(v)))));
  }
  if (!rows.length) body.append(el("tr", {}, el("td", {colspan: String(c.runs.length + 1)},
    c.runs.length > 1 ? "the runs' configs are the same" : "one run: tick 'every key' to see its config")));
}

// ---- the page -------------------------------------------------------------------------

function renderRuns() {
  const box = document.getElementById("runs");
  box.replaceChildren();
  state.runs.forEach((run, r) => {
    const b = el("input", {type: "checkbox", onchange: (e) => {
      if (e.target.checked) state.visible.add(r); else state.visible.delete(r);
      drawCharts();
    }});
    b.checked = state.visible.has(r);
    box.append(el("label", {class: "run", title: run.path, style: `border-color:${COLORS[r % COLORS.length]}`}, b,
      run.name, el("small", {}, ` ${run.episodes.episodes} episodes `), statusBadge(run.status)));
  });
  const select = document.getElementById("episode-run");
  const chosen = select.value;
  select.replaceChildren(...state.runs.map((run, r) => el("option", {value: String(r)}, run.name)));
  if (chosen) select.value = chosen;
}

function statusBadge(status) {
  // running / finished / failed (exit code) / interrupted, from the run directory (tidal/monitor/run_status.py)
  if (!status) return null;
  const code = status.exit_code !== undefined && status.exit_code !== null ? ` (exit ${status.exit_code})` : "";
  const title = [status.message, status.pid ? `pid ${status.pid} on ${status.host}` : "", status.started ? `since ${status.started}` : "",
                 status.time ? `at ${status.time}` : ""].filter((x) => x).join(" · ");
  return el("span", {class: `run-status run-${status.state}`, title, dataset: {state: status.state}}, `${status.state}${code}`);
}

async function poll() {
  if (document.getElementById("live").checked) {
    try {
      const changed = await refreshMetrics();
      if (changed) { renderMetricList(); drawCharts(); }
      const runs = (await getJSON("/api/runs")).runs;
      const seen = (rs) => JSON.stringify(rs.map((x) => [x.episodes, x.status]));
      if (seen(runs) !== seen(state.runs)) {
        state.runs = runs;
        renderRuns();
        fillEpisodeFilters();
      }
      setStatus(`updated ${new Date().toLocaleTimeString()}`);
    } catch (e) {
      setStatus(`live update failed: ${e.message}`, true);
    }
  }
  setTimeout(poll, POLL_MS);
}

async function main() {
  for (const b of document.querySelectorAll("button.tab")) {
    b.addEventListener("click", () => {
      for (const t of document.querySelectorAll("button.tab")) t.classList.toggle("active", t === b);
      for (const p of document.querySelectorAll("section.panel")) p.classList.toggle("hidden", p.id !== `tab-${b.dataset.tab}`);
      if (b.dataset.tab === "config") renderConfig();
      if (b.dataset.tab === "curves") drawCharts();
    });
  }
  document.getElementById("metric-filter").addEventListener("input", renderMetricList);
  document.getElementById("xaxis").addEventListener("change", drawCharts);
  document.getElementById("show-events").addEventListener("change", drawCharts);
  document.getElementById("smoothing").addEventListener("input", (e) => {
    document.getElementById("smoothing-value").textContent = Number(e.target.value).toFixed(2);
    drawCharts();
  });
  document.getElementById("config-all").addEventListener("change", renderConfig);
  document.getElementById("episode-filters").addEventListener("submit", (e) => {
    e.preventDefault();
    state.page.offset = 0;
    loadEpisodes();
  });
  document.getElementById("episode-run").addEventListener("change", () => { fillEpisodeFilters(); state.page.offset = 0; loadEpisodes(); });
  document.getElementById("prev-page").addEventListener("click", () => {
    state.page.offset = Math.max(0, state.page.offset - state.page.limit);
    loadEpisodes();
  });
  document.getElementById("next-page").addEventListener("click", () => {
    if (state.page.offset + state.page.limit < state.page.total) { state.page.offset += state.page.limit; loadEpisodes(); }
  });
  try {
    state.runs = (await getJSON("/api/runs")).runs;
    state.runs.forEach((_, r) => state.visible.add(r));
    renderRuns();
    fillEpisodeFilters();
    await refreshMetrics();
    for (const name of metricNames()) if (DEFAULT_METRICS.includes(name)) state.shown.add(name);
    if (!state.shown.size) for (const name of metricNames().slice(0, 6)) state.shown.add(name);
    renderMetricList();
    drawCharts();
    await loadEpisodes();
    document.body.dataset.ready = "1";
    setStatus("");
  } catch (e) {
    setStatus(e.message, true);
    document.body.dataset.ready = "error";
  }
  setTimeout(poll, POLL_MS);
}

document.addEventListener("DOMContentLoaded", main);

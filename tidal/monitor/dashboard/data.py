"""What `tidal dashboard` reads from a run directory, read as the run writes it.

- `metrics.jsonl` and the event files are read incrementally: a byte offset per file, a
  half-written last line left for the next read, so a live run costs only its new lines. A
  step logged again (a resume that lost its last checkpoint re-runs steps) replaces the rows
  from that step on, and the reader says so (`reset`), so curves never show a step twice.
- `config.yaml` is flattened to `section.key` leaves for the config diff, with the hash of each
  file of code the run copied (`sources.<key>`, from `sources.json`).
- The Parquet episode store is queried through DuckDB: filters and the page's order and limit
  pushed into the scan, only the columns a view shows (never `tokens`/`logprobs` for the
  list), and the step range pruned by file name before DuckDB opens a file, so a list page of
  a 1,000,000-episode run reads a few columns, and one episode reads one step's file.
- A vision-language episode's pictures are files of the store's `images/` folder, by id (a
  content hash, so a picture never changes and may be cached for good); an episode names where
  each sits in its tokens (`image_runs`: the runs of the tokenizer's `<|image_pad|>`, in order).
"""

from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tidal.images import ImageDir
from tidal.monitor.episodes import IMAGES_DIR, batch_decoder, episode_files, file_step

LIST_COLUMNS = ("step", "episode_id", "group_id", "task_id", "env", "status", "error", "reward", "prompt_len")
STATUSES = ("ok", "truncated", "env_error", "reward_error", "engine_error", "timeout")
MAX_PAGE = 500
IMAGE_ID = re.compile(r"[0-9a-f]{64}")  # tidal.images: an image's id is the sha256 of its pixels, in hex
IMAGE_PAD = "<|image_pad|>"  # Qwen2-VL's image placeholder: one run of it per image in an episode's tokens


class DashboardError(ValueError):
    """A request the dashboard cannot answer (unknown run, bad filter, missing episode)."""


class DashboardNotFound(DashboardError):
    """A well-formed request for something the run does not have (answered 404, not 400)."""


def _finite(v: Any) -> Any:
    return v if not isinstance(v, float) or math.isfinite(v) else None


@dataclass
class _Tail:
    """Complete lines appended to a file since the last read."""

    path: Path
    offset: int = 0
    inode: int | None = None

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """New JSON lines, and whether the file was replaced or truncated (then: all of it)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return [], False
        restarted = self.inode is not None and (st.st_ino != self.inode or st.st_size < self.offset)
        if restarted:
            self.offset = 0
        self.inode = st.st_ino
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # a line without its newline is still being written
        self.offset += end
        rows = []
        for line in chunk[:end].splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn line (a crash mid-write) is skipped, not fatal to the page
        return rows, restarted


@dataclass
class Metrics:
    """A run's metrics as columns: `steps`, and each key's values aligned with them (None
    where a step did not log the key, or logged a non-finite value)."""

    steps: list[int] = field(default_factory=list)
    columns: dict[str, list[Any]] = field(default_factory=dict)
    generation: int = 0  # bumped when rows were replaced: a client holding rows must start over

    def add(self, row: dict[str, Any]) -> bool:
        """Append one row; True when it replaced rows (its step was logged before)."""
        step = row.get("step")
        if not isinstance(step, int):
            return False
        replaced = bool(self.steps) and step <= self.steps[-1]
        if replaced:
            keep = next((i for i, s in enumerate(self.steps) if s >= step), len(self.steps))
            del self.steps[keep:]
            for col in self.columns.values():
                del col[keep:]
            self.generation += 1
        n = len(self.steps)
        self.steps.append(step)
        for key, value in row.items():
            if key == "step" or not isinstance(value, int | float | type(None)) or isinstance(value, bool):
                continue
            col = self.columns.get(key)
            if col is None:
                col = self.columns[key] = [None] * n
            col.append(_finite(float(value)) if value is not None else None)
        for col in self.columns.values():
            if len(col) < n + 1:
                col.append(None)
        return replaced


class RunView:
    """One run directory, as the dashboard shows it. Thread-safe: the server answers requests
    on several threads."""

    def __init__(self, root: str | Path, name: str | None = None):
        self.root = Path(root)
        if not self.root.is_dir():
            raise DashboardError(f"run directory `{self.root}` does not exist")
        if not any((self.root / f).exists() for f in ("metrics.jsonl", "config.yaml", "episodes")):
            raise DashboardError(f"`{self.root}` is not a tidal run directory (no metrics.jsonl, config.yaml or "
                                 "episodes/)")
        self.name = name or self.root.name
        self._lock = threading.Lock()
        self._metrics = Metrics()
        self._metrics_tail = _Tail(self.root / "metrics.jsonl")
        self._event_tails = {"alert": _Tail(self.root / "events.jsonl"),
                             "hacking": _Tail(self.root / "hacking_events.jsonl")}
        self._events: dict[str, list[dict[str, Any]]] = {"alert": [], "hacking": []}
        self._tokenizer_lock = threading.Lock()
        self._tokenizer: Any = None
        self._tokenizer_error: str | None = None
        self._per_file: dict[tuple, list[tuple]] = {}  # (path, mtime) -> its facet rows

    # -- metrics and events -------------------------------------------------------------

    def metrics(self, since: int = 0, generation: int | None = None) -> dict[str, Any]:
        """Rows from index `since` on, as columns. A client that holds rows of an older
        `generation` (rows since replaced) gets everything again, with `reset: true`."""
        with self._lock:
            rows, restarted = self._metrics_tail.read()
            if restarted:
                gen = self._metrics.generation + 1
                self._metrics = Metrics(generation=gen)
            for row in rows:
                self._metrics.add(row)
            m = self._metrics
            reset = generation is not None and generation != m.generation
            start = 0 if reset else max(0, min(since, len(m.steps)))
            return {"generation": m.generation, "reset": reset, "start": start, "total": len(m.steps),
                    "steps": m.steps[start:], "columns": {k: v[start:] for k, v in m.columns.items()}}

    def events(self) -> list[dict[str, Any]]:
        """Alerts and restarts (events.jsonl) and reward-hacking monitor events
        (hacking_events.jsonl), each with its `kind`, `name`, `step` and a one-line `message`."""
        with self._lock:
            for kind, tail in self._event_tails.items():
                rows, restarted = tail.read()
                if restarted:
                    self._events[kind] = []
                for r in rows:
                    if not isinstance(r, dict) or not isinstance(r.get("step"), int):
                        continue
                    name = r.get("alert") or r.get("monitor") or r.get("role") or r.get("kind") or kind
                    message = r.get("message") or r.get("detail") or json.dumps(
                        {k: v for k, v in r.items() if k not in ("examples", "episodes")})[:300]
                    shown = r["kind"] if kind == "alert" and r.get("kind") in ("alert", "restart") else kind
                    self._events[kind].append({"kind": shown, "name": str(name), "step": r["step"],
                                               "message": str(message)})
            return [e for kind in ("alert", "hacking") for e in self._events[kind]]

    def config(self) -> dict[str, Any]:
        """config.yaml as `section.key: value` leaves ({} when the run has none yet)."""
        path = self.root / "config.yaml"
        if not path.is_file():
            return {}
        data = yaml.safe_load(path.read_text()) or {}
        flat: dict[str, Any] = {}

        def walk(prefix: str, node: Any) -> None:
            if isinstance(node, dict) and node:
                for k, v in node.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            else:
                flat[prefix] = node
        walk("", data)
        # the hash of each file of code the run copied (RUN/sources.json, tidal/runtime/sources.py):
        # two runs of one path but other code differ here
        kept = self.root / "sources.json"
        for key, rec in (json.loads(kept.read_text()) if kept.is_file() else {}).items():
            flat[f"sources.{key}"] = f"sha256:{rec['sha256'][:12]}"
        return flat

    # -- episodes -----------------------------------------------------------------------

    def _files(self, step_min: int | None = None, step_max: int | None = None) -> list[str]:
        directory = self.root / "episodes"
        if not directory.is_dir():
            return []
        out = []
        for f in episode_files(directory):
            step = file_step(f)
            if (step_min is None or step >= step_min) and (step_max is None or step <= step_max):
                out.append(str(f))
        return out

    def _file_facets(self, con, files: list[str]) -> dict[str, list[tuple]]:
        """Per store file: (env, status, count, min step, max step) rows. Each file is read once
        (a closed file never changes; a resumed run that rewrites a step gets a new mtime)."""
        keys = {f: (f, _mtime(f)) for f in files}
        with self._lock:
            missing = [f for f in files if keys[f] not in self._per_file]
        if missing:
            rows = con.execute("SELECT filename, env, status, count(*), min(step), max(step) "
                               "FROM read_parquet(?, filename = true) GROUP BY ALL", [missing]).fetchall()
            found: dict[str, list[tuple]] = {f: [] for f in missing}
            for name, *rest in rows:
                found.setdefault(name, []).append(tuple(rest))
            with self._lock:
                for f in missing:
                    self._per_file[keys[f]] = found.get(f, [])
        with self._lock:
            return {f: self._per_file[keys[f]] for f in files}

    def facets(self, con) -> dict[str, Any]:
        """Episode counts by env and status, and the step range, for the filters."""
        result: dict[str, Any] = {"episodes": 0, "envs": {}, "statuses": {}, "step_min": None, "step_max": None}
        for rows in self._file_facets(con, self._files()).values():
            for env, status, n, lo, hi in rows:
                result["episodes"] += n
                result["envs"][env] = result["envs"].get(env, 0) + n
                result["statuses"][status] = result["statuses"].get(status, 0) + n
                result["step_min"] = lo if result["step_min"] is None else min(lo, result["step_min"])
                result["step_max"] = hi if result["step_max"] is None else max(hi, result["step_max"])
        return result

    def episodes(self, con, *, step_min: int | None = None, step_max: int | None = None,
                 reward_min: float | None = None, reward_max: float | None = None, status: list[str] | None = None,
                 env: str | None = None, text: str | None = None, offset: int = 0, limit: int = 50,
                 order: str = "newest") -> dict[str, Any]:
        """One page of episodes matching every filter given, and how many match in all."""
        if not 1 <= limit <= MAX_PAGE:
            raise DashboardError(f"limit must be between 1 and {MAX_PAGE} (got {limit})")
        if offset < 0:
            raise DashboardError(f"offset must be at least 0 (got {offset})")
        orders = {"newest": "step DESC, episode_id", "oldest": "step, episode_id",
                  "reward_high": "reward DESC NULLS LAST, step DESC, episode_id",
                  "reward_low": "reward ASC NULLS LAST, step DESC, episode_id"}
        if order not in orders:
            raise DashboardError(f"order must be one of {', '.join(orders)} (got {order!r})")
        files = self._files(step_min, step_max)
        if not files:
            return {"total": 0, "rows": [], "offset": offset}
        where, params = ["TRUE"], []
        for cond, value in (("step >= ?", step_min), ("step <= ?", step_max), ("reward >= ?", reward_min),
                            ("reward <= ?", reward_max)):
            if value is not None:
                where.append(cond)
                params.append(value)
        if status:
            bad = [s for s in status if s not in STATUSES]
            if bad:
                raise DashboardError(f"unknown status {bad[0]!r} (statuses: {', '.join(STATUSES)})")
            where.append(f"status IN ({', '.join('?' for _ in status)})")
            params += status
        if env:
            where.append("env = ?")
            params.append(env)
        if text:
            # Case-insensitive substring of the episode's text, its error or its id.
            where.append("(contains(lower(text), ?) OR contains(lower(coalesce(error, '')), ?) "
                         "OR contains(lower(episode_id), ?))")
            params += [text.lower()] * 3
        cond = " AND ".join(where)
        cols = ", ".join(LIST_COLUMNS)
        if order in ("newest", "oldest"):
            total, files, offset_in = self._page_files(con, files, cond, params, order == "newest", offset, limit)
        else:
            total = con.execute(f"SELECT count(*) FROM read_parquet(?) WHERE {cond}", [files, *params]).fetchone()[0]
            offset_in = offset
        if not files:
            return {"total": total, "rows": [], "offset": offset}
        rows = con.execute(
            f"SELECT {cols}, len(tokens) AS n_tokens, len(turns) AS n_turns, "
            f"list_sum(loss_mask::INTEGER[]) AS policy_tokens "
            f"FROM read_parquet(?) WHERE {cond} ORDER BY {orders[order]} LIMIT ? OFFSET ?",
            [files, *params, limit, offset_in]).fetchall()
        names = [*LIST_COLUMNS, "n_tokens", "n_turns", "policy_tokens"]
        return {"total": total, "offset": offset,
                "rows": [{k: _finite(v) for k, v in zip(names, r)} for r in rows]}

    def _page_files(self, con, files: list[str], cond: str, params: list, newest: bool, offset: int,
                    limit: int) -> tuple[int, list[str], int]:
        """For a page in step order: how many episodes match in all, the files that hold the
        page (whole steps: a step's parts sort together) and the page's offset within them.
        Counts per file come from the facets (no filter) or one grouped scan of the filter's
        columns, so the page itself reads only its own steps."""
        if cond == "TRUE":
            counts = {f: sum(r[2] for r in rows) for f, rows in self._file_facets(con, files).items()}
        else:
            counts = dict.fromkeys(files, 0)
            counts.update(con.execute(f"SELECT filename, count(*) FROM read_parquet(?, filename = true) "
                                      f"WHERE {cond} GROUP BY filename", [files, *params]).fetchall())
        by_step: dict[int, list[str]] = {}
        for f in files:
            by_step.setdefault(file_step(f), []).append(f)
        total = sum(counts.values())
        skip, chosen, held = offset, [], 0
        for step in sorted(by_step, reverse=newest):
            n = sum(counts[f] for f in by_step[step])
            if not chosen and skip >= n:  # the page starts after this step
                skip -= n
                continue
            if n:
                chosen += by_step[step]
                held += n
            if held - skip >= limit:
                break
        return total, chosen, skip

    def episode(self, con, episode_id: str, step: int | None = None) -> dict[str, Any]:
        """One episode whole, with each token's text (decoded alone) beside its id, loss mask,
        log-prob and weight version."""
        files = self._files(step, step)
        if not files:
            raise DashboardError(f"no episode `{episode_id}`" + (f" at step {step}" if step is not None else ""))
        cur = con.execute("SELECT * FROM read_parquet(?) WHERE episode_id = ? LIMIT 1", [files, episode_id])
        names = [d[0] for d in cur.description]
        row = cur.fetchone()
        if row is None:
            raise DashboardError(f"no episode `{episode_id}`" + (f" at step {step}" if step is not None else ""))
        ep = dict(zip(names, row))
        for key in ("reward_parts", "metrics"):
            ep[key] = {k: _finite(v) for k, v in (ep.get(key) or {}).items()}
        ep["logprobs"] = [_finite(float(x)) for x in ep["logprobs"] or []]
        for k in ("reward", "outcome_reward"):
            ep[k] = _finite(ep.get(k))
        ep["seed"] = None if ep.get("seed") is None else str(ep["seed"])  # 64-bit: past a JavaScript number
        ep["pieces"], ep["pieces_note"] = self._pieces(ep["tokens"] or [])
        self._texts(ep)
        ep["images"] = list(ep.get("images") or [])  # a store from before images has no column
        ep["image_runs"], ep["images_note"] = self._image_runs(ep["tokens"] or [], ep["images"])
        return ep

    def _texts(self, ep: dict[str, Any]) -> None:
        """What the episode view shows as text: its prompt as the model saw it (`prompt_text`, decoded
        whole), its task row's reference (`reference`: JSON text; `reference_fields` when it parses,
        a store from before it has none), and after each turn the observation that followed it
        (`observation`: tool answers, a user reply; decoded)."""
        tokens = ep["tokens"] or []
        ep["reference"] = ep.get("reference") or ""
        try:
            fields = json.loads(ep["reference"]) if ep["reference"] else None
        except ValueError:  # cut at Episode's limit: shown as text
            fields = None
        ep["reference_fields"] = fields if isinstance(fields, dict) else None
        tok = self._load_tokenizer()
        spans = [(0, ep.get("prompt_len") or 0)] + [(t["end"], t["obs_end"]) for t in ep.get("turns") or []]
        texts = batch_decoder(tok)([tokens[a:b] for a, b in spans]) if tok is not None else [None] * len(spans)
        ep["prompt_text"] = texts[0]
        for t, text in zip(ep.get("turns") or [], texts[1:]):
            t["observation"] = text if t["obs_end"] > t["end"] else ""

    def _image_runs(self, tokens: list[int], images: list[str]) -> tuple[list[dict[str, Any]], str | None]:
        """Where each image sits in the tokens: its run of image pads (`start`, `end`) and its id.
        None are placed (only listed) when the pads cannot be found or do not pair up with the ids."""
        if not images:
            return [], None
        tok = self._load_tokenizer()
        if tok is None:
            return [], "the images are listed, not placed: the run's tokenizer did not load"
        pad = tok.convert_tokens_to_ids(IMAGE_PAD)
        if pad is None or pad == tok.unk_token_id:
            return [], f"the images are listed, not placed: the run's tokenizer has no {IMAGE_PAD} token"
        from tidal.models.vision import image_runs  # torch: imported only for an episode with images

        runs = image_runs(tokens, pad)
        if len(runs) != len(images):
            return [], (f"the images are listed, not placed: the episode has {len(images)} image(s) but "
                        f"{len(runs)} run(s) of {IMAGE_PAD} tokens")
        return [{"start": s, "end": e, "id": i} for (s, e), i in zip(runs, images)], None

    def image_path(self, image_id: str | None) -> Path:
        """The PNG file of one of the run's pictures. Only an exact id names a file (never a path)."""
        if not image_id or not IMAGE_ID.fullmatch(image_id):
            raise DashboardError(f"query parameter `id` must be an image id, 64 lowercase hex characters "
                                 f"(got {(image_id or '')[:80]!r})")
        path = ImageDir(self.root / "episodes" / IMAGES_DIR).path(image_id)
        if not path.is_file():
            raise DashboardNotFound(f"run {self.name} has no image {image_id}")
        return path

    def _pieces(self, tokens: list[int]) -> tuple[list[str] | None, str | None]:
        tok = self._load_tokenizer()
        if tok is None:
            return None, self._tokenizer_error
        return batch_decoder(tok)([[t] for t in tokens]), None

    def warm(self) -> None:
        """Load what the first opened episode needs (the run's tokenizer)."""
        self._load_tokenizer()

    def _load_tokenizer(self):
        with self._tokenizer_lock:  # not self._lock: a load takes a second, and the curves must not wait
            if self._tokenizer is None and self._tokenizer_error is None:
                path = self.config().get("model.path", "default")
                try:
                    from tidal.models import load_tokenizer

                    self._tokenizer = load_tokenizer(path)
                except Exception as e:  # noqa: BLE001 (any failure: the page shows token ids, and says why)
                    self._tokenizer_error = f"token ids only: the run's tokenizer ({path}) did not load: {e}"
            return self._tokenizer


def _mtime(path: str) -> float | None:
    try:
        return Path(path).stat().st_mtime
    except OSError:
        return None


def config_diff(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The keys whose values differ between the runs' flattened configs, each with every run's
    value (None where a run lacks the key)."""
    keys = sorted(set().union(*configs)) if configs else []
    return [{"key": k, "values": [c.get(k) for c in configs]} for k in keys
            if len({json.dumps(c.get(k), sort_keys=True, default=str) for c in configs}) > 1]

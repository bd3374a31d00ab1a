"""The episode store: every episode of a run in Parquet under `episodes/`, written as episodes
finish, browsable with pyarrow or DuckDB (`SELECT * FROM 'run/episodes/*.parquet'`).

Files. Step N's episodes go to `step_00000N.parquet`; a step too large for one file (more than
`max_file_bytes` on disk or `max_file_episodes` episodes) continues in
`step_00000N.part0001.parquet`, `.part0002`, ... Each file is written under a hidden temporary
name (`.step_00000N.parquet.tmp`: neither a `*.parquet` glob nor pyarrow's dataset discovery
sees it) and renamed when it is closed, so a reader never sees half a file.

Memory. `add(episode)` buffers the episode in its step's open file; every `row_group_episodes`
episodes (or `row_group_tokens` tokens, whichever comes first) the buffer becomes one Parquet
row group and is let go. A file's footer metadata grows by one entry per row group, which is
what `max_file_episodes` bounds. So the writer holds at most one row group per open step plus
a bounded footer, however many episodes a run makes.

The choices: columns are built straight from the dataclasses (no `dataclasses.asdict`, which
deep-copies every list), turns and their tool calls as nested list<struct> columns so that
per-turn rewards and tool outcomes are queryable (`UNNEST(turns)`); the `text` column (the
whole episode decoded, special tokens kept) is decoded once per row group in one batched call
and can be turned off (`decode_text=False`), since at a million episodes it is the largest
cost. Log-probs are stored as float32 (what engines compute); every other field round-trips
exactly (`iter_episodes`).

Images. An episode of a vision-language model keeps its images by id (`images`, content hashes:
tidal/images.py); the writer saves each picture once, as PNG, under the store's `images/` folder
(`images/ab/<id>.png`), and `episode_images` reads an episode's pictures back.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Self

import pyarrow as pa
import pyarrow.parquet as pq

from tidal.durable import named
from tidal.images import ImageDir
from tidal.types import Episode, Status, ToolCallRecord, Turn

TOOL_CALL_TYPE = pa.struct([
    ("name", pa.string()), ("arguments", pa.string()), ("call_id", pa.string()), ("status", pa.string()),
    ("error", pa.string()), ("output_chars", pa.int64()), ("duration_s", pa.float64()), ("output", pa.string()),
])
TURN_TYPE = pa.struct([
    ("index", pa.int32()), ("start", pa.int32()), ("end", pa.int32()), ("obs_end", pa.int32()),
    ("text", pa.string()), ("finish_reason", pa.string()), ("reward", pa.float64()), ("version", pa.int32()),
    ("tool_calls", pa.list_(TOOL_CALL_TYPE)),
])
SCHEMA = pa.schema([
    ("step", pa.int64()), ("episode_id", pa.string()), ("group_id", pa.string()), ("task_id", pa.string()),
    ("env", pa.string()), ("status", pa.string()), ("error", pa.string()), ("reward", pa.float64()),
    ("reward_parts", pa.map_(pa.string(), pa.float64())), ("metrics", pa.map_(pa.string(), pa.float64())),
    ("prompt_len", pa.int64()), ("tokens", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.bool_())),
    ("logprobs", pa.list_(pa.float32())), ("versions", pa.list_(pa.int32())), ("text", pa.string()),
    ("seed", pa.int64()), ("outcome_reward", pa.float64()), ("segments", pa.list_(pa.int32())),
    ("turns", pa.list_(TURN_TYPE)), ("images", pa.list_(pa.string())), ("reference", pa.string()),
])
# Min/max statistics only where a query filters on them (the footer stays small).
_STATS_COLUMNS = ["step", "episode_id", "group_id", "task_id", "env", "status", "reward", "prompt_len", "seed",
                  "outcome_reward"]
_SCALARS = [("step", pa.int64()), ("episode_id", pa.string()), ("group_id", pa.string()),
            ("task_id", pa.string()), ("env", pa.string()), ("error", pa.string()), ("reward", pa.float64()),
            ("prompt_len", pa.int64()), ("seed", pa.int64()), ("outcome_reward", pa.float64()),
            ("reference", pa.string())]
_LISTS = [("tokens", pa.int32()), ("loss_mask", pa.bool_()), ("logprobs", pa.float32()), ("versions", pa.int32()),
          ("segments", pa.int32()), ("images", pa.string())]
# Episode fields that are not columns: the pictures themselves live in the store's images/ folder.
_NOT_STORED = {"image_blobs"}
IMAGES_DIR = "images"
_SAVED_IMAGES_REMEMBERED = 1 << 16
_FILE = re.compile(r"^step_(\d+)(?:\.part(\d+))?\.parquet$")


def step_file(directory: Path, step: int, part: int = 0) -> Path:
    """The path of part `part` of step `step` (part 0: `step_00000N.parquet`)."""
    return directory / (f"step_{step:06d}.parquet" if part == 0 else f"step_{step:06d}.part{part:04d}.parquet")


def file_step(path: str | Path) -> int | None:
    """The step a store file holds (`step_00000N.parquet`, `.partK` too); None for other names."""
    m = _FILE.match(Path(path).name)
    return int(m.group(1)) if m else None


def episode_files(path: str | Path) -> list[Path]:
    """The store's files under `path` (a directory) in step and part order; a file is itself."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"episode store `{p}` does not exist")
    found = []
    for f in p.iterdir():
        m = _FILE.match(f.name)
        if m:
            found.append((int(m.group(1)), int(m.group(2) or 0), f))
    return [f for _, _, f in sorted(found)]


REFERENCE_CHARS = 2000  # of an episode's `reference`: an answer, a few tests; not a document per episode


def reference_of(row: dict) -> str:
    """The row's columns but its prompt and pictures, as JSON (Episode.reference), cut at REFERENCE_CHARS."""
    rest = {k: v for k, v in row.items() if k not in ("prompt", "images", "image")}
    if not rest:
        return ""
    text = json.dumps(rest, ensure_ascii=False, default=repr)
    return text if len(text) <= REFERENCE_CHARS else f"{text[:REFERENCE_CHARS]}… ({len(text) - REFERENCE_CHARS} more characters)"


def _list_column(lists: list[list], value_type: pa.DataType) -> pa.Array:
    offsets = [0, *itertools.accumulate(map(len, lists))]
    values = pa.array(list(itertools.chain.from_iterable(lists)), value_type)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, type=pa.list_(value_type))


def _turns_column(episodes: list[Episode]) -> pa.Array:
    turns = [t for e in episodes for t in e.turns]
    calls = [c for t in turns for c in t.tool_calls]
    call_arrays = [pa.array([getattr(c, f.name) for c in calls], f.type) for f in TOOL_CALL_TYPE]
    call_lists = pa.ListArray.from_arrays(
        pa.array([0, *itertools.accumulate(len(t.tool_calls) for t in turns)], pa.int32()),
        pa.StructArray.from_arrays(call_arrays, fields=list(TOOL_CALL_TYPE)), type=pa.list_(TOOL_CALL_TYPE))
    turn_arrays = [pa.array([getattr(t, f.name) for t in turns], f.type) for f in TURN_TYPE if f.name != "tool_calls"]
    structs = pa.StructArray.from_arrays([*turn_arrays, call_lists], fields=list(TURN_TYPE))
    return pa.ListArray.from_arrays(pa.array([0, *itertools.accumulate(len(e.turns) for e in episodes)], pa.int32()),
                                    structs, type=pa.list_(TURN_TYPE))


def episodes_table(episodes: list[Episode], texts: list[str] | None = None, step: int | None = None) -> pa.Table:
    """One Arrow table (SCHEMA) of `episodes`; `texts` fills the `text` column ("" when None);
    `step` overrides each episode's own step column."""
    n = len(episodes)
    cols: dict[str, pa.Array] = {}
    for name, typ in _SCALARS:
        if name == "step" and step is not None:
            cols[name] = pa.array([step] * n, typ)
        else:
            cols[name] = pa.array([getattr(e, name) for e in episodes], typ)
    cols["status"] = pa.array([Status(e.status).value for e in episodes], pa.string())
    for name in ("reward_parts", "metrics"):
        cols[name] = pa.array([list(getattr(e, name).items()) for e in episodes], SCHEMA.field(name).type)
    for name, typ in _LISTS:
        cols[name] = _list_column([getattr(e, name) for e in episodes], typ)
    cols["turns"] = _turns_column(episodes)
    cols["text"] = pa.array(texts if texts is not None else [""] * n, pa.string())
    return pa.Table.from_arrays([cols[f.name] for f in SCHEMA], schema=SCHEMA)


def batch_decoder(tokenizer):
    """`seqs -> texts`, special tokens kept. A Hugging Face tokenizer backed by the `tokenizers`
    library decodes a whole row group in one native call (measured 2x a per-episode
    `decode` loop, 4x `batch_decode`); it gives the same text unless the tokenizer cleans up
    spaces after decoding, which only its own `decode` does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode_batch") and not getattr(
            tokenizer, "clean_up_tokenization_spaces", False):
        return lambda seqs: backend.decode_batch(seqs, skip_special_tokens=False)
    return lambda seqs: [tokenizer.decode(s) for s in seqs]


def _snapshot(ep: Episode) -> Episode:
    if not isinstance(ep, Episode):
        return ep  # _check names it
    snap = copy.copy(ep)
    snap.metrics, snap.reward_parts = dict(ep.metrics), dict(ep.reward_parts)
    return snap


def _check(ep: Episode) -> None:
    if not isinstance(ep, Episode):
        raise TypeError(f"episode store: expected an Episode, got {type(ep).__name__}")
    n = len(ep.tokens)
    for name in ("loss_mask", "logprobs", "versions"):
        if len(getattr(ep, name)) != n:
            raise ValueError(f"episode {ep.episode_id} of step {ep.step}: {name} has {len(getattr(ep, name))} entries "
                             f"for {n} tokens")


@dataclass
class _OpenFile:
    """The file of one step being written: its buffer (one row group to be) and its part."""

    step: int
    part: int = 0
    tmp: Path | None = None
    writer: pq.ParquetWriter | None = None
    rows_in_file: int = 0
    buffer: list[Episode] = field(default_factory=list)
    buffered_tokens: int = 0
    done: list[Path] = field(default_factory=list)  # parts closed (renamed) so far


class EpisodeWriter:
    """Streams episodes to the store. `add` as they finish, `end_step` when a step has no more;
    `write(step, episodes)` does both at once. Thread-safe (the rollout may run in a thread
    while the loop ends steps). Steps may be open at once (asynchronous training rolls out step
    s+1 before step s is logged); each has its own file."""

    def __init__(self, directory: str | Path, tokenizer=None, *, decode_text: bool | None = None,
                 row_group_episodes: int = 256, row_group_tokens: int = 1 << 20,
                 max_file_bytes: int = 256 << 20, max_file_episodes: int = 1 << 17, compression: str = "zstd"):
        if decode_text and tokenizer is None:
            raise ValueError("EpisodeWriter(decode_text=True) needs a tokenizer to decode with")
        for name, v in (("row_group_episodes", row_group_episodes), ("row_group_tokens", row_group_tokens),
                        ("max_file_bytes", max_file_bytes), ("max_file_episodes", max_file_episodes)):
            if v < 1:
                raise ValueError(f"EpisodeWriter: {name} must be at least 1 (got {v})")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.images = ImageDir(self.dir / IMAGES_DIR)
        # ids saved lately: a group's samples share their pictures (bounded; a forgotten id costs one stat)
        self._saved_images: OrderedDict[str, None] = OrderedDict()
        self.tokenizer = tokenizer
        self.decode_text = tokenizer is not None if decode_text is None else decode_text
        self._decode = batch_decoder(tokenizer) if self.decode_text else None
        self.row_group_episodes = row_group_episodes
        self.row_group_tokens = row_group_tokens
        self.max_file_bytes = max_file_bytes
        self.max_file_episodes = max_file_episodes
        self.compression = compression
        self._open: dict[int, _OpenFile] = {}
        self._ended: set[int] = set()
        self._lock = threading.Lock()
        self.episodes_written = 0  # rows written to row groups so far, all steps
        self.max_buffered = 0  # the most episodes any one buffer held (the memory bound, observed)

    @property
    def buffered(self) -> int:
        """Episodes held in memory now, waiting for their row group."""
        return sum(len(f.buffer) for f in self._open.values())

    def add(self, episode: Episode) -> None:
        """Buffer one finished episode in the file of its step (`episode.step`). The row records
        the episode as it is now: later changes to its scalars or its `metrics`/`reward_parts`
        (reward shaping, a `trained` flag) do not reach the store, whether or not its row group
        was written yet (its token lists and turns are not copied: they do not change once an
        episode has finished)."""
        with self._lock:
            self._save_images(episode)
            self._add(episode.step if isinstance(episode, Episode) else None, _snapshot(episode))

    def _save_images(self, episode: Episode) -> None:
        """(Inside the lock.) Each picture of the episode once under images/ (content-addressed: a group's samples share it)."""
        for image_id in getattr(episode, "images", ()):
            if image_id in self._saved_images:
                continue
            blob = episode.image_blobs.get(image_id)
            if blob is None:
                raise ValueError(f"episode {episode.episode_id} of step {episode.step}: image {image_id} has no "
                                 "picture in image_blobs")
            self.images.put(blob)
            self._saved_images[image_id] = None
            if len(self._saved_images) > _SAVED_IMAGES_REMEMBERED:
                self._saved_images.popitem(last=False)

    def add_many(self, episodes: Iterable[Episode]) -> None:
        for ep in episodes:
            self.add(ep)

    def end_step(self, step: int) -> list[Path]:
        """Close step `step`'s file(s) (an empty file if it had no episodes, so every logged step
        has one); returns them. A step that ends cannot take more episodes."""
        with self._lock:
            f = self._open.pop(step, None) or _OpenFile(step)
            self._ended.add(step)
            return self._close_step(f)

    def write(self, step: int, episodes: list[Episode]) -> Path:
        """All of a step's episodes at once (rows carry `step`); returns the step's first file."""
        with self._lock:
            for ep in episodes:
                self._save_images(ep)
                self._add(step, _snapshot(ep))
            f = self._open.pop(step, None) or _OpenFile(step)
            self._ended.add(step)
            return self._close_step(f)[0]

    def close(self) -> list[Path]:
        """End every open step; returns their files."""
        with self._lock:
            out = []
            for step in sorted(self._open):
                self._ended.add(step)
                out += self._close_step(self._open.pop(step))
            return out

    def abandon(self) -> list[Path]:
        """Give up every open step (the run stopped in it: a full disk, say): nothing of them
        stays, neither the hidden file being written nor a part already closed. Never raises;
        returns what was removed."""
        with self._lock:
            gone = []
            for f in self._open.values():
                gone += _discard(f)
                self._ended.add(f.step)
            self._open.clear()
            return gone

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inside the lock ------------------------------------------------------------------------
    def _add(self, step: int | None, ep: Episode) -> None:
        _check(ep)
        if step in self._ended:
            raise ValueError(f"episode {ep.episode_id} of step {step} arrived after end_step({step}): "
                             "its file is closed")
        f = self._open.get(step)
        if f is None:
            f = self._open[step] = _OpenFile(step)
        f.buffer.append(ep)
        f.buffered_tokens += len(ep.tokens)
        self.max_buffered = max(self.max_buffered, len(f.buffer))
        if len(f.buffer) >= self.row_group_episodes or f.buffered_tokens >= self.row_group_tokens:
            self._flush(f)

    def _table(self, eps: list[Episode], step: int) -> pa.Table:
        texts = self._decode([e.tokens for e in eps]) if self.decode_text else None
        try:
            return episodes_table(eps, texts, step=step)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            for ep in eps:  # name the episode that does not fit the schema
                try:
                    episodes_table([ep], step=step)
                except (pa.ArrowException, TypeError, ValueError, OverflowError) as one:
                    raise ValueError(f"episode store: episode {ep.episode_id} of step {step} does not fit the "
                                     f"schema: {type(one).__name__}: {one}") from one
            raise

    def _flush(self, f: _OpenFile) -> None:
        if not f.buffer:
            return
        table = self._table(f.buffer, f.step)
        if f.writer is None:
            self._start_part(f)
        try:
            f.writer.write_table(table, row_group_size=len(f.buffer))
        except OSError as e:  # Arrow's error names no file
            raise named(e, f.tmp) from e
        f.rows_in_file += len(f.buffer)
        self.episodes_written += len(f.buffer)
        f.buffer, f.buffered_tokens = [], 0
        if f.rows_in_file >= self.max_file_episodes or f.tmp.stat().st_size >= self.max_file_bytes:
            self._finish_part(f)
            f.part += 1

    def _start_part(self, f: _OpenFile) -> None:
        final = step_file(self.dir, f.step, f.part)
        f.tmp = final.with_name(f".{final.name}.tmp")
        try:
            f.writer = pq.ParquetWriter(f.tmp, SCHEMA, compression=self.compression, write_statistics=_STATS_COLUMNS)
        except OSError as e:
            raise named(e, f.tmp) from e
        f.rows_in_file = 0

    def _finish_part(self, f: _OpenFile) -> None:
        final = step_file(self.dir, f.step, f.part)
        try:
            f.writer.close()  # the footer: the file's last write
            os.replace(f.tmp, final)  # atomic: the name appears with the whole file behind it
        except OSError as e:
            raise named(e, f.tmp) from e
        f.done.append(final)
        f.writer, f.tmp = None, None

    def _close_step(self, f: _OpenFile) -> list[Path]:
        try:
            return self._close_parts(f)
        except BaseException:  # a step that cannot be written whole leaves nothing (a full disk, say)
            _discard(f)
            raise

    def _close_parts(self, f: _OpenFile) -> list[Path]:
        self._flush(f)
        if f.writer is None and not f.done:  # no episodes at all: an empty file with the schema
            self._start_part(f)
        if f.writer is not None:
            self._finish_part(f)
        # A step written again (a resumed run re-runs it) leaves no stale parts of the old write
        # (parts are numbered without gaps, so the first missing one ends them).
        part = len(f.done)
        while (stale := step_file(self.dir, f.step, part)).exists():
            stale.unlink()
            part += 1
        return f.done


def _discard(f: _OpenFile) -> list[Path]:
    """Remove what was written of `f`'s step (its hidden file, its closed parts); never raises."""
    if f.writer is not None:
        with contextlib.suppress(Exception):  # its footer may not fit either
            f.writer.close()
        f.writer = None
    gone = []
    for p in ([f.tmp] if f.tmp is not None else []) + f.done:
        with contextlib.suppress(OSError):
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def read_episodes(path: str | Path, columns: list[str] | None = None) -> pa.Table:
    """The store (a directory, in step order) or one of its files as one Arrow table."""
    files = episode_files(path)
    if not files:
        return SCHEMA.empty_table() if columns is None else SCHEMA.empty_table().select(columns)
    return pa.concat_tables([pq.read_table(f, columns=columns) for f in files])


def _turn(d: dict) -> Turn:
    calls = [ToolCallRecord(**c) for c in d.pop("tool_calls")]
    return Turn(**d, tool_calls=calls)


def row_to_episode(row: dict) -> Episode:
    """An Episode from one row of the store (as `Table.to_pylist` gives it)."""
    kw = {f.name: row[f.name] for f in fields(Episode) if f.name in row}
    kw["status"] = Status(kw["status"])
    kw["reward_parts"] = dict(kw["reward_parts"])
    kw["metrics"] = dict(kw["metrics"])
    kw["turns"] = [_turn(t) for t in kw["turns"]]
    return Episode(**kw)


def iter_episodes(path: str | Path, batch_size: int = 1024) -> Iterator[Episode]:
    """Every Episode of the store (a directory, in step and part order, or one file), read back
    `batch_size` rows at a time: memory stays bounded however large the store is."""
    for f in episode_files(path):
        pf = pq.ParquetFile(f)
        cols = [c for c in _stored_fields() if c in pf.schema_arrow.names]  # a store from before `images` has none
        for batch in pf.iter_batches(batch_size=batch_size, columns=cols):
            for row in batch.to_pylist():
                yield row_to_episode(row)


def _stored_fields() -> list[str]:
    return [f.name for f in fields(Episode) if f.name not in _NOT_STORED]


def episode_images(store: str | Path, episode: Episode) -> list:
    """The episode's pictures (ImageBlobs, in the order of its image runs), read from the store's
    images/ folder (`store`: the episodes directory, or one of its files)."""
    root = Path(store)
    root = root.parent if root.is_file() else root
    images = ImageDir(root / IMAGES_DIR)
    return [images.get(i) for i in episode.images]

"""The episode store: one Parquet file per step under `episodes/`, browsable with
pyarrow or DuckDB (`SELECT * FROM 'run/episodes/*.parquet'`)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tidal.types import Episode

SCHEMA = pa.schema([
    ("step", pa.int64()), ("episode_id", pa.string()), ("group_id", pa.string()), ("task_id", pa.string()),
    ("env", pa.string()), ("status", pa.string()), ("error", pa.string()), ("reward", pa.float64()),
    ("reward_parts", pa.map_(pa.string(), pa.float64())), ("metrics", pa.map_(pa.string(), pa.float64())),
    ("prompt_len", pa.int64()), ("tokens", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.bool_())),
    ("logprobs", pa.list_(pa.float32())), ("versions", pa.list_(pa.int32())), ("text", pa.string()),
])


class EpisodeWriter:
    def __init__(self, directory: Path, tokenizer=None):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = tokenizer

    def write(self, step: int, episodes: list[Episode]) -> Path:
        rows = []
        for ep in episodes:
            row = ep.to_row()
            row["reward_parts"] = list(row["reward_parts"].items())
            row["metrics"] = list(row["metrics"].items())
            row["text"] = self.tokenizer.decode(ep.tokens) if self.tokenizer is not None else ""
            rows.append({k: row[k] for k in SCHEMA.names})
        path = self.dir / f"step_{step:06d}.parquet"
        tmp = path.with_suffix(".tmp")
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp)
        tmp.replace(path)
        return path


def read_episodes(path: str | Path) -> pa.Table:
    return pq.read_table(str(path))

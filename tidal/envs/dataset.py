"""Prompt datasets: JSONL, Parquet or a Hugging Face `datasets` directory.

Each row needs a `prompt` column (text, or chat messages as a list of {role, content});
every other column reaches the reward function as a keyword argument. A bad row is
reported by its number and what is wrong with it.

Images (vision-language models, tidal/images.py): a message's content may be a list of parts with
image parts (`{"type": "image", "image": ...}`, OpenAI's `{"type": "image_url", ...}`, or a bare
`{"type": "image"}` taking the next image of the row's `images` column). Image file paths are
resolved against the dataset's directory when it is loaded, and a missing file names its row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    pass


def _check_row(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be an object with a `prompt` column, got {type(row).__name__}")
    if "prompt" not in row:
        raise DatasetError(f"{where}: no `prompt` column (columns: {', '.join(sorted(row)) or 'none'})")
    p = row["prompt"]
    if isinstance(p, str):
        if not p.strip():
            raise DatasetError(f"{where}: `prompt` is empty")
    elif isinstance(p, list) and p:
        for j, m in enumerate(p):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise DatasetError(f"{where}: message {j} of `prompt` needs `role` and `content`, got {m!r}")
    else:
        raise DatasetError(f"{where}: `prompt` must be text or a non-empty list of chat messages, got {p!r}")
    return row


def load_prompts(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"dataset `{path}` does not exist")
    if p.is_dir():
        try:
            import datasets  # optional: only for HF datasets directories
        except ImportError:
            raise DatasetError(f"`{path}` is a directory; reading a Hugging Face datasets directory needs `pip install datasets`") from None
        try:
            rows = list(datasets.load_from_disk(str(p)))
        except Exception as e:  # a damaged directory: its library's error may name no file
            raise DatasetError(f"dataset directory `{path}` cannot be read ({type(e).__name__}: {e})") from e
    elif p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(p).to_pylist()
        except (pa.ArrowException, OSError) as e:  # Arrow's "Corrupt snappy compressed data." names no file
            raise DatasetError(f"dataset `{path}` is not a readable Parquet file ({type(e).__name__}: {e}): "
                               "truncated or corrupted?") from e
    elif p.suffix in (".jsonl", ".json"):
        rows = []
        with p.open("rb") as f:  # decoded a line at a time: a bad byte is named by its line
            for n, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DatasetError(f"{path}, line {n}: not UTF-8 text ({e.reason} at byte {e.start}): "
                                       "corrupted?") from None
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}, line {n}: not valid JSON ({e.msg})") from None
    else:
        raise DatasetError(f"dataset `{path}`: unknown format `{p.suffix}` (use .jsonl, .parquet or a datasets directory)")
    if not rows:
        raise DatasetError(f"dataset `{path}` has no rows")
    base = p if p.is_dir() else p.parent
    return [_resolve_image_paths(_check_row(r, f"{path}, row {i}"), base, f"{path}, row {i}") for i, r in enumerate(rows)]


def _resolve_image_paths(row: dict[str, Any], base: Path, where: str) -> dict[str, Any]:
    """The row with every image given as a relative file path made absolute (against the dataset's
    directory), checked to exist; other image values (bytes, data URLs, PIL, datasets cells) as they are."""

    def resolve(value: Any, at: str) -> Any:
        if isinstance(value, str) and not value.startswith(("data:", "http://", "https://")):
            path = Path(value.removeprefix("file://"))
            path = path if path.is_absolute() else base / path
            if not path.is_file():
                raise DatasetError(f"{where}: {at}: image file `{path}` does not exist")
            return str(path)
        return value

    if isinstance(row.get("images"), list):
        row["images"] = [resolve(v, f"images[{k}]") for k, v in enumerate(row["images"])]
    elif "image" in row and row["image"] is not None:
        row["image"] = resolve(row["image"], "image")
    if isinstance(row["prompt"], list):
        for j, m in enumerate(row["prompt"]):
            if not isinstance(m.get("content"), list):
                continue
            for k, part in enumerate(m["content"]):
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
                    part["image_url"] = {**part["image_url"], "url": resolve(part["image_url"].get("url"),
                                                                              f"message {j}, part {k}")}
                elif part.get("type") == "image" and part.get("image") is not None:
                    part["image"] = resolve(part["image"], f"message {j}, part {k}")
    return row


class PromptSource:
    """Endless, seeded, resumable stream of rows: a fresh permutation every epoch.

    Its whole state is (epoch, cursor), saved in checkpoints, so a resumed run draws the
    same prompts as an uninterrupted one.
    """

    def __init__(self, rows: list[dict[str, Any]], seed: int):
        self.rows, self.seed = rows, seed
        self.epoch, self.cursor = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        import random

        perm = list(range(len(self.rows)))
        random.Random(f"{self.seed}-{epoch}").shuffle(perm)
        return perm

    def take(self, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            if self.cursor == len(self._perm):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            out.append(self.rows[self._perm[self.cursor]])
            self.cursor += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._perm = self._permutation(self.epoch)

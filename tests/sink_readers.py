"""Read back what each metric sink wrote, through the sink's own format (tests only)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768  # the LevelDB log format's block size, which W&B's transaction log uses
HEADER = 7  # the file's own header: b":W&B", a 2-byte magic, a version byte


def wandb_records(path: Path) -> list:
    """Every record of a W&B run file (`run-ID.wandb`): LevelDB log records (CRC32, 2-byte
    length, type FULL/FIRST/MIDDLE/LAST, within 32 KiB blocks) holding `wandb.proto` Records.
    The checksums (masked CRC32C) are not checked: a torn record fails its protobuf parse."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding at the end of the written part
            break
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL or FIRST start a record
        if kind in (1, 4):  # FULL or LAST end one
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_dir: Path) -> dict[int, dict]:
    """step → the values logged at that step, from every offline W&B run under run_dir/wandb."""
    out: dict[int, dict] = {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            out.setdefault(int(row["_step"]), {}).update(row)
    return out


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """tag → step → value of every scalar in the event files under `directory`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_texts(directory: Path) -> dict[int, str]:
    """step → the `samples` text of that step (TensorBoard stores text as a string tensor)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["tensors"] if t.startswith("samples")]
    return {e.step: e.tensor_proto.string_val[0].decode() for t in tags for e in acc.Tensors(t)}

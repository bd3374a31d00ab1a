"""The router over real torch-engine replicas: least-loaded dispatch, sticky sessions,
back-pressure, and re-sending after a replica is stopped."""

from __future__ import annotations

import asyncio

import pytest

from tidal.engines.router import Router, RouterError
from tidal.engines.torch_engine import TorchEngine
from tidal.models import load_model
from tidal.types import GenerationRequest, SamplingParams


class RecordingEngine(TorchEngine):
    """A real torch engine that also records the size of every batch it was given."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches: list[int] = []

    def generate_sync(self, requests):
        self.batches.append(len(requests))
        return super().generate_sync(requests)


@pytest.fixture()
def replicas(tiny_model_dir):
    """Two replicas with the same weights; their versions (10, 20) tell who answered."""
    engines = [RecordingEngine(load_model(tiny_model_dir), pad_token_id=0) for _ in range(2)]
    for version, e in zip((10, 20), engines):
        e.update_weights(version, dict(e.model.named_parameters()))
    return engines


def _requests(turn: int, sessions: range, max_new: int = 4):
    return [GenerationRequest(f"ep{s}/{turn}", [5 + s, 17, 30 + turn], SamplingParams(max_new_tokens=max_new, seed=s),
                              session_id=f"ep{s}") for s in sessions]


def _served_by(results) -> list[int]:
    return [{10: 0, 20: 1}[r.version] for r in results]


def test_least_loaded_then_sticky(replicas):
    router = Router(replicas)
    first = asyncio.run(router.generate(_requests(0, range(8))))
    owner = dict(zip(range(8), _served_by(first)))
    assert sorted(owner.values()) == [0] * 4 + [1] * 4  # balanced while both are idle
    # later turns of the same episodes, in another order and in separate calls
    for sessions in (range(7, -1, -2), range(6, -1, -2)):
        later = asyncio.run(router.generate(_requests(1, sessions)))
        assert _served_by(later) == [owner[s] for s in sessions]
    assert router.served == [8, 8]


def test_stopped_replica_is_skipped_and_its_requests_resent(replicas, tiny_model_dir):
    router = Router(replicas, names=["a", "b"])
    first = asyncio.run(router.generate(_requests(0, range(6))))
    pinned_to_b = [s for s, i in zip(range(6), _served_by(first)) if i == 1]
    assert pinned_to_b
    replicas[1].close()  # the replica is gone; the sessions it served must still be answered
    reqs = _requests(1, range(6))
    results = asyncio.run(router.generate(reqs))
    assert [r.request_id for r in results] == [r.request_id for r in reqs]  # each answered once, in order
    assert _served_by(results) == [0] * 6
    assert router.up == [True, False] and "EngineClosed" in router.down_reason[1]
    assert router.resent == len(pinned_to_b)
    # counter-based sampling: the re-sent requests give what one engine alone gives
    alone = TorchEngine(load_model(tiny_model_dir), pad_token_id=0).generate_sync(reqs)
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    assert router.version == 10  # only live replicas count


def test_a_replaced_replica_takes_requests_only_once_marked_up(replicas, tiny_model_dir):
    router = Router(replicas, names=["a", "b"])
    asyncio.run(router.generate(_requests(0, range(6))))
    replicas[1].close()
    fresh = RecordingEngine(load_model(tiny_model_dir), pad_token_id=0)
    fresh.update_weights(20, dict(fresh.model.named_parameters()))  # answers as "b" (version 20)
    assert 1 in router.sessions.values()
    router.replace(1, fresh)
    assert 1 not in router.sessions.values()  # its prefix cache went with the old replica
    assert router.up == [True, False]  # no weights yet, as far as the router knows: not used
    assert _served_by(asyncio.run(router.generate(_requests(1, range(6))))) == [0] * 6 and fresh.batches == []
    router.mark_up(1)
    # the sessions that were sticky to the closed replica were forgotten: dispatch is by load again
    again = asyncio.run(router.generate(_requests(2, range(6, 12))))
    assert sorted(_served_by(again)) == [0] * 3 + [1] * 3 and sum(fresh.batches) == 3
    with pytest.raises(IndexError, match="no replica 2"):
        router.replace(2, fresh)


def test_back_pressure_bounds_requests_in_flight(replicas):
    router = Router(replicas[:1], max_inflight=3)

    async def many_callers():
        return await asyncio.gather(*(router.generate(_requests(0, range(k * 4, k * 4 + 4))) for k in range(3)))

    out = asyncio.run(many_callers())
    assert sum(len(o) for o in out) == 12
    assert max(replicas[0].batches) <= 3 and sum(replicas[0].batches) == 12
    assert router.inflight == [0]


def test_every_replica_down_is_a_clear_error(replicas):
    router = Router(replicas, names=["a", "b"])
    for e in replicas:
        e.close()
    with pytest.raises(RouterError, match="every replica is down .*a: generate raised EngineClosed"):
        asyncio.run(router.generate(_requests(0, range(2))))


def test_failed_weight_update_takes_the_replica_out(replicas):
    router = Router(replicas, names=["a", "b"])
    replicas[0].close()
    router.update_weights(30, dict(replicas[1].model.named_parameters()))
    assert router.up == [False, True] and router.version == 30
    results = asyncio.run(router.generate(_requests(0, range(3))))
    assert {r.version for r in results} == {30}


def test_training_through_a_router_of_two_replicas_equals_one_engine(tiny_model_dir, tmp_path):
    """engine.replicas=2: the same episodes, the same metrics as one engine (sampling noise
    is per request, not per replica), and both replicas serve and stay in sync."""
    import json

    from tidal.config import load_config
    from tidal.runtime.controller import Controller

    def run(name, *extra):
        cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run.dir={tmp_path / name}", "train.steps=2",
                                 "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "task.train_size=16",
                                 "rollout.max_new_tokens=6", "run.progress=false", "run.eval_every=0", *extra])
        ctl = Controller(cfg)
        ctl.train()
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return ctl, [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s", "generated_"))}
                     for r in rows]

    _, one = run("one")
    ctl, two = run("two", "engine.replicas=2")
    assert two == one
    assert all(n > 0 for n in ctl.engine.served) and ctl.engine.version == 2

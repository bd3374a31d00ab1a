"""ServedEngine (tidal/engines/served.py), the part the vLLM and SGLang engines share: the version
moves only with a weight load that succeeded, a closed or dead engine refuses calls naming
itself, and a weight update waits for the generate calls in flight. A minimal subclass stands in
for the backends (neither vLLM nor SGLang runs on this machine: their own tests cover them in CI)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tidal.engines.served import ServedEngine
from tidal.types import GenerationRequest, SamplingParams


class Refused(RuntimeError):
    pass


class Echo(ServedEngine):
    error = Refused
    name = "echo engine"

    def __init__(self, delay_s: float = 0.0, fail_load: bool = False):
        self.request_timeout_s, self._tied, self.delay_s, self.fail_load = 5.0, False, delay_s, fail_load
        self.gone, self.loaded = "", []
        self._finalizer = lambda: None
        self._start_serving()

    def dead(self) -> str:
        return self.gone

    def _validate(self, r: GenerationRequest) -> None:
        if not r.prompt_ids:
            raise Refused(f"{self.name}: request {r.request_id} has an empty prompt")

    async def _generate(self, requests, what, version):
        await asyncio.sleep(self.delay_s)
        return [(list(r.prompt_ids), [0.0] * len(r.prompt_ids), "stop") for r in requests]

    def _load_weights(self, named, version):
        if self.fail_load:
            raise OSError("disk full")
        self.loaded.append((version, self.version))


def _req(i: int = 0) -> GenerationRequest:
    return GenerationRequest(f"r{i}", [1, 2, 3], SamplingParams())


def test_generate_answers_with_the_version_and_refuses_when_closed_or_dead():
    engine = Echo()
    out = asyncio.run(engine.generate([_req()]))
    assert out[0].token_ids == [1, 2, 3] and out[0].version == 0
    engine.update_weights(3, {"w": 1})
    assert engine.version == 3 and asyncio.run(engine.generate([_req()]))[0].version == 3
    engine.gone = "the server exited with code 1"
    with pytest.raises(Refused, match="echo engine is not running: generate of 1 requests .* exited with code 1"):
        asyncio.run(engine.generate([_req()]))
    engine.gone = ""
    engine.close()
    with pytest.raises(Refused, match="echo engine is closed: update_weights"):
        engine.update_weights(4, {"w": 1})


def test_a_failed_load_keeps_the_version_and_names_the_engine():
    engine = Echo(fail_load=True)
    with pytest.raises(Refused, match=r"echo engine: update_weights\(version=1\) failed: OSError: disk full"):
        engine.update_weights(1, {"w": 1})
    assert engine.version == 0


def test_an_update_waits_for_the_generate_call_in_flight():
    engine = Echo(delay_s=0.3)
    done: list[float] = []

    def update():
        time.sleep(0.05)  # the generate call has entered the gate
        engine.update_weights(1, {"w": 1})
        done.append(time.perf_counter())

    t = threading.Thread(target=update)
    t.start()
    out = asyncio.run(engine.generate([_req()]))
    ended = time.perf_counter()
    t.join(5)
    assert out[0].version == 0  # generated with the weights it started on
    assert done and done[0] >= ended - 0.01  # the load waited for the call (10 ms: the two clocks' reads)

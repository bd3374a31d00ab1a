"""The Trainer's surface is one Protocol (tidal/trainer/protocol.py): the Trainer, its rank
(TrainerWorker, a Ray actor or in process) and the ranks seen as one (TrainerGroup) each accept
every call as it is declared there, so the controller cannot tell them apart."""

from __future__ import annotations

import inspect

import pytest

from tidal.runtime.trainer_group import TrainerGroup, TrainerWorker
from tidal.trainer.protocol import TrainerProtocol
from tidal.trainer.trainer import Trainer

CALLS = [name for name, v in vars(TrainerProtocol).items() if inspect.isfunction(v) and not name.startswith("_")]


def mismatches(cls) -> list[str]:
    """What of the Protocol `cls` does not accept: a missing call, a declared parameter it has no
    place for, or a parameter of its own that the Protocol's callers would not pass (no default)."""
    out = []
    for name in CALLS:
        impl = getattr(cls, name, None)
        if not callable(impl):
            out.append(f"{name}: missing")
            continue
        want = list(inspect.signature(getattr(TrainerProtocol, name)).parameters.values())[1:]
        have = inspect.signature(impl).parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in have.values())
        for p in want:
            if p.name not in have and not takes_kwargs:
                out.append(f"{name}: no parameter `{p.name}`")
            elif p.name in have and (p.default is not p.empty) and have[p.name].default is p.empty:
                out.append(f"{name}: `{p.name}` has no default, the Protocol's has one")
        for q in list(have.values())[1:]:
            if q.name not in {p.name for p in want} and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL,
                                                                                                q.VAR_KEYWORD):
                out.append(f"{name}: its own `{q.name}` has no default")
    return out


@pytest.mark.parametrize("cls", [Trainer, TrainerWorker, TrainerGroup])
def test_each_trainer_satisfies_the_protocol(cls):
    assert CALLS and {"forward_backward", "optim_step", "save", "load"} <= set(CALLS)
    assert mismatches(cls) == []


def test_the_check_finds_a_trainer_that_does_not_satisfy_it():
    """Positive control: a trainer without `values`, with a forward_backward that takes no
    kl_coef and a save that needs an argument the Protocol does not pass, is caught."""

    class Partial(TrainerGroup):
        values = None

        def forward_backward(self, batch):
            return {}

        def save(self, path, step):
            return None

    found = mismatches(Partial)
    assert "values: missing" in found
    assert "forward_backward: no parameter `kl_coef`" in found
    assert "save: its own `step` has no default" in found

"""The Trainer's surface: the calls a trainer answers, whoever holds it.

Three things satisfy it, and the controller cannot tell them apart: the `Trainer` itself
(tidal/trainer/trainer.py), one trainer rank as a Ray actor or in this process (`TrainerWorker`,
tidal/runtime/trainer_group.py), and the ranks seen as one (`TrainerGroup`, the same file),
which splits a batch across ranks and adds `update`, the loop of these calls over mini-batches.
tests/test_trainer_protocol.py checks that each accepts every call as declared here.

Data parallel, every call is a collective: all ranks make it, in the same order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TrainerProtocol(Protocol):
    def forward_backward(self, batch: Any, kl_coef: float | None = None) -> dict[str, float]:
        """Accumulate the gradient of the batch's loss (micro-batched by tokens); the loss metrics."""
        ...

    def optim_step(self) -> dict[str, float]:
        """Clip and step (the weight version goes up by one); grad_norm, lr, skipped_step."""
        ...

    def logprobs(self, batch: Any) -> list[list[float]]:
        """The policy's log-probs of each sequence's targets (one shorter than its tokens)."""
        ...

    def ref_logprobs(self, batch: Any) -> list[list[float]]:
        """The frozen reference's log-probs (algorithm.kl_coef > 0), aligned as `logprobs`."""
        ...

    def values(self, batch: Any) -> list[list[float]]:
        """The critic's values (an estimator that needs them), aligned as `logprobs`."""
        ...

    def named_weights(self) -> dict[str, Any]:
        """The full weights by name, as the engines load them."""
        ...

    def save(self, path: str | Path) -> None:
        """Weights, optimizer, scheduler and RNG states into a checkpoint directory."""
        ...

    def load(self, path: str | Path) -> Any:
        """Restore what `save` wrote."""
        ...

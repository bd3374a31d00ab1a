"""Rollout: run environments against an engine and return typed Episodes.

Every episode is its own coroutine (reset → generate → step → … → done), so single-turn,
multi-turn and tool-using environments share one path. Their generation requests meet in
a `BatchingClient`, which hands the engine everything that is waiting at once: the
engine sees large batches while each episode reads as a plain sequential loop.

Token in, token out: the prompt is tokenized once; a later turn appends only the tokens
of the new messages; generated tokens are kept exactly as the engine returned them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tidal.envs.base import Env, Message, RewardError
from tidal.types import Episode, GenerationRequest, GenerationResult, SamplingParams, Status


class BatchingClient:
    """Collects the requests of concurrent episodes and sends them to the engine together."""

    def __init__(self, engine):
        self.engine = engine
        self._pending: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._flush_task: asyncio.Task | None = None
        self.batches: list[int] = []  # sizes of the batches sent, for metrics

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((request, fut))
        if self._flush_task is None:
            self._flush_task = asyncio.create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        # Yield a few times so that every episode that is about to ask has asked.
        for _ in range(3):
            await asyncio.sleep(0)
        pending, self._pending, self._flush_task = self._pending, [], None
        self.batches.append(len(pending))
        try:
            results = await self.engine.generate([r for r, _ in pending])
        except Exception as e:  # noqa: BLE001 - every waiting episode learns of it
            for _, fut in pending:
                fut.set_exception(e)
            return
        if len(results) != len(pending):
            err = RuntimeError(f"engine returned {len(results)} results for {len(pending)} requests")
            for _, fut in pending:
                fut.set_exception(err)
            return
        for (_, fut), res in zip(pending, results):
            fut.set_result(res)


def request_seed(*parts: Any) -> int:
    """A 63-bit seed from the run seed, step, episode and turn: no shared RNG state."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


@dataclass
class EpisodeSpec:
    env: Env
    episode_id: str
    group_id: str
    task_id: str
    seed: int
    greedy: bool = False  # a baseline rollout (ReMax): temperature 0, not trained on


class Rollout:
    def __init__(self, tokenizer, params: SamplingParams, max_turns: int = 1, timeout_s: float = 600.0):
        self.tokenizer = tokenizer
        self.params = params
        self.max_turns = max_turns
        self.timeout_s = timeout_s  # one episode, all its turns: nothing waits forever

    def _continuation(self, rendered: str, history: list[Message], new: list[Message]) -> tuple[list[int], str]:
        """Tokens of the `new` messages after the policy's last turn, and the new rendering.

        `rendered` is the text of the tokens so far (prompt and generations, special tokens
        included). Only the text the chat template adds after it is tokenized — e.g. the
        turn's closing "\n", then the new messages and the generation prompt — so tokens
        already in the episode are never re-tokenized."""
        after = self.tokenizer.apply_chat_template(history + new, add_generation_prompt=True, tokenize=False)
        if not after.startswith(rendered):
            # The policy's turn did not render as the template would (e.g. it stopped on
            # a token the template does not write): continue from the template's own turn.
            before = self.tokenizer.apply_chat_template(history, tokenize=False)
            if not after.startswith(before):
                raise ValueError("the chat template does not render conversations as prefixes of each other")
            rendered = before
        return self.tokenizer(after[len(rendered):], add_special_tokens=False)["input_ids"], after

    async def run_episode(self, spec: EpisodeSpec, client: BatchingClient, step: int) -> Episode:
        ep = Episode(spec.episode_id, spec.group_id, spec.task_id, spec.env.name, step=step)
        t0 = time.perf_counter()
        try:
            history = await spec.env.reset()
            rendered = self.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
            ep.tokens = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        except Exception as e:  # noqa: BLE001
            return self._fail(ep, Status.ENV_ERROR, f"env `{spec.env.name}` reset raised {type(e).__name__}({e})")
        if not ep.tokens:
            return self._fail(ep, Status.ENV_ERROR, f"env `{spec.env.name}` reset gave an empty prompt")
        ep.prompt_len = len(ep.tokens)
        ep.loss_mask = [False] * len(ep.tokens)
        ep.logprobs = [0.0] * len(ep.tokens)
        ep.versions = [-1] * len(ep.tokens)
        gen_time = 0.0
        for turn in range(self.max_turns):
            params = replace(self.params, seed=request_seed(spec.seed, turn))
            if spec.greedy:
                params = replace(params, temperature=0.0)
            t1 = time.perf_counter()
            try:
                res = await client.generate(GenerationRequest(f"{spec.episode_id}/{turn}", list(ep.tokens), params,
                                                                session_id=spec.episode_id))
            except Exception as e:  # noqa: BLE001
                return self._fail(ep, Status.ENGINE_ERROR, f"engine raised {type(e).__name__}({e}) on turn {turn}")
            gen_time += time.perf_counter() - t1
            ep.tokens += res.token_ids
            ep.loss_mask += [True] * len(res.token_ids)
            ep.logprobs += res.logprobs
            ep.versions += res.versions_per_token()
            text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
            try:
                out = await spec.env.step(text)
            except RewardError as e:
                return self._fail(ep, Status.REWARD_ERROR, str(e))
            except Exception as e:  # noqa: BLE001
                return self._fail(ep, Status.ENV_ERROR, f"env `{spec.env.name}` step raised {type(e).__name__}({e}) on turn {turn}")
            ep.reward += out.reward
            for k, v in out.reward_parts.items():
                ep.reward_parts[k] = ep.reward_parts.get(k, 0.0) + v
            ep.metrics.update(out.metrics)
            ep.status = Status.TRUNCATED if res.finish_reason == "length" else Status.OK
            if out.done or res.finish_reason == "length":
                break
            if turn == self.max_turns - 1:  # out of turns: no continuation that nobody answers
                ep.status = Status.TRUNCATED
                break
            history = history + [{"role": "assistant", "content": text}]
            rendered += self.tokenizer.decode(res.token_ids, skip_special_tokens=False)
            try:
                new, rendered = self._continuation(rendered, history, out.messages)
            except ValueError as e:
                return self._fail(ep, Status.ENV_ERROR, f"env `{spec.env.name}` turn {turn}: {e}")
            ep.tokens += new
            ep.loss_mask += [False] * len(new)
            ep.logprobs += [0.0] * len(new)
            ep.versions += [-1] * len(new)
            history = history + out.messages
        ep.metrics["turns"] = float(turn + 1)
        ep.metrics["response_tokens"] = float(ep.num_policy_tokens)
        ep.metrics["generate_s"] = gen_time
        ep.metrics["episode_s"] = time.perf_counter() - t0
        return ep

    @staticmethod
    def _fail(ep: Episode, status: Status, error: str) -> Episode:
        """A typed failure: not trained on, and never scored as reward 0 (reward is unset)."""
        ep.status, ep.reward = status, float("nan")
        ep.error = f"{error} on episode {ep.episode_id} (task {ep.task_id}) of step {ep.step}"
        return ep

    async def _bounded(self, spec: EpisodeSpec, client: BatchingClient, step: int) -> Episode:
        try:
            return await asyncio.wait_for(self.run_episode(spec, client, step), self.timeout_s)
        except TimeoutError:
            ep = Episode(spec.episode_id, spec.group_id, spec.task_id, spec.env.name, step=step)
            return self._fail(ep, Status.TIMEOUT, f"episode exceeded rollout.episode_timeout_s={self.timeout_s:g}")

    async def run(self, specs: list[EpisodeSpec], engine, step: int) -> list[Episode]:
        client = BatchingClient(engine)
        return list(await asyncio.gather(*(self._bounded(s, client, step) for s in specs)))


def group_specs(
    rows: list[dict[str, Any]], make_env: Callable[[dict[str, Any]], Env], samples: int, seed: int, step: int,
    offset: int = 0, greedy_baseline: bool = False,
) -> list[EpisodeSpec]:
    """`samples` episodes per row; episode ids and seeds are functions of (seed, step, index).
    `offset` numbers the rows after those already sampled in this step (dynamic sampling);
    `greedy_baseline` adds one greedy episode per row (ReMax), id suffix `-greedy`."""
    specs = []
    for p, row in enumerate(rows, start=offset):
        task_id = str(row.get("task_id", p))
        for s in range(samples):
            specs.append(EpisodeSpec(make_env(row), f"s{step}-p{p}-e{s}", f"s{step}-p{p}", task_id,
                                     request_seed(seed, step, p, s)))
        if greedy_baseline:
            specs.append(EpisodeSpec(make_env(row), f"s{step}-p{p}-greedy", f"s{step}-p{p}", task_id,
                                     request_seed(seed, step, p, "greedy"), greedy=True))
    return specs

"""Rollout: run environments against an engine, score them, and return typed Episodes.

Every episode is its own coroutine (reset → generate → step → … → done → reward → close), so
single-turn, multi-turn and tool-using environments share one path. Their generation
requests meet in a `BatchingClient`, which hands the engine everything that is waiting at
once: the engine sees large batches while each episode reads as a plain sequential loop, and
an episode waiting on a slow tool holds nobody else up.

Token in, token out across turns. The prompt is rendered by the chat template and tokenized
once (once per run for the samples of a group, which open with the same messages); generated tokens are kept exactly as the engine returned them; after each turn only the
text the template adds after the context so far is tokenized (the turn's end, the
environment's messages, the next generation prompt). The check is textual: the template's
rendering of the whole conversation, with the policy's turns as it generated them (never
re-serialized), must start with the text of the tokens so far. A template that re-renders earlier turns differently
(strips reasoning or whitespace, writes another end-of-turn token, re-serializes tool calls)
is a *prefix break*, detected per episode and handled by `rollout.prefix_policy`:

- `split`: the episode continues in a new segment whose context is the template's own
  rendering of the conversation (masked), and every segment is trained as its own sequence
  with the episode's advantage;
- `continue`: the same, but only the last segment is trained (earlier ones stay masked).

Either way no token is trained on in a context the policy did not see, and the breaks are
counted (`rollout/prefix_breaks`).

Rewards: once the environment is done, the configured rewards score the episode through a
`Scorer` (tidal/rewards/contract.py; worker processes with hard timeouts), per episode, or per
group when a reward is of the batched (TRL) form (tidal/rewards/episode_scoring.py: the input,
the group's meeting point, the outcome and the accuracy). The environment's per-turn rewards add to it.
`close()` is called on every environment however its episode ended.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tidal.envs.base import Action, Env, Message, RewardError, SamplingOverride, is_agent_env, optional
from tidal.images import ImageError, message_images, normalize_messages
from tidal.models.moe import append_routing
from tidal.monitor import trace
from tidal.monitor.episodes import reference_of
from tidal.rewards import step_budget
from tidal.rewards.episode_scoring import GroupScoring, reward_input, score_episode, set_accuracy
from tidal.types import Episode, GenerationRequest, GenerationResult, SamplingParams, Status, Turn

log = logging.getLogger("tidal")


class BatchingClient:
    """Collects the requests of concurrent episodes and sends them to the engine together."""

    def __init__(self, engine):
        self.engine = engine
        self._pending: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._flush_task: asyncio.Task | None = None
        self.batches: list[int] = []  # sizes of the batches sent, for metrics
        # The opening prompts rendered and tokenized in this run, by their messages and tools: a
        # group's samples start from the same messages, and render them once (Rollout._opening).
        self.prompts: dict[str, tuple[str, tuple[int, ...]]] = {}

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
                if not fut.done():
                    fut.set_exception(e)
            return
        if len(results) != len(pending):
            err = RuntimeError(f"engine returned {len(results)} results for {len(pending)} requests")
            for _, fut in pending:
                if not fut.done():
                    fut.set_exception(err)
            return
        for (_, fut), res in zip(pending, results):
            if not fut.done():  # its episode may have been cancelled by its timeout
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
    row: dict[str, Any] = field(default_factory=dict)  # the dataset row: its columns reach the rewards


def new_episode(spec: EpisodeSpec, step: int) -> Episode:
    """The record an episode of `spec` fills in, its task row's reference beside it (the store keeps it)."""
    return Episode(spec.episode_id, spec.group_id, spec.task_id, spec.env.name, step=step, seed=spec.seed,
                   reference=reference_of(spec.row))


@dataclass
class _Conversation:
    """One episode's state between its turns (`Rollout._run_episode`)."""

    history: list[Message]  # as the chat template renders it
    conversation: list[Message]  # as the environment keeps it (e.g. parsed tool calls): what the rewards see
    context_text: str  # the rendered text of the current segment, ep.tokens[seg:]
    tools: list | None
    override: SamplingOverride | None  # the environment's sampling changes for the next turn
    images: list  # the current segment's images, one per image run in ep.tokens[seg:]
    prompt_messages: list[Message]
    prompt_text: str
    seg: int = 0  # start of the current segment: the engine's context is ep.tokens[seg:]
    breaks: int = 0  # prefix breaks so far
    last_text: str = ""
    gen_time: float = 0.0
    env_time: float = 0.0


class Rollout:
    def __init__(self, tokenizer, params: SamplingParams, max_turns: int = 1, timeout_s: float = 600.0, *,
                 max_total_tokens: int | None = None, prefix_policy: str = "split", scorer=None,
                 close_timeout_s: float = 60.0, gateway=None, vision=None, failure_budget: float = 1.0):
        if prefix_policy not in ("split", "continue"):
            raise ValueError(f"prefix_policy must be 'split' or 'continue', got {prefix_policy!r}")
        self.tokenizer = tokenizer
        self.params = params
        self.max_turns = max_turns
        self.timeout_s = timeout_s  # one episode, all its turns and its reward: nothing waits forever
        self.max_total_tokens = max_total_tokens
        self.prefix_policy = prefix_policy
        self.scorer = scorer  # None: the environment's own rewards are the whole reward
        self.close_timeout_s = close_timeout_s
        self.gateway = gateway  # a GatewayServer: agent environments (task.env=openai_agent) call it
        self.vision = vision  # a vision-language model's Vision (tidal/models/vision.py); None: text only
        self.failure_budget = failure_budget  # a step stops waiting for rewards past it (step_budget.py); 1.0: never

    def with_params(self, **changes: Any) -> Rollout:
        """A copy of this rollout whose sampling differs (e.g. greedy evaluation)."""
        other = copy.copy(self)
        other.params = replace(self.params, **changes)
        return other

    # -- text and tokens ----------------------------------------------------------------------
    def _render(self, messages: list[Message], tools: list | None, generation_prompt: bool) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                                  **kwargs)

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _images(self, messages: list[Message], where: str, row: dict[str, Any] | None = None) -> tuple[list[Message], list]:
        """`messages` with their image parts as ImageBlobs (tidal/images.py), and those images in order. A bare
        {"type": "image"} part of the opening messages takes the next image of the row's `images` (or `image`)
        column. Images for a text-only model are refused."""
        row_images = None
        if row is not None:
            row_images = row.get("images")
            if row_images is None and row.get("image") is not None:
                row_images = [row["image"]]
        messages, blobs = normalize_messages(messages, row_images, where)
        if blobs and self.vision is None:
            raise ImageError(f"{where}: {len(blobs)} image(s), but the model is text-only (model.path is not a "
                             "vision-language model)")
        return messages, blobs

    def _tokenize_with_images(self, text: str, blobs: list, where: str) -> list[int]:
        """`text` tokenized, each image placeholder the chat template rendered grown to its image's run
        (tidal/models/vision.py): the tokens the model sees, expanded once, here."""
        ids = self._tokenize(text)
        if self.vision is None:
            return ids
        return self.vision.expand(ids, blobs, where)

    def _opening(self, history: list[Message], tools: list | None, images: list, where: str,
                 seen: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[str, list[int]]:
        """An episode's opening prompt: its text and tokens. Text-only messages the run has
        rendered already (the group's other samples) are taken from `seen`, keyed by their JSON."""
        key = None
        if not images:
            try:
                key = json.dumps([history, tools], sort_keys=True)
            except (TypeError, ValueError):  # not plain JSON (e.g. an object in a message): rendered each time
                key = None
            if key is not None and key in seen:
                text, tokens = seen[key]
                return text, list(tokens)
        text = self._render(history, tools, generation_prompt=True)
        tokens = self._tokenize_with_images(text, images, where)
        if key is not None:
            seen[key] = (text, tuple(tokens))
        return text, tokens

    def _turn_params(self, spec: EpisodeSpec, turn: int, override: SamplingOverride | None, context: int) -> SamplingParams:
        params = replace(self.params, seed=request_seed(spec.seed, turn))
        if spec.greedy:
            params = replace(params, temperature=0.0)
        if override is not None:
            if override.stop is not None:
                params = replace(params, stop=tuple(override.stop))
            if override.max_new_tokens is not None:
                params = replace(params, max_new_tokens=int(override.max_new_tokens))
        if self.max_total_tokens is not None:
            params = replace(params, max_new_tokens=min(params.max_new_tokens, self.max_total_tokens - context))
        return params

    # -- one episode --------------------------------------------------------------------------
    async def run_episode(self, spec: EpisodeSpec, client: BatchingClient, step: int,
                          groups: dict[str, GroupScoring] | None = None) -> Episode:
        ep = new_episode(spec, step)
        group = (groups or {}).get(spec.group_id)
        try:
            if is_agent_env(spec.env):
                return await self._run_agent_episode(spec, ep, group)
            return await self._run_episode(spec, ep, client, group)
        finally:
            if group is not None and ep.episode_id not in group.submitted:
                group.leave(self.scorer)  # failed (or cancelled) before scoring: the others go on

    async def _run_episode(self, spec: EpisodeSpec, ep: Episode, client: BatchingClient,
                           group: GroupScoring | None) -> Episode:
        """Reset, then turns (generate, the environment's step, its answer appended) until the
        environment is done or the turns or tokens run out; then the rewards."""
        t0 = time.perf_counter()
        c = await self._open_episode(spec, ep, client)
        if isinstance(c, Episode):  # failed
            return c
        status = Status.TRUNCATED  # until the environment says done
        for turn in range(self.max_turns):
            ended = await self._turn(spec, ep, client, c, turn)
            if isinstance(ended, Episode):  # failed
                return ended
            if ended is not None:
                status = ended
                break
        ep.status = status
        ep.metrics["turns"] = float(len(ep.turns))
        ep.metrics["rollout/prefix_breaks"] = float(c.breaks)
        ep.metrics["response_tokens"] = float(sum(t.end - t.start for t in ep.turns))
        ep.metrics["generate_s"] = c.gen_time
        ep.metrics["env_s"] = c.env_time
        if self.prefix_policy == "continue" and c.breaks:
            for i in range(c.seg):  # earlier segments stay untrained: off the mask, logprob 0.0, version -1
                ep.loss_mask[i], ep.logprobs[i], ep.versions[i] = False, 0.0, -1
        return await self._score(ep, spec, group, c.prompt_text, c.prompt_messages, c.conversation, c.last_text, t0)

    async def _open_episode(self, spec: EpisodeSpec, ep: Episode, client: BatchingClient) -> _Conversation | Episode:
        """The environment's opening messages rendered into the episode's first tokens; the
        conversation's state, or the episode failed."""
        env, name = spec.env, spec.env.name
        try:
            history = list(await env.reset())
        except Exception as e:  # noqa: BLE001
            return self._fail(ep, Status.ENV_ERROR, f"env `{name}` reset raised {type(e).__name__}({e})")
        try:
            history, images = self._images(history, f"env `{name}` reset", spec.row)
            tools = optional(env, "tools") or None
            override = optional(env, "sampling")
            context_text, ep.tokens = self._opening(history, tools, images, f"env `{name}` reset", client.prompts)
        except Exception as e:  # noqa: BLE001 - a bad image or a message the template cannot render
            return self._fail(ep, Status.ENV_ERROR, f"env `{name}` reset: its messages cannot be rendered: "
                              f"{type(e).__name__}({e})")
        if not ep.tokens:
            return self._fail(ep, Status.ENV_ERROR, f"env `{name}` reset gave an empty prompt")
        self._add_images(ep, images)
        ep.prompt_len = len(ep.tokens)
        ep.loss_mask = [False] * len(ep.tokens)
        ep.logprobs = [0.0] * len(ep.tokens)
        ep.versions = [-1] * len(ep.tokens)
        return _Conversation(history, list(history), context_text, tools, override, list(images), list(history),
                             context_text)

    async def _turn(self, spec: EpisodeSpec, ep: Episode, client: BatchingClient, c: _Conversation,
                    turn: int) -> Episode | Status | None:
        """One turn: generate, the environment's step, its answer appended. Returns the failed
        episode, the status the episode ends with, or None to go on."""
        env, name = spec.env, spec.env.name
        params = self._turn_params(spec, turn, c.override, len(ep.tokens) - c.seg)
        if params.max_new_tokens <= 0:  # the episode's token budget is spent
            ep.metrics["rollout/out_of_tokens"] = 1.0
            return Status.TRUNCATED
        t1 = time.perf_counter()
        try:
            async with trace.async_span("generate", spec.episode_id, turn=turn):
                res = await client.generate(GenerationRequest(f"{spec.episode_id}/{turn}", ep.tokens[c.seg:],
                                                              params, session_id=spec.episode_id,
                                                              images=tuple(c.images)))
        except Exception as e:  # noqa: BLE001
            return self._fail(ep, Status.ENGINE_ERROR, f"engine raised {type(e).__name__}({e}) on turn {turn}")
        c.gen_time += time.perf_counter() - t1
        start = len(ep.tokens)
        ep.tokens += res.token_ids
        ep.loss_mask += [True] * len(res.token_ids)
        ep.logprobs += res.logprobs
        ep.versions += res.versions_per_token()
        ep.routed_experts = append_routing(ep.routed_experts, start, res.routed_experts, len(res.token_ids))
        c.last_text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        spent = self.max_total_tokens is not None and len(ep.tokens) - c.seg >= self.max_total_tokens
        action = Action(c.last_text, res.finish_reason, tuple(res.token_ids), turn,
                        last_turn=turn == self.max_turns - 1 or spent)
        t2 = time.perf_counter()
        try:
            async with trace.async_span("env.step", spec.episode_id, turn=turn):
                out = await env.step(action)
        except RewardError as e:
            return self._fail(ep, Status.REWARD_ERROR, str(e))
        except Exception as e:  # noqa: BLE001
            return self._fail(ep, Status.ENV_ERROR, f"env `{name}` step raised {type(e).__name__}({e}) on turn {turn}")
        c.env_time += time.perf_counter() - t2
        ep.turns.append(Turn(turn, start, len(ep.tokens), len(ep.tokens), c.last_text, res.finish_reason,
                             float(out.reward), list(out.tool_calls), res.version))
        ep.reward += out.reward
        for k, v in out.reward_parts.items():
            ep.reward_parts[k] = ep.reward_parts.get(k, 0.0) + v
        for k, v in out.metrics.items():
            ep.metrics[k] = ep.metrics.get(k, 0.0) + v
        if out.sampling is not None:
            c.override = out.sampling
        # The template renders the turn as generated (`history`); the conversation as the
        # environment keeps it (e.g. parsed tool calls) goes to the rewards (`conversation`).
        c.history.append({"role": "assistant", "content": c.last_text})
        c.conversation.append(out.assistant_message or c.history[-1])
        if out.done:
            return Status.TRUNCATED if res.finish_reason == "length" else Status.OK
        if turn == self.max_turns - 1:  # out of turns: no observation that nobody answers
            ep.metrics["rollout/out_of_turns"] = 1.0
            return Status.TRUNCATED
        c.context_text += self.tokenizer.decode(res.token_ids, skip_special_tokens=False)
        return self._answer(ep, c, list(out.messages), f"env `{name}` turn {turn}")

    def _answer(self, ep: Episode, c: _Conversation, messages: list[Message], where: str) -> Episode | Status | None:
        """The environment's messages, then the next generation prompt: only the text the
        template adds is tokenized (or, on a prefix break, a new segment starts). Returns the
        failed episode, TRUNCATED when the tokens run out, or None."""
        try:
            answer, new_images = self._images(messages, where)
            after = self._render(c.history + answer, c.tools, generation_prompt=True)
            new_seg = not after.startswith(c.context_text)
            if new_seg:  # a prefix break: the new segment holds the whole conversation again, its images too
                added_images = [*message_images(c.history), *new_images]
                new = self._tokenize_with_images(after, added_images, where)
            else:
                added_images = new_images
                new = self._tokenize_with_images(after[len(c.context_text):], new_images, where)
        except Exception as e:  # noqa: BLE001 - e.g. a bad image or a message the template cannot render
            return self._fail(ep, Status.ENV_ERROR, f"{where}: the chat template cannot render its messages: "
                              f"{type(e).__name__}({e})")
        c.history += answer
        c.conversation += answer
        c.breaks += int(new_seg)
        if (self.max_total_tokens is not None
                and (0 if new_seg else len(ep.tokens) - c.seg) + len(new) >= self.max_total_tokens):
            ep.metrics["rollout/out_of_tokens"] = 1.0
            return Status.TRUNCATED
        if new_seg:
            c.seg = len(ep.tokens)
            ep.segments.append(c.seg)
            c.images = []
        c.images += added_images
        self._add_images(ep, added_images)
        c.context_text = after
        ep.routed_experts = append_routing(ep.routed_experts, len(ep.tokens), None, len(new))
        ep.tokens += new
        ep.loss_mask += [False] * len(new)
        ep.logprobs += [0.0] * len(new)
        ep.versions += [-1] * len(new)
        ep.turns[-1].obs_end = len(ep.tokens)
        return None

    @staticmethod
    def _add_images(ep: Episode, blobs: list) -> None:
        """Record images whose runs were appended to `ep.tokens`, in order."""
        for b in blobs:
            ep.images.append(b.id)
            ep.image_blobs[b.id] = b

    async def _score(self, ep: Episode, spec: EpisodeSpec, group: GroupScoring | None, prompt_text: str,
                     prompt_messages: list[Message], conversation: list[Message], last_text: str, t0: float) -> Episode:
        """The task's rewards on a finished episode, then its accuracy (tidal/rewards/episode_scoring.py)."""
        if self.scorer is not None:
            inp = reward_input(ep, spec.row, prompt_text, prompt_messages, conversation, last_text)
            failed = await score_episode(self.scorer, ep, inp, group)
            if failed is not None:
                return self._fail(ep, *failed)
        set_accuracy(ep, scored=self.scorer is not None)
        ep.metrics["episode_s"] = time.perf_counter() - t0
        return ep

    async def _run_agent_episode(self, spec: EpisodeSpec, ep: Episode, group: GroupScoring | None) -> Episode:
        """An agent environment (tidal/envs/openai_agent.py): the agent calls the gateway under
        the episode's session; its recorded calls become the episode's tokens and turns."""
        env, name, t0 = spec.env, spec.env.name, time.perf_counter()
        who = optional(env, "agent_path") or name
        if self.gateway is None:
            return self._fail(ep, Status.ENV_ERROR, f"env `{name}` runs an agent, but this rollout has no gateway")
        params = replace(self.params, temperature=0.0) if spec.greedy else self.params
        session = self.gateway.gateway.open_session(spec.episode_id, params, seed=spec.seed, max_calls=self.max_turns,
                                                    max_total_tokens=self.max_total_tokens)
        error, result = "", None
        try:
            result = await env.run_agent(self.gateway.session_url(spec.episode_id), self.gateway.api_key)
        except Exception as e:  # noqa: BLE001 - the agent's failure types its episode, never the run
            error = f"agent `{who}` raised {type(e).__name__}({_short(e)})"
        finally:
            self.gateway.gateway.close_session(spec.episode_id)  # also on timeout: later calls fail at once
        session.fill(ep, self.prefix_policy)
        ep.metrics["env_s"] = time.perf_counter() - t0 - session.generate_s
        if error:
            if not session.limit_hit:
                return self._fail(ep, Status.ENV_ERROR, f"{error} after {len(session.calls)} calls")
            ep.metrics[f"rollout/out_of_{session.limit_hit}"] = 1.0  # the budget refused a call: truncated
        if not ep.turns:
            return self._fail(ep, Status.ENV_ERROR, f"agent `{who}` made no call through the gateway")
        final = session.nodes[session.final_completion()]
        status = Status.TRUNCATED if error or final.finish_reason == "length" else Status.OK
        if result is not None and result.reward is not None:  # the agent's own reward: on its last turn
            last = max(ep.turns, key=lambda t: t.end)
            last.reward += result.reward
            ep.reward += result.reward
            for k, v in (result.parts or {"agent": result.reward}).items():
                ep.reward_parts[k] = ep.reward_parts.get(k, 0.0) + v
        answer = result.answer if result is not None and result.answer is not None else final.content
        first = session.calls[0]
        last_call = session.calls[-1]
        prompt_messages = list(first.messages or [{"role": "user", "content": first.prompt_text}])
        conversation = [*(last_call.messages or prompt_messages), {"role": "assistant", "content": final.content}]
        ep.status = status
        return await self._score(ep, spec, group, first.prompt_text, prompt_messages, conversation, answer, t0)

    @staticmethod
    def _fail(ep: Episode, status: Status, error: str) -> Episode:
        """A typed failure: not trained on, and never scored as reward 0 (reward is unset)."""
        ep.status, ep.reward = status, float("nan")
        named = f"episode {ep.episode_id}" in error  # the reward pool names the episode itself
        ep.error = error if named else f"{error} on episode {ep.episode_id} (task {ep.task_id}) of step {ep.step}"
        return ep

    async def _bounded(self, spec: EpisodeSpec, client: BatchingClient, step: int, groups) -> Episode:
        try:
            ep = await asyncio.wait_for(self.run_episode(spec, client, step, groups), self.timeout_s)
        except TimeoutError:
            ep = self._fail(new_episode(spec, step), Status.TIMEOUT,
                            f"episode exceeded rollout.episode_timeout_s={self.timeout_s:g}")
        await self._close(spec, ep)
        return ep

    async def _close(self, spec: EpisodeSpec, ep: Episode) -> None:
        """Release the environment (sandboxes, sessions) on every path, bounded."""
        close = optional(spec.env, "close")
        if close is None:
            return
        try:
            await asyncio.wait_for(close(), self.close_timeout_s)
        except Exception as e:  # noqa: BLE001 - the episode stands; the leak is logged and counted
            ep.metrics["env/close_errors"] = 1.0
            log.warning("env `%s` close raised %s(%s) on episode %s", spec.env.name, type(e).__name__, e, ep.episode_id)

    async def run(self, specs: list[EpisodeSpec], engine, step: int,
                  on_episode: Callable[[Episode], None] | None = None) -> list[Episode]:
        """Run `specs` concurrently; `on_episode(ep)` is called as each episode finishes (the
        episode store streams them). Results are in the order of `specs`."""
        client = BatchingClient(engine)
        groups: dict[str, GroupScoring] | None = None
        if self.scorer is not None and getattr(self.scorer, "per_group", False):
            groups = {}
            for s in specs:
                groups.setdefault(s.group_id, GroupScoring(0)).size += 1

        async def one(spec: EpisodeSpec) -> Episode:
            ep = await self._bounded(spec, client, step, groups)
            if (budget := step_budget.current()) is not None:
                budget.record(ep)
            if on_episode is not None:
                on_episode(ep)
            return ep

        token = step_budget.open_budget(len(specs), self.failure_budget)  # seen by the episode tasks below
        try:
            return list(await asyncio.gather(*(one(s) for s in specs)))
        finally:
            step_budget.close_budget(token)


def _short(e: BaseException, n: int = 300) -> str:
    text = str(e)
    return text if len(text) <= n else text[:n] + "..."


def group_specs(
    rows: list[dict[str, Any]], make_env: Callable[..., Env], samples: int, seed: int, step: int,
    offset: int = 0, greedy_baseline: bool = False,
) -> list[EpisodeSpec]:
    """`samples` episodes per row; episode ids and seeds are functions of (seed, step, index).
    `make_env(row, seed)` builds each episode's environment with the episode's seed.
    `offset` numbers the rows after those already sampled in this step (dynamic sampling);
    `greedy_baseline` adds one greedy episode per row (ReMax), id suffix `-greedy`."""
    specs = []
    for p, row in enumerate(rows, start=offset):
        task_id = str(row.get("task_id", p))
        for s in range(samples):
            es = request_seed(seed, step, p, s)
            specs.append(EpisodeSpec(make_env(row, es), f"s{step}-p{p}-e{s}", f"s{step}-p{p}", task_id, es, row=row))
        if greedy_baseline:
            es = request_seed(seed, step, p, "greedy")
            specs.append(EpisodeSpec(make_env(row, es), f"s{step}-p{p}-greedy", f"s{step}-p{p}", task_id, es,
                                     greedy=True, row=row))
    return specs

"""Sessions: the calls one agent made through the gateway, recorded as the engine produced
them, and assembled into that episode's tokens, turns and segments.

A session is a tree of token contexts. Each call's prompt (the chat template's rendering of
its messages, or a completions prompt) continues the longest earlier context whose text the
prompt starts with: an earlier prompt, or an earlier prompt with one of its completions. Only
the text after that context is tokenized, so the engine is given the very tokens it produced
before (docs/architecture.md, "Invariants": token in, token out). A call that continues no earlier reply is a *prefix
break* (the agent edited or dropped history, or the template re-renders a turn differently):
it branches off the longest earlier prompt it still starts with (the edited text is masked
context there), or starts a new root from its own tokenization; breaks are counted.

Assembly: every leaf (a completion nothing extended) ends one chain root → leaf, and each
chain is one segment of the episode, the chain of the session's last call last. A completion
is trained in the first trained chain that holds it and is masked context in the others, so
no generated token is trained twice and every trained token sits in the context the policy
saw when it produced it. `prefix_policy="split"` trains every chain; `"continue"` only the
last one (the others stay in the record, masked).

Legend: ids are token ids; a node's `tokens` are its own, appended to its parent's context.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tidal.types import Episode, SamplingParams, ToolCallRecord, Turn


@dataclass
class Node:
    id: int
    parent: int | None
    kind: str  # "prompt" | "completion"
    tokens: list[int]
    text: str  # the whole context's text up to and including this node
    length: int  # tokens of the whole context up to and including this node
    # completion nodes only
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    content: str = ""  # decoded, special tokens skipped
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    call: int = -1
    choice: int = 0
    version: int = -1


@dataclass
class Call:
    """One request of the session, as the agent sent it."""

    index: int
    prompt: int  # the prompt node
    messages: list[dict[str, Any]] | None  # chat calls; None for completions
    prompt_text: str
    completions: list[int] = field(default_factory=list)  # completion nodes, by choice
    broke: bool = False  # continued no earlier completion: history was edited or dropped
    overridden: bool = False  # the request asked for other sampling than the run's


class SessionLimit(Exception):
    """The session's turn or token budget is spent (the episode ends `truncated`)."""

    def __init__(self, message: str, which: str):
        super().__init__(message)
        self.which = which  # "turns" | "tokens"


class Session:
    """The record of one episode's calls. Thread-safe: an agent may call concurrently."""

    def __init__(self, session_id: str, params: SamplingParams | None = None, *, seed: int = 0,
                 max_calls: int | None = None, max_total_tokens: int | None = None):
        self.id = session_id
        self.params = params  # the run's sampling: the session's calls are sampled with it
        self.secret = secrets.token_urlsafe(16)  # in the session's URL: only its own agent can call it
        self.seed = seed
        self.max_calls = max_calls
        self.max_total_tokens = max_total_tokens
        self.nodes: list[Node] = []
        self.calls: list[Call] = []
        self.open = True
        self.limit_hit = ""  # "turns" | "tokens" once a call was refused for the budget
        self.generate_s = 0.0
        self.started = time.time()
        # assistant messages the gateway returned → the text the policy generated, so that the
        # conversation an agent sends back renders the turn as generated (never re-serialized)
        self.returned: dict[str, str] = {}
        self.lock = threading.Lock()

    # -- contexts ------------------------------------------------------------------------------
    def context_ids(self, node_id: int | None) -> list[int]:
        out: list[list[int]] = []
        while node_id is not None:
            n = self.nodes[node_id]
            out.append(n.tokens)
            node_id = n.parent
        return [t for part in reversed(out) for t in part]

    def _longest(self, match) -> Node | None:
        best = None
        for n in self.nodes:
            if match(n) and (best is None or n.length > best.length):
                best = n
        return best

    def begin_call(self, prompt_text: str, tokenize, messages: list[dict[str, Any]] | None = None,
                   prompt_ids: list[int] | None = None) -> tuple[Call, list[int]]:
        """Record a call's prompt: continue the longest earlier context it starts with, or start
        a new root (a prefix break). Returns the call and the prompt's token ids for the engine.
        `prompt_ids` given (a completions call with token ids): matched by ids, not text."""
        with self.lock:
            if not self.open:
                raise KeyError(f"session `{self.id}` is closed")
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                self.limit_hit = "turns"
                raise SessionLimit(f"session `{self.id}` used its {self.max_calls} turns (rollout.max_turns)", "turns")
            if prompt_ids is not None:
                base = self._longest(lambda n: _starts_with(prompt_ids, self.context_ids(n.id)))
                new = list(prompt_ids[base.length:]) if base else list(prompt_ids)
            else:
                base = self._longest(lambda n: prompt_text.startswith(n.text))
                new = tokenize(prompt_text[len(base.text):]) if base else tokenize(prompt_text)
            if base is not None and not new and base.kind == "prompt":
                node = base  # the same prompt again (a retry): the same tokens
            else:
                length = (base.length if base else 0) + len(new)
                node = self._append(Node(len(self.nodes), base.id if base else None, "prompt", new, prompt_text, length))
            if self.max_total_tokens is not None and node.length >= self.max_total_tokens:
                self.limit_hit = "tokens"
                raise SessionLimit(f"session `{self.id}`: the context holds {node.length} tokens, the episode's "
                                   f"budget is {self.max_total_tokens} (rollout.max_total_tokens)", "tokens")
            # A prefix break: a later call that continues no earlier reply (it starts a new root,
            # or branches off a prompt with other text than any reply); a retried prompt is none.
            broke = bool(self.calls) and (base is None or (base.kind == "prompt" and node is not base))
            call = Call(len(self.calls), node.id, messages, prompt_text, broke=broke)
            self.calls.append(call)
            return call, self.context_ids(node.id)

    def room(self, call: Call) -> int | None:
        """Tokens the call may still generate within the episode's budget (None: no budget)."""
        if self.max_total_tokens is None:
            return None
        return self.max_total_tokens - self.nodes[call.prompt].length

    def add_completion(self, call: Call, choice: int, token_ids: list[int], logprobs: list[float],
                       versions: list[int], finish_reason: str, text_with_specials: str, content: str,
                       tool_calls: list[ToolCallRecord], version: int) -> Node:
        with self.lock:
            p = self.nodes[call.prompt]
            node = self._append(Node(len(self.nodes), p.id, "completion", list(token_ids), p.text + text_with_specials,
                                  p.length + len(token_ids), list(logprobs), list(versions), finish_reason, content,
                                  list(tool_calls), call.index, choice, version))
            call.completions.append(node.id)
            return node

    def _append(self, node: Node) -> Node:
        self.nodes.append(node)
        return node

    # -- assembly ------------------------------------------------------------------------------
    def chains(self) -> list[list[int]]:
        """Root → leaf paths of node ids; the chain of the last call's first completion last."""
        parents = {n.parent for n in self.nodes}
        leaves = [n.id for n in self.nodes if n.kind == "completion" and n.id not in parents]
        out = []
        for leaf in leaves:
            path, i = [], leaf
            while i is not None:
                path.append(i)
                i = self.nodes[i].parent
            out.append(path[::-1])
        final = self.final_completion()
        if final is not None:
            out.sort(key=lambda c: final in c)  # stable: the others keep their order
        return out

    def final_completion(self) -> int | None:
        for call in reversed(self.calls):
            if call.completions:
                return call.completions[0]
        return None

    def fill(self, ep: Episode, prefix_policy: str = "split") -> None:
        """Write the session into `ep`: tokens, loss mask, log-probs, versions, turns, segments
        and metrics. An episode without any completion gets no tokens."""
        if prefix_policy not in ("split", "continue"):
            raise ValueError(f"prefix_policy must be 'split' or 'continue', got {prefix_policy!r}")
        chains = self.chains()
        trained_chains = range(len(chains)) if prefix_policy == "split" else range(len(chains) - 1, len(chains))
        trainer: dict[int, int] = {}  # completion node → the chain that trains it
        for c in trained_chains:
            for i in chains[c]:
                if self.nodes[i].kind == "completion":
                    trainer.setdefault(i, c)
        ep.tokens, ep.loss_mask, ep.logprobs, ep.versions = [], [], [], []
        ep.segments, ep.turns = [], []
        placed: set[int] = set()
        for c, chain in enumerate(chains):
            ep.segments.append(len(ep.tokens))
            last_turn: Turn | None = None
            for i in chain:
                n = self.nodes[i]
                start = len(ep.tokens)
                ep.tokens += n.tokens
                if n.kind == "prompt":
                    ep.loss_mask += [False] * len(n.tokens)
                    ep.logprobs += [0.0] * len(n.tokens)
                    ep.versions += [-1] * len(n.tokens)
                    if last_turn is not None:
                        last_turn.obs_end = len(ep.tokens)
                    last_turn = None
                    continue
                train = trainer.get(i) == c
                ep.loss_mask += [train] * len(n.tokens)
                ep.logprobs += list(n.logprobs) if train else [0.0] * len(n.tokens)
                ep.versions += list(n.versions) if train else [-1] * len(n.tokens)
                last_turn = None
                if train or (i not in trainer and i not in placed):
                    last_turn = Turn(n.call, start, len(ep.tokens), len(ep.tokens), n.content, n.finish_reason, 0.0,
                                     list(n.tool_calls), n.version)
                    ep.turns.append(last_turn)
                    placed.add(i)
        if not ep.segments:
            ep.segments = [0]
        ep.turns.sort(key=lambda t: t.start)
        roots = sum(1 for n in self.nodes if n.parent is None)
        breaks = sum(c.broke for c in self.calls)
        first_prompt = self.nodes[self.calls[0].prompt] if self.calls else None
        ep.prompt_len = len(first_prompt.tokens) if first_prompt is not None and first_prompt.parent is None else 0
        ep.metrics["turns"] = float(sum(len(c.completions) for c in self.calls))
        ep.metrics["rollout/prefix_breaks"] = float(breaks)
        ep.metrics["gateway/calls"] = float(len(self.calls))
        ep.metrics["gateway/branches"] = float(max(0, len(chains) - roots - breaks))  # n > 1 choices continued apart
        ep.metrics["gateway/sampling_overridden"] = float(sum(c.overridden for c in self.calls))
        records = [r for c in self.calls for i in c.completions for r in self.nodes[i].tool_calls]
        ep.metrics["tools/calls"] = float(len(records))  # as parsed: the agent, not tidal, runs them
        ep.metrics["tools/errors/parse"] = float(sum(r.status == "parse" for r in records))
        ep.metrics["response_tokens"] = float(sum(len(self.nodes[i].tokens) for c in self.calls for i in c.completions))
        ep.metrics["generate_s"] = self.generate_s


def _starts_with(ids: list[int], prefix: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[:len(prefix)] == prefix

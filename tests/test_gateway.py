"""The gateway (tidal/runtime/gateway.py) through the official `openai` client, on loopback:
chat, tools and tool calls, streaming, n > 1, log-probs, errors, the token, sessions.

Two servers: the embedded tiny tool model on the torch engine (what a user serves), and a
scripted policy for replies that must be known exactly (tool-call parsing)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch

from tidal.config import GatewayConfig
from tidal.engines.router import Router
from tidal.engines.scripted import ScriptedEngine
from tidal.engines.torch_engine import TorchEngine
from tidal.envs.tool_arith import SYSTEM_PROMPT
from tidal.models import TOOL_MODEL_DIR, load_model, load_tokenizer, stop_token_ids
from tidal.runtime.gateway import Gateway
from tidal.runtime.gateway_http import GatewayServer, start_gateway
from tidal.runtime.rollout import request_seed
from tidal.runtime.sessions import Session
from tidal.types import Episode, GenerationRequest, SamplingParams

QUESTION = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 347 * 28?"}]
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def served(tool_tokenizer):
    """The tiny tool model behind a router, served on loopback."""
    torch.set_num_threads(2)
    engine = TorchEngine(load_model(TOOL_MODEL_DIR, "float32", "cpu"), tool_tokenizer.pad_token_id, 64,
                         tokenizer=tool_tokenizer)
    server = start_gateway(Router([engine]), tool_tokenizer, TOOL_MODEL_DIR, GatewayConfig())
    yield server, engine
    server.close()


@pytest.fixture(scope="module")
def client(served):
    server, _ = served
    return openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0)


def scripted_server(tokenizer, texts: list[str], token: str | None = None) -> GatewayServer:
    """A gateway over a scripted policy: the i-th call of a session (or each lone call) replies texts[i]."""
    eos = stop_token_ids(tokenizer)[0]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]

    def policy(req: GenerationRequest):
        return ids[int(req.request_id.rsplit("-", 1)[1]) % len(ids)] if len(ids) > 1 and req.session_id.startswith(
            "gw-") else ids[0]

    engine = ScriptedEngine(policy, tokenizer=tokenizer)
    gateway = Gateway(Router([engine]), tokenizer, "scripted", max_model_len=512, stop_token_ids=stop_token_ids(tokenizer))
    return GatewayServer(gateway, token=token)


def test_models_and_a_chat_completion(served, client, tool_tokenizer):
    assert [m.id for m in client.models.list().data] == ["tiny-tool"]
    r = client.chat.completions.create(model="tiny-tool", messages=QUESTION, max_tokens=40, seed=3)
    (choice,) = r.choices
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    rendered = tool_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tool_tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert 0 < r.usage.completion_tokens <= 40


def test_the_gateway_returns_exactly_what_the_engine_generates(served, client, tool_tokenizer):
    """Token for token, log-prob for log-prob: the same prompt ids and seed sent to the engine
    directly give the same reply."""
    _, engine = served
    r = client.chat.completions.create(model="tiny-tool", messages=QUESTION, max_tokens=40, seed=11, logprobs=True,
                                       extra_body={"return_token_ids": True})
    body = r.model_dump()
    ch = body["choices"][0]
    params = SamplingParams(max_new_tokens=40, seed=request_seed(11, 0), stop_token_ids=stop_token_ids(tool_tokenizer))
    (direct,) = asyncio.run(engine.generate([GenerationRequest("d", body["prompt_token_ids"], params)]))
    assert ch["token_ids"] == direct.token_ids
    got = [t["logprob"] for t in ch["logprobs"]["content"]]
    # Both ran alone through the same engine and kernels: equal up to float summation order (1e-5
    # is far below the gap between any two sampled tokens' log-probs that would change a sample).
    assert got == pytest.approx(direct.logprobs, abs=1e-5)
    assert ch["weight_versions"] == [0] * len(direct.token_ids)
    assert "".join(t["token"] for t in ch["logprobs"]["content"]).startswith(
        tool_tokenizer.decode(direct.token_ids[:1], skip_special_tokens=False))


def test_seeds_reproduce_and_n_samples_apart(client):
    a = client.chat.completions.create(model="tiny-tool", messages=QUESTION, max_tokens=32, seed=5)
    b = client.chat.completions.create(model="tiny-tool", messages=QUESTION, max_tokens=32, seed=5)
    assert a.choices[0].message.content == b.choices[0].message.content
    r = client.chat.completions.create(model="tiny-tool", messages=QUESTION, max_tokens=32, seed=5, n=4)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].message.content == a.choices[0].message.content  # choice 0 is the seed's own sample
    assert len({c.message.content for c in r.choices}) > 1  # the choices are sampled apart, not copies
    assert r.usage.completion_tokens > 0


def test_streaming_gives_the_same_reply_and_usage(client):
    plain = client.chat.completions.create(model="tiny-tool", messages=QUESTION, max_tokens=32, seed=8)
    chunks = list(client.chat.completions.create(model="tiny-tool", messages=QUESTION, max_tokens=32, seed=8,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == plain.choices[0].message.content and finish == [plain.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_completions_with_text_and_token_ids(client, tool_tokenizer):
    prompt = "<|im_start|>user\nWhat is 12 * 3?<|im_end|>\n<|im_start|>assistant\n"
    r = client.completions.create(model="tiny-tool", prompt=prompt, max_tokens=16, n=2, logprobs=0, seed=1)
    assert len(r.choices) == 2 and r.object == "text_completion"
    for c in r.choices:
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) > 0
        assert all(lp <= 0.0 for lp in c.logprobs.token_logprobs)
    ids = tool_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    by_ids = client.completions.create(model="tiny-tool", prompt=ids, max_tokens=16, seed=1)
    assert by_ids.choices[0].text == r.choices[0].text  # the same prompt, as ids: the same sample
    echo = client.completions.create(model="tiny-tool", prompt=prompt, max_tokens=4, seed=1, echo=True)
    assert echo.choices[0].text.startswith(prompt)


def test_tool_calls_come_out_parsed(tool_tokenizer):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 28"}}</tool_call>'
    with scripted_server(tool_tokenizer, [call]) as server:
        c = openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0)
        r = c.chat.completions.create(model="scripted", messages=QUESTION, tools=TOOLS)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        (tc,) = msg.tool_calls
        assert tc.type == "function" and tc.function.name == "calculator"
        assert json.loads(tc.function.arguments) == {"expression": "347 * 28"} and tc.id
        # without tools in the request the reply is plain text
        plain = c.chat.completions.create(model="scripted", messages=QUESTION).choices[0]
        assert plain.message.tool_calls is None and plain.message.content == call
        # tool_choice=none: no parsing either
        none = c.chat.completions.create(model="scripted", messages=QUESTION, tools=TOOLS, tool_choice="none")
        assert none.choices[0].message.tool_calls is None
        # streamed: the call arrives as a tool_calls delta
        chunks = list(c.chat.completions.create(model="scripted", messages=QUESTION, tools=TOOLS, stream=True))
        deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
        assert [d.function.name for d in deltas] == ["calculator"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_malformed_call_stays_text(tool_tokenizer):
    broken = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+"</tool_call>'
    with scripted_server(tool_tokenizer, [broken]) as server:
        c = openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0)
        r = c.chat.completions.create(model="scripted", messages=QUESTION, tools=TOOLS)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == broken
        assert r.choices[0].finish_reason == "stop"


def test_tool_messages_render_into_the_next_prompt(client, tool_tokenizer):
    history = [*QUESTION,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "calculator",
                                                                 "arguments": '{"expression": "347 * 28"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "9716"}]
    r = client.chat.completions.create(model="tiny-tool", messages=history, tools=TOOLS, max_tokens=24, seed=0,
                                       extra_body={"return_token_ids": True})
    prompt = tool_tokenizer.decode(r.model_dump()["prompt_token_ids"])
    # the call and its result are in the prompt, as the template renders them, then a new turn starts
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 28"}}</tool_call>' in prompt
    assert prompt.endswith("<tool_response>9716</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_errors_have_openai_shape(served, client):
    server, _ = served
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-tool", messages=QUESTION, temperature=5)
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-tool", messages=QUESTION, logprobs=True, top_logprobs=3)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-tool", messages=[{"role": "user", "content": "x" * 3000}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-tool", messages=[])
    assert e.value.body["param"] == "messages"
    raw = httpx.post(server.url + "/chat/completions", content=b"{not json", timeout=10)
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    missing = httpx.get(server.base + "/v2/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def test_a_token_is_checked_and_required_off_loopback(tool_tokenizer):
    with scripted_server(tool_tokenizer, ["hi"], token="s3cret") as server:
        bad = openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.body["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=server.url, api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model="scripted", messages=QUESTION).choices[0].message.content == "hi"
        assert httpx.get(server.base + "/health", timeout=10).status_code == 200  # health needs no token
    gateway = Gateway(None, tool_tokenizer, "x", max_model_len=8)
    with pytest.raises(ValueError, match="needs a token"):
        GatewayServer(gateway, host="0.0.0.0")  # refused before anything binds


def test_a_session_records_its_calls_as_one_episode(served, tool_tokenizer):
    server, _ = served
    gw = server.gateway
    params = SamplingParams(max_new_tokens=24, stop_token_ids=stop_token_ids(tool_tokenizer))
    session = gw.open_session("ep-1", params, seed=7, max_calls=4)
    c = openai.OpenAI(base_url=server.session_url("ep-1"), api_key=server.api_key, max_retries=0)
    # any model name is accepted in a session (the agent's own, unchanged), and its temperature is the run's
    first = c.chat.completions.create(model="gpt-4o-mini", messages=QUESTION, temperature=0.2,
                                      extra_body={"return_token_ids": True})
    history = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "user", "content": "Check it."}]
    # the header names the session as well as the URL prefix does
    via_header = openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0,
                               default_headers={"X-Tidal-Session": gw.session_key("ep-1")})
    second = via_header.chat.completions.create(model="gpt-4o-mini", messages=history,
                                                extra_body={"return_token_ids": True})
    assert gw.close_session("ep-1") is session
    ep = Episode("ep-1", "g", "t", "agent")
    session.fill(ep)
    a, b = first.model_dump(), second.model_dump()
    # the second call's prompt continues the first call's tokens exactly
    assert b["prompt_token_ids"][: len(a["prompt_token_ids"]) + len(a["choices"][0]["token_ids"])] == \
        a["prompt_token_ids"] + a["choices"][0]["token_ids"]
    assert ep.metrics["rollout/prefix_breaks"] == 0 and ep.metrics["gateway/sampling_overridden"] == 1
    assert ep.tokens == b["prompt_token_ids"] + b["choices"][0]["token_ids"]
    trained = [t for t, m in zip(ep.tokens, ep.loss_mask) if m]
    assert trained == a["choices"][0]["token_ids"] + b["choices"][0]["token_ids"]
    with pytest.raises(openai.NotFoundError) as e:  # closed: no further call is taken
        c.chat.completions.create(model="m", messages=QUESTION)
    assert e.value.body["code"] == "session_not_found"


def test_a_session_is_reachable_only_with_its_secret(served):
    """Episode ids are predictable; a session's URL also holds a secret, so nothing else that
    reaches the gateway (another episode's agent, another local process) writes into its record."""
    server, _ = served
    gw = server.gateway
    session = gw.open_session("ep-3", SamplingParams(max_new_tokens=4))
    try:
        for key in ("ep-3", "ep-3~wrong", gw.session_key("ep-3") + "x"):
            c = openai.OpenAI(base_url=f"{server.base}/sessions/{key}/v1", api_key=server.api_key, max_retries=0)
            with pytest.raises(openai.NotFoundError) as e:
                c.chat.completions.create(model="m", messages=QUESTION)
            assert e.value.body["code"] == "session_not_found" and session.secret not in e.value.body["message"]
        assert not session.calls  # nothing was recorded
        ok = openai.OpenAI(base_url=server.session_url("ep-3"), api_key=server.api_key, max_retries=0)
        ok.chat.completions.create(model="m", messages=QUESTION)
        assert len(session.calls) == 1
    finally:
        gw.close_session("ep-3")


def test_a_session_out_of_turns_refuses_the_call(served, tool_tokenizer):
    server, _ = served
    gw = server.gateway
    session: Session = gw.open_session("ep-2", SamplingParams(max_new_tokens=8), max_calls=1)
    c = openai.OpenAI(base_url=server.session_url("ep-2"), api_key=server.api_key, max_retries=0)
    c.chat.completions.create(model="m", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="m", messages=QUESTION)
    assert e.value.body["code"] == "session_turns_limit" and session.limit_hit == "turns"
    gw.close_session("ep-2")


def test_serve_policy_serves_a_model_until_interrupted(tmp_path):
    import re
    import signal
    import subprocess
    import sys
    import time

    # Started with SIGINT ignored, as a shell's background job is (the CI failure this replays):
    # the server sets its own handler, so SIGINT still stops it.
    serve = ["-c", "import sys; from tidal.cli import main; sys.exit(main())", "serve-policy", "default", "run.threads=1"]
    ignoring_sigint = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                       f"os.execv(sys.executable, [sys.executable, *{serve!r}])")
    proc = subprocess.Popen([sys.executable, "-c", ignoring_sigint], stderr=subprocess.PIPE, text=True)
    try:
        deadline, line = time.monotonic() + 120, ""
        while "serving" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stderr.readline()
        url = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", line)
        assert url, line
        c = openai.OpenAI(base_url=url.group(1), api_key="none", max_retries=0)
        r = c.chat.completions.create(model="tiny-arith", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                      max_tokens=8, temperature=0)
        assert r.choices[0].message.content
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=30) == 0
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # tidal's CLI prints every thread's stack on it
            time.sleep(2)
            proc.kill()
            pytest.fail("serve-policy did not stop within 30 s of SIGINT; its threads:\n" + proc.communicate()[1][-8000:])
    finally:
        if proc.poll() is None:
            proc.kill()
    bad = subprocess.run([sys.executable, "-c", "import sys; from tidal.cli import main; sys.exit(main())",
                          "serve-policy", "default", "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "--token-env" in bad.stderr


def test_the_llm_judge_runs_against_the_gateway_serving_the_tiny_model():
    """[rewards]' judge, pointed at the gateway over the embedded tiny model: its calls are
    served (HTTP 200, OpenAI's shape). The tiny arithmetic model is no judge: its replies do
    not hold a verdict, and the judge says so, typed, quoting the reply after its retry."""
    from tidal.models import DEFAULT_MODEL_DIR
    from tidal.rewards.judge import JudgeVerdictError, LLMJudge

    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    engine = TorchEngine(load_model(DEFAULT_MODEL_DIR, "float32", "cpu"), tokenizer.pad_token_id, 8, tokenizer=tokenizer)
    # the judge's rubric prompt is longer than the tiny model's 256 positions: allow more (RoPE runs on)
    server = start_gateway(Router([engine]), tokenizer, DEFAULT_MODEL_DIR, GatewayConfig(max_model_len=2048))
    try:
        judge = LLMJudge(server.url, model=server.gateway.model_name, max_tokens=12, max_retries=1)
        with pytest.raises(JudgeVerdictError, match="malformed after 2 attempts") as e:
            asyncio.run(judge("12", prompt="What is 5 + 7?", answer="12"))
        assert server.gateway.stats["requests"] == 2 and server.gateway.stats["errors"] == 0
        assert e.value.raw  # the tiny model's own reply, quoted
    finally:
        server.close()


def test_every_replica_serves_and_a_session_stays_on_one(tool_tokenizer):
    eos = stop_token_ids(tool_tokenizer)[0]
    seen: list[list[str]] = [[], []]

    def replica(i):
        def policy(req):
            seen[i].append(req.session_id)
            return tool_tokenizer("ok", add_special_tokens=False)["input_ids"] + [eos]
        return ScriptedEngine(policy, tokenizer=tool_tokenizer)

    gateway = Gateway(Router([replica(0), replica(1)]), tool_tokenizer, "scripted", max_model_len=512,
                      stop_token_ids=stop_token_ids(tool_tokenizer))
    with GatewayServer(gateway) as server:
        for s in range(6):
            gateway.open_session(f"ep{s}", SamplingParams(max_new_tokens=8), seed=s)

        async def agent(s):
            c = openai.AsyncOpenAI(base_url=server.session_url(f"ep{s}"), api_key=server.api_key, max_retries=0)
            messages = list(QUESTION)
            for _ in range(3):
                r = await c.chat.completions.create(model="any", messages=messages)
                messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
            await c.close()

        async def all_agents():
            await asyncio.gather(*(agent(s) for s in range(6)))

        asyncio.run(all_agents())
    assert seen[0] and seen[1]  # both replicas served
    assert not set(seen[0]) & set(seen[1])  # no session was split across replicas
    assert sorted(seen[0] + seen[1]) == sorted(f"ep{s}" for s in range(6) for _ in range(3))


def test_stop_strings_end_the_reply_and_are_cut_from_it(tool_tokenizer):
    with scripted_server(tool_tokenizer, ["The answer is 42. END and more text"]) as server:
        c = openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0)
        r = c.chat.completions.create(model="scripted", messages=QUESTION, stop=["END"],
                                      extra_body={"return_token_ids": True})
        ch = r.choices[0]
        assert ch.message.content == "The answer is 42. " and ch.finish_reason == "stop"
        # the engine stopped at the token that completed the stop string: kept in the record
        kept = tool_tokenizer.decode(r.model_dump()["choices"][0]["token_ids"])
        assert kept.endswith("END") and "more" not in kept
        plain = c.chat.completions.create(model="scripted", messages=QUESTION, max_tokens=3)
        assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 3


def test_oversized_and_hostile_bodies_are_refused(served):
    server, _ = served
    url = server.url + "/chat/completions"
    big = b'{"model": "tiny-tool", "messages": [{"role": "user", "content": "' + b"x" * (5 << 20) + b'"}]}'
    r = httpx.post(url, content=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    deep = b"[" * 100_000 + b"]" * 100_000  # nesting past the JSON parser's recursion limit
    r = httpx.post(url, content=deep, timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    c = openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-tool", messages=QUESTION, stop=["y" * 10_000])
    assert e.value.body["param"] == "stop"
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200  # still serving


def test_a_vision_language_models_context_comes_from_its_text_config():
    """Qwen2-VL keeps max_position_embeddings in `text_config`: the gateway over the tiny VLM
    refuses what exceeds its 1024 positions, not a 4096 fallback."""
    from tidal.models import DEFAULT_VLM_DIR

    tokenizer = load_tokenizer(DEFAULT_VLM_DIR)
    engine = ScriptedEngine([stop_token_ids(tokenizer)[:1]], tokenizer=tokenizer)
    server = start_gateway(Router([engine]), tokenizer, DEFAULT_VLM_DIR, GatewayConfig())
    try:
        assert server.gateway.max_model_len == 1024
    finally:
        server.close()

"""The reward-model server on 127.0.0.1: concurrent clients get their own answers in order
and share forward passes; the token rules; OpenRLHF's protocol both ways (tidal's client
against tidal's server, and a request shaped exactly as OpenRLHF's client sends it); errors
in one JSON shape; the remote client's timeouts and bad answers, each naming the URL."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tidal.cli import main as cli_main
from tidal.envs.arithmetic import ArithmeticConfig, make_problems
from tidal.recipes.train_rm import train_reward_model
from tidal.rewards.remote import RemoteRewardError, RemoteRewardModel, endpoint
from tidal.rewards.rm import RewardModelPool, render
from tidal.rewards.server import RewardServer, ServeError, check_bind

# Batched and one-by-one forward passes differ only by float summation order (other matmul
# shapes; padding comes after the scored token and is masked): fp32 logits of magnitude ~1
# agree to ~1e-6, and JSON carries floats exactly (repr round-trips). 1e-4 is a wide margin
# that is still far below the gaps between the scores of different texts.
BATCH_TOL = 1e-4
TOKEN = "s3cret-token"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def rm_dir(one_thread, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm") / "model"
    train_reward_model(out, init=tiny_model_dir, pairs=64, steps=4, batch_size=8, heldout_pairs=16, seed=1,
                       log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def pool(rm_dir):
    # 50 ms of waiting: a generous window, so that 32 requests arriving together on a loaded
    # 2-core machine still meet in shared batches.
    with RewardModelPool(rm_dir, max_batch_size=16, max_wait_ms=50) as p:
        yield p


@pytest.fixture(scope="module")
def server(pool):
    with RewardServer(pool, "127.0.0.1", 0) as s:
        yield s


@pytest.fixture(scope="module")
def rows():
    return make_problems(ArithmeticConfig(), "train", 64, seed=7)


def prompt_of(pool, row) -> str:
    return pool.tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)


def completion_of(row, i: int) -> str:
    return f"<answer>{int(row['answer']) + i % 5 - 2}</answer>"


# -- concurrent load ------------------------------------------------------------------------------
def test_32_parallel_clients_get_their_own_scores_in_order_and_batches_form(pool, server, rows):
    requests = []  # client i sends 1-3 texts
    for i in range(32):
        n = 1 + i % 3
        requests.append([render(pool.tokenizer, completion_of(rows[(i + j) % 64], i + j), prompt_messages=rows[(i + j) % 64]["prompt"])
                         for j in range(n)])
    expected = [[pool.forward([t])[0] for t in texts] for texts in requests]  # one by one, straight through the model
    assert len({round(s, 3) for e in expected for s in e}) > 10  # distinct answers: a mix-up would show
    pool.reset_stats()
    start = threading.Barrier(32)

    def client(texts):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            start.wait(timeout=30)  # all 32 connections open before any request goes
            r = c.post("/score", json={"texts": texts})
            r.raise_for_status()
            return r.json()["scores"]

    with ThreadPoolExecutor(32) as ex:
        got = list(ex.map(client, requests, timeout=120))
    for i in range(32):
        assert got[i] == pytest.approx(expected[i], abs=BATCH_TOL), i
    health = httpx.get(server.url + "/health", timeout=10).json()
    st = health["stats"]
    assert st["requests"] == 32 and st["texts"] == sum(len(r) for r in requests)
    sizes = {int(k): v for k, v in st["batch_size_histogram"].items()}
    assert max(sizes) > 1 and max(sizes) <= 16, sizes
    assert st["forward_passes"] < 32, sizes


def test_score_with_prompts_and_completions_renders_messages(pool, server, rows):
    prompts = [prompt_of(pool, rows[0]), rows[1]["prompt"]]  # rendered text, or chat messages
    completions = [completion_of(rows[0], 0), completion_of(rows[1], 1)]
    r = httpx.post(server.url + "/score", json={"prompts": prompts, "completions": completions}, timeout=30)
    assert r.status_code == 200
    expected = [pool.forward([prompt_of(pool, rows[i]) + completions[i]])[0] for i in range(2)]
    assert r.json()["scores"] == pytest.approx(expected, abs=BATCH_TOL)


# -- OpenRLHF's protocol, both ways ---------------------------------------------------------------
def test_server_answers_a_request_shaped_as_openrlhfs_client_sends_it(pool, server, rows):
    # OpenRLHF (openrlhf/utils/agent.py, `_fetch_rewards_via_http`) POSTs JSON with exactly
    # these keys to `--remote_rm_url`, no auth header; a query is the whole sequence decoded
    # with special tokens kept, so it ends with the end-of-turn token.
    queries = [prompt_of(pool, r) + completion_of(r, i) + "<|im_end|>" for i, r in enumerate(rows[:3])]
    payload = {"query": queries, "prompts": [prompt_of(pool, r) for r in rows[:3]], "labels": [r["answer"] for r in rows[:3]]}
    r = httpx.post(server.url + "/get_reward", content=json.dumps(payload).encode(),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"rewards", "scores", "extra_logs"}
    expected = [pool.forward([q])[0] for q in queries]
    assert body["rewards"] == pytest.approx(expected, abs=BATCH_TOL)
    assert body["scores"] == body["rewards"]
    # OpenRLHF turns each extra_logs value into a tensor per sample: a number per query.
    assert all(isinstance(v, list) and len(v) == 3 for v in body["extra_logs"].values())
    # The oldest OpenRLHF clients send only `query`.
    assert httpx.post(server.url + "/get_reward", json={"query": queries}, timeout=30).json()["rewards"] == body["rewards"]


def test_tidal_client_against_tidal_server_batches_concurrent_calls(pool, server, rows):
    fn = RemoteRewardModel(server.url, timeout_s=30, max_batch_size=8, max_wait_ms=50, label_column="answer")
    assert fn.url == server.url + "/get_reward"
    pool.reset_stats()

    async def main():
        outs = await asyncio.gather(*(fn(completion_of(r, i), prompt=prompt_of(pool, r), answer=r["answer"])
                                      for i, r in enumerate(rows[:20])))
        await fn.aclose()
        return outs

    outs = asyncio.run(main())
    expected = [pool.forward([prompt_of(pool, r) + completion_of(r, i)])[0] for i, r in enumerate(rows[:20])]
    assert [o["rm"] for o in outs] == pytest.approx(expected, abs=BATCH_TOL)
    st = pool.stats()
    assert st["texts"] == 20 and st["requests"] <= 5, st  # 20 calls went as batched requests of up to 8


# -- security ------------------------------------------------------------------------------------
def test_a_public_address_without_a_token_is_refused_before_binding(rm_dir, pool, capsys):
    for host in ("0.0.0.0", "192.168.1.7", "::"):
        with pytest.raises(ServeError, match="not a loopback address, without a token"):
            check_bind(host, None)
        with pytest.raises(ServeError, match="without a token"):
            RewardServer(pool, host, 0, token=None)
    check_bind("127.0.0.1", None)
    check_bind("localhost", None)
    check_bind("0.0.0.0", "t")  # allowed with a token (not bound here: tests talk to 127.0.0.1 only)
    assert cli_main(["serve-rm", str(rm_dir), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "without a token" in capsys.readouterr().err
    assert cli_main(["serve-rm", str(rm_dir), "--host", "0.0.0.0", "--token-env", "TIDAL_TEST_UNSET_TOKEN_VAR"]) == 2
    assert "TIDAL_TEST_UNSET_TOKEN_VAR" in capsys.readouterr().err


def test_with_a_token_every_endpoint_needs_the_bearer_header(pool, rows):
    with RewardServer(pool, "127.0.0.1", 0, token=TOKEN) as s:
        for method, path, body in (("POST", "/score", {"texts": ["x"]}), ("POST", "/get_reward", {"query": ["x"]}),
                                   ("GET", "/health", None)):
            r = httpx.request(method, s.url + path, json=body, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized", path
            assert "no Authorization header" in r.json()["error"]["message"]
            bad = httpx.request(method, s.url + path, json=body, headers={"Authorization": "Bearer nope"}, timeout=10)
            assert bad.status_code == 401 and "does not match" in bad.json()["error"]["message"]
            ok = httpx.request(method, s.url + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
            assert ok.status_code == 200, (path, ok.text)
        text = prompt_of(pool, rows[0]) + completion_of(rows[0], 0)

        async def both():
            good = RemoteRewardModel(s.url, token=TOKEN, timeout_s=10)
            anon = RemoteRewardModel(s.url, timeout_s=10)
            try:
                ok = await good.score([text])
                with pytest.raises(RemoteRewardError, match=rf"{s.url}/get_reward: HTTP 401"):
                    await anon.score([text])
            finally:
                await good.aclose()
                await anon.aclose()
            return ok

        assert asyncio.run(both()) == pytest.approx([pool.forward([text])[0]], abs=BATCH_TOL)


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, code, words", [
    ("/score", {"texts": "not a list"}, 422, "texts"),
    ("/score", {}, 400, "needs `texts`"),
    ("/score", {"texts": ["a"], "prompts": ["b"], "completions": ["c"]}, 400, "not both"),
    ("/score", {"prompts": ["a", "b"], "completions": ["c"]}, 400, "2 prompts and 1 completions"),
    ("/get_reward", {"prompts": ["a"]}, 422, "query"),
    ("/get_reward", {"query": ["a", "b"], "labels": ["1"]}, 400, "2 queries and 1 labels"),
    ("/nowhere", {}, 404, "/nowhere"),
])
def test_errors_come_back_in_one_json_shape(server, path, body, code, words):
    r = httpx.post(server.url + path, json=body, timeout=10)
    assert r.status_code == code
    err = r.json()["error"]
    assert err["code"] == code and words in err["message"], err


def test_too_many_texts_is_413(pool):
    with RewardServer(pool, "127.0.0.1", 0, max_texts=4) as s:
        r = httpx.post(s.url + "/score", json={"texts": ["a"] * 5}, timeout=10)
        assert r.status_code == 413 and "at most 4" in r.json()["error"]["message"]


# -- the remote client's failures name the URL -------------------------------------------------------
def test_remote_client_times_out_on_a_server_that_never_answers():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # connections complete in the kernel's backlog; nothing ever answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    fn = RemoteRewardModel(url, timeout_s=0.5, max_wait_ms=1)
    t0 = time.monotonic()
    with pytest.raises(RemoteRewardError, match=rf"{url}/get_reward: no answer within 0.5 s"):
        asyncio.run(fn("<answer>1</answer>", prompt="p"))
    assert time.monotonic() - t0 < 3.0  # 0.5 s bound plus start-up slack of a loaded machine
    listener.close()


def test_remote_client_names_a_refused_connection():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    fn = RemoteRewardModel(f"http://127.0.0.1:{port}/get_reward", timeout_s=5, retries=1)
    with pytest.raises(RemoteRewardError, match=rf"127.0.0.1:{port}/get_reward: cannot connect after 2 attempts"):
        asyncio.run(fn.score(["x"]))


class _FixedAnswer(BaseHTTPRequestHandler):
    answer: bytes = b""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.answer)

    def log_message(self, *a):
        pass


@pytest.mark.parametrize("answer, words", [
    ({"rewards": [1.0]}, "1 rewards for 2 queries"),
    ({"scores": [1.0, 2.0]}, "no `rewards` list"),
    ({"rewards": [1.0, "high"]}, "reward 1 is 'high'"),
    ({"rewards": [1.0, None]}, "reward 1 is None"),
    ("not json", "not JSON"),
])
def test_remote_client_refuses_a_malformed_answer(answer, words):
    handler = type("H", (_FixedAnswer,), {"answer": (answer if isinstance(answer, str) else json.dumps(answer)).encode()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/get_reward"
    try:
        with pytest.raises(RemoteRewardError, match=url + ".*" + words):
            asyncio.run(RemoteRewardModel(url, timeout_s=5).score(["a", "b"]))
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_remote_arguments_are_checked():
    assert endpoint("http://127.0.0.1:5000") == "http://127.0.0.1:5000/get_reward"
    assert endpoint("http://127.0.0.1:5000/custom") == "http://127.0.0.1:5000/custom"
    with pytest.raises(ValueError, match="url must be"):
        RemoteRewardModel("127.0.0.1:5000")
    with pytest.raises(ValueError, match="TIDAL_TEST_UNSET_TOKEN_VAR"):
        RemoteRewardModel("http://127.0.0.1:5000", token_env="TIDAL_TEST_UNSET_TOKEN_VAR")
    with pytest.raises(ValueError, match="needs the rendered `prompt`"):
        asyncio.run(RemoteRewardModel("http://127.0.0.1:5000")("<answer>1</answer>"))

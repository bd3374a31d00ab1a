"""The vLLM engine's server mode: vLLM's OpenAI-compatible server as a supervised child process.

`VLLMServer` starts `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 at a free port,
waits for its health check, and kills its process group on close. Text requests go to
/v1/completions with token ids as the prompt; requests with images go to vLLM's token-in/
token-out endpoint /inference/v1/generate. New weights travel as a safetensors file that
`POST /collective_rpc` reloads (tidal/engines/vllm_engine.py's docstring has the details).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tidal.engines.served import http_call, server_workspace, stop_process_group, tail, wait_healthy
from tidal.engines.vllm_requests import Completion, VLLMEngineError, completion, vllm_prompt, vllm_sampling_fields
from tidal.types import GenerationRequest

if TYPE_CHECKING:
    from tidal.models.vision import Vision


class VLLMServer:
    """An OpenAI-compatible vLLM server child process, supervised."""

    def __init__(self, model_dir: Path, engine_args: dict[str, Any], env: dict[str, str], start_timeout_s: float,
                 request_timeout_s: float, log_dir: str | Path | None, multimodal: bool = False):
        self.multimodal = multimodal
        self.host = "127.0.0.1"
        self.port, self._tmp, self.weights_dir, self.log_path = server_workspace("vllm", log_dir)
        self.url = f"http://{self.host}:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", "policy", "--host", self.host, "--port", str(self.port),
               "--disable-uvicorn-access-log"]
        for k, v in engine_args.items():
            name = k.replace("_", "-")
            value = json.dumps(v) if isinstance(v, dict) else str(v)
            cmd += [f"--{name}"] if v is True else [f"--no-{name}"] if v is False else [f"--{name}", value]
        if multimodal:  # /inference/v1/generate: token ids and images in one request
            cmd.append("--enable-scale-out")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the server writes to it until close()
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.max_model_len = 0
        try:
            self._wait_healthy(start_timeout_s)
            models = json.loads(self._http("GET", "/v1/models", None, 30))
            self.max_model_len = int(models["data"][0]["max_model_len"])
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        return f"server pid {self.proc.pid} on {self.url}, log {self.log_path}"

    def dead(self) -> str:
        code = self.proc.poll()
        if code is None:
            return ""
        return f"The server exited with code {code}; last lines of {self.log_path}:\n{tail(self.log_path)}"

    def _wait_healthy(self, timeout_s: float) -> None:
        wait_healthy(self.proc, self.url + "/health", timeout_s, "vLLM server", self.log_path, VLLMEngineError,
                      "engine.vllm_start_timeout_s")

    def _http(self, method: str, path: str, body: dict | None, timeout_s: float) -> str:
        return http_call(self.url, method, path, body, timeout_s, VLLMEngineError, self.dead)

    async def generate(self, requests: list[GenerationRequest], timeout_s: float, vision: Vision | None = None,
                       banned: tuple[str, ...] = ()) -> list[Completion]:
        import aiohttp  # a dependency of vLLM

        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=256)) as session:
            return list(await asyncio.gather(*(
                self._complete_images(session, r, vision, banned) if r.images else self._complete(session, r, banned)
                for r in requests)))

    async def _post(self, session, path: str, body: dict, where: str) -> dict:
        import aiohttp

        try:
            async with session.post(self.url + path, json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise VLLMEngineError(f"{where}: {path} answered {resp.status}: {text[:500]}")
        except aiohttp.ClientError as e:
            raise VLLMEngineError(f"{where}: {path} failed: {type(e).__name__}: {e}. {self.dead()}") from e
        return json.loads(text)

    async def _complete(self, session, r: GenerationRequest, banned: tuple[str, ...] = ()) -> Completion:
        body = {"model": "policy", "prompt": list(r.prompt_ids), **vllm_sampling_fields(r.params, banned),
                "return_token_ids": True}
        choice = (await self._post(session, "/v1/completions", body, f"request {r.request_id}"))["choices"][0]
        return completion(r, choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["finish_reason"])

    async def _complete_images(self, session, r: GenerationRequest, vision: Vision,
                               banned: tuple[str, ...]) -> Completion:
        """A request with images: vLLM's token-in/token-out endpoint (`--enable-scale-out`) takes
        the collapsed token ids and the pictures as `content_parts` (PNG data URLs, their content
        ids as uuids) and expands the runs as the in-process engine does."""
        prompt = vllm_prompt(r, vision)
        parts = [{"type": "image_url", "url": "data:image/png;base64," + base64.b64encode(b.png).decode("ascii"),
                  "uuid": b.id} for b in r.images]
        body = {"model": "policy", "token_ids": prompt["prompt_token_ids"], "content_parts": parts,
                "sampling_params": vllm_sampling_fields(r.params, banned), "return_token_ids": True}
        answer = await self._post(session, "/inference/v1/generate", body, f"request {r.request_id}")
        choice = answer["choices"][0]
        lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or ()]
        return completion(r, choice["token_ids"], lps, choice["finish_reason"], vision, answer.get("prompt_token_ids"))

    def load_weights(self, named: dict[str, torch.Tensor], timeout_s: float, version: int | None = None) -> None:
        from safetensors.torch import save_file

        # One fixed directory: reload_weights points the server's model config at it.
        self.weights_dir.mkdir(exist_ok=True)
        tmp = self.weights_dir / "model.safetensors.tmp"
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in named.items()}, str(tmp))
        tmp.replace(self.weights_dir / "model.safetensors")
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(self.weights_dir)}, "timeout": timeout_s}
        self._http("POST", "/collective_rpc", rpc, timeout_s)
        self._http("POST", "/reset_prefix_cache", {}, 60)
        if self.multimodal:  # image embeddings of the old vision tower ("Encoder cache miss" otherwise)
            self._http("POST", "/reset_encoder_cache", {}, 60)

    def transfer(self, calls: list[tuple[str, dict]], timeout_s: float) -> list:
        """vLLM's weight-transfer routes (served in dev mode), in order; tidal's worker methods
        (`tidal_sync_report`, `tidal_serve_peer`) go through /collective_rpc. Returns the last
        of those's per-rank results (else [])."""
        out: list = []
        for method, body in calls:
            if method.startswith("tidal_"):  # tidal's worker extension methods (vllm_transfer.py)
                rpc = {"method": method, "timeout": timeout_s, **({"kwargs": body} if body else {})}
                out = json.loads(self._http("POST", "/collective_rpc", rpc, timeout_s + 30))["results"]
            else:
                self._http("POST", f"/{method}", body, timeout_s + 30)
        if calls[-1][0] == "tidal_sync_report":
            self._http("POST", "/reset_prefix_cache", {}, 60)
            if self.multimodal:
                self._http("POST", "/reset_encoder_cache", {}, 60)
        return out

    def close(self) -> None:
        stop_process_group(self.proc)
        self._log.close()
        shutil.rmtree(self.weights_dir, ignore_errors=True)
        if self.log_path.parent != self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

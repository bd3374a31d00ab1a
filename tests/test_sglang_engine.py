"""SGLang engine. The engine itself is UNTESTED: SGLang has no CPU kernels and no GPU has been
lent yet (docs/engines.md, SGLang).

- Fast, on CPU: the pure mapping between tidal's records and SGLang's `/generate` JSON
  (built from, and parsed as, the shapes sglang 0.5.23's source defines), and the factory's
  refusal. No mock server: nothing here claims that SGLang answers this way.
- `gpu`: the real checks, skipped unless CUDA and sglang are present. A GPU session runs
  `pytest -q tests/test_sglang_engine.py -m gpu` and reports them.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from engine_checks import (
    check_greedy_equals_reference,
    check_same_seed_same_sample,
    check_sampled_logprobs_match_trainer,
    check_stop_strings,
    check_update_follows_new_weights,
    held_out_prompt_ids,
    requests,
    run,
)

from tidal.config import ConfigError, EngineConfig, load_config
from tidal.engines.factory import build_engine, choose_engine_kind
from tidal.engines.sglang_engine import (
    SGLangEngineError,
    generate_payload,
    model_eos_ids,
    parse_output,
    sampling_fields,
    server_command,
)
from tidal.models import DEFAULT_MODEL_DIR, load_model, load_tokenizer
from tidal.types import GenerationRequest, SamplingParams

EOS = frozenset({2})


def req(rid="r0", stops=(2,), **kw):
    return GenerationRequest(rid, [5, 6, 7], SamplingParams(stop_token_ids=stops, **kw))


# -- request mapping ---------------------------------------------------------------------------
def test_sampling_params_map_to_sglang():
    # Keys and meanings: sglang/api/v1/api_types.py SamplingParams (unknown keys refused) and
    # sglang/srt/sampling/sampling_params.py (top_k -1 = whole vocabulary; temperature 0 = greedy).
    sampled = sampling_fields(SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=0, seed=9,
                                             stop_token_ids=(2, 7)), EOS)
    assert sampled == {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "sampling_seed": 9,
                       "ignore_eos": False, "stop_token_ids": [2, 7]}
    greedy = sampling_fields(SamplingParams(max_new_tokens=5, temperature=0.0, top_p=0.5, top_k=3, seed=9,
                                            stop_token_ids=(2,)), EOS)
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0 and greedy["top_k"] == -1
    assert sampling_fields(SamplingParams(top_k=4, temperature=1.0), EOS)["top_k"] == 4


def test_only_the_requests_stop_tokens_end_it():
    # SGLang stops at stop_token_ids and the model's EOS; ignore_eos turns off both
    # (schedule_batch.Req._check_token_based_finish). Without EOS among the request's stops,
    # tidal sends ignore_eos and cuts the answer itself.
    assert sampling_fields(SamplingParams(stop_token_ids=()), EOS)["ignore_eos"] is True
    other = sampling_fields(SamplingParams(stop_token_ids=(7,)), EOS)
    assert other["ignore_eos"] is True and "stop_token_ids" not in other


def test_generate_payload_is_one_batch():
    reqs = [req("a", temperature=0.0), req("b", seed=3)]
    body = generate_payload(reqs, ["0:a", "1:b"], EOS)
    assert body["rid"] == ["0:a", "1:b"]
    assert body["input_ids"] == [[5, 6, 7], [5, 6, 7]]
    assert body["return_logprob"] is True and body["stream"] is False
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [0, 3]
    json.dumps(body)  # plain JSON


def test_model_eos_ids_read_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert model_eos_ids(tmp_path) == {2, 9}


def test_model_eos_ids_add_the_tokenizers_stop_tokens(tmp_path):
    # With its tokenizer on, SGLang also stops at the tokenizer's EOS and at the turn-final
    # tokens its loader attaches (schedule_batch.Req._check_token_based_finish).
    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert model_eos_ids(tmp_path, tok) == {9, tok.eos_token_id}


def test_stop_strings_go_as_sglangs_stop():
    fields = sampling_fields(SamplingParams(stop_token_ids=(2,), stop=("</tool_call>", "\n\n")), EOS)
    assert fields["stop"] == ["</tool_call>", "\n\n"] and fields["stop_token_ids"] == [2]
    assert "stop" not in sampling_fields(SamplingParams(stop_token_ids=(2,)), EOS)


def test_server_command_binds_loopback_and_keeps_the_tokenizer(tmp_path):
    cmd = server_command(tmp_path, "127.0.0.1", 4321, dtype="float32", seed=1, max_batch_size=8,
                         mem_fraction_static=0.5)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    flags = " ".join(cmd[3:])
    for flag in ("--host 127.0.0.1", "--port 4321", "--dtype float32",
                 "--enable-deterministic-inference", "--weight-version 0", "--max-running-requests 8"):
        assert flag in flags
    # sglang refuses `stop` without its tokenizer (sampling_params.raise_if_tokenizer_required)
    assert "--skip-tokenizer-init" not in flags


# -- response parsing --------------------------------------------------------------------------
def sglang_output(rid, output_ids, logprobs, finish_reason, weight_version="0"):
    """One element of `/generate`'s answer for a finished non-streamed request, as sglang
    0.5.23 builds it: tokenizer_manager._handle_batch_output (BatchStrOutput: {"text",
    "output_ids", "meta_info"}; meta_info "id", "finish_reason" from
    schedule_batch FINISH_*.to_json(), "weight_version", "prompt_tokens", ...) and
    add_logprob_to_meta_info / detokenize_logprob_tokens ("output_token_logprobs" as
    (logprob, token_id, None) tuples, lists once JSON-encoded)."""
    return {
        "text": "(decoded by SGLang; unused)",
        "output_ids": list(output_ids),
        "meta_info": {
            "id": rid, "finish_reason": finish_reason, "prompt_tokens": 3, "weight_version": weight_version,
            "num_retractions": 0, "completion_tokens": len(output_ids), "cached_tokens": 0,
            "input_token_logprobs": [],
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output_ids)],
            "output_token_logprobs_length": len(output_ids),
        },
    }


def test_parse_stop_and_length():
    stop = sglang_output("0:r0", [9, 4, 2], [-0.1, -0.2, -0.3], {"type": "stop", "matched": 2})
    assert parse_output(req(), "0:r0", stop, 0) == ([9, 4, 2], [-0.1, -0.2, -0.3], "stop")
    length = sglang_output("1:r0", [9, 4], [-0.1, -0.2], {"type": "length", "length": 2})
    assert parse_output(req(max_new_tokens=2), "1:r0", length, 0) == ([9, 4], [-0.1, -0.2], "length")


def test_parse_a_stop_string_finish_keeps_the_completing_token():
    # FINISH_MATCHED_STR.to_json(); output_ids run through the token that completed it
    # (Req.output_ids_through_stop), only the text is trimmed.
    r = req(stops=(2,), stop=("wer>",))
    out = sglang_output("0:r0", [30, 271, 32], [-0.1, -0.2, -0.3], {"type": "stop", "matched": "wer>"})
    assert parse_output(r, "0:r0", out, 0) == ([30, 271, 32], [-0.1, -0.2, -0.3], "stop")
    other = sglang_output("0:r0", [30, 271], [-0.1, -0.2], {"type": "stop", "matched": "zzz"})
    with pytest.raises(SGLangEngineError, match="not among the request's stop tokens .* or stop strings"):
        parse_output(r, "0:r0", other, 0)


def test_parse_cuts_at_the_requests_stop_token_under_ignore_eos():
    out = sglang_output("0:r0", [9, 7, 4, 4], [-0.1, -0.2, -0.3, -0.4], {"type": "length", "length": 4})
    assert parse_output(req(stops=(7,)), "0:r0", out, 0) == ([9, 7], [-0.1, -0.2], "stop")


def test_parse_refuses_what_breaks_the_contract():
    ok = [9, 2], [-0.1, -0.2]
    with pytest.raises(SGLangEngineError, match="request r0: produced by SGLang weight version '3', expected 4"):
        parse_output(req(), "0:r0", sglang_output("0:r0", *ok, {"type": "stop", "matched": 2}, "3"), 4)
    with pytest.raises(SGLangEngineError, match="request r0: the answer is for SGLang request '1:x'"):
        parse_output(req(), "0:r0", sglang_output("1:x", *ok, {"type": "stop", "matched": 2}), 0)
    with pytest.raises(SGLangEngineError, match="request r0: SGLang aborted it: 'out of memory'"):
        parse_output(req(), "0:r0", sglang_output("0:r0", *ok, {"type": "abort", "message": "out of memory"}), 0)
    bad = sglang_output("0:r0", *ok, {"type": "stop", "matched": 2})
    bad["meta_info"]["output_token_logprobs"] = bad["meta_info"]["output_token_logprobs"][:1]
    with pytest.raises(SGLangEngineError, match="request r0: 2 tokens but log-probs for 1 tokens"):
        parse_output(req(), "0:r0", bad, 0)
    with pytest.raises(SGLangEngineError, match="not among the request's stop tokens"):
        parse_output(req(stops=(7,)), "0:r0", sglang_output("0:r0", [9, 3], [-0.1, -0.2],
                                                            {"type": "stop", "matched": 3}), 0)


# -- factory -----------------------------------------------------------------------------------
def test_sglang_without_a_gpu_is_a_config_error(tiny_model_dir):
    # refused when the config is validated, before anything loads ...
    with pytest.raises(ConfigError, match=r"engine.kind=sglang needs a CUDA GPU .* model.device resolves to 'cpu'"):
        load_config(overrides=["engine.kind=sglang", "model.device=cpu"])
    # ... and by the factory for a caller that builds an engine without a config
    with pytest.raises(ConfigError, match=r"engine.kind=sglang needs a CUDA GPU and `pip install sglang`: "
                                          r"SGLang has no CPU kernels"):
        build_engine("sglang", EngineConfig(kind="sglang"), tiny_model_dir, dtype="float32", device="cpu",
                     pad_token_id=0)


def test_auto_never_chooses_sglang(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in ("vllm", "sglang")
                        else real(name, *a))
    assert choose_engine_kind("auto", "cuda")[0] == "vllm"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang"
                        else None if name == "vllm" else real(name, *a))
    assert choose_engine_kind("auto", "cuda")[0] == "torch"


# -- on a GPU: the real checks (never run yet) -------------------------------------------------
GPU = torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None
gpu_test = pytest.mark.skipif(not GPU, reason="needs CUDA and `pip install sglang` (SGLang has no CPU kernels)")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def prompts(tok):
    return held_out_prompt_ids(tok)


@pytest.fixture(scope="module")
def engine():
    from tidal.engines.sglang_engine import SGLangEngine

    eng = SGLangEngine(DEFAULT_MODEL_DIR, dtype="float32", gpu_memory_utilization=0.3)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def torch_engine(tok):
    from tidal.engines.torch_engine import TorchEngine

    return TorchEngine(load_model(DEFAULT_MODEL_DIR, device="cuda"), tok.pad_token_id, tokenizer=tok)


# The same checks as the vLLM engine's (tests/engine_checks.py).
@pytest.mark.gpu
@gpu_test
def test_gpu_greedy_equals_torch_engine(engine, torch_engine, prompts, tok):
    check_greedy_equals_reference(engine, torch_engine, prompts, tok)


@pytest.mark.gpu
@gpu_test
def test_gpu_stop_strings_end_where_the_torch_engine_ends(engine, torch_engine, prompts, tok):
    """SGLang's `stop` keeps the completing token and stops where the torch engine stops."""
    check_stop_strings(engine, torch_engine, prompts, tok)


@pytest.mark.gpu
@gpu_test
def test_gpu_weight_update_follows_new_weights(engine, torch_engine, prompts, tok):
    check_update_follows_new_weights(engine, torch_engine, prompts, tok)


@pytest.mark.gpu
@gpu_test
def test_gpu_sampled_logprobs_match_trainer(engine, prompts, tok):
    """The temperature convention: SGLang's returned log-probs are log softmax(logits / T)."""
    check_sampled_logprobs_match_trainer(engine, prompts, tok)


@pytest.mark.gpu
@gpu_test
def test_gpu_same_seed_same_sample(engine, prompts, tok):
    check_same_seed_same_sample(engine, prompts, tok)


@pytest.mark.gpu
@gpu_test
def test_gpu_close_leaves_no_process(tok):
    from tidal.engines.served import group_members
    from tidal.engines.sglang_engine import SGLangEngine

    eng = SGLangEngine(DEFAULT_MODEL_DIR, dtype="float32", gpu_memory_utilization=0.2)
    pgid = eng.proc.pid
    eng.close()
    assert group_members(pgid) == []
    with pytest.raises(SGLangEngineError, match=r"SGLang engine \(server pid .*\) is closed"):
        run(eng.generate(requests([[5, 6, 7]], tok)))



def test_a_request_with_images_is_refused_not_stripped():
    """tidal's SGLang engine sends token ids only: an image prompt is refused by name rather than generated
    from its pad tokens without the pictures."""
    from types import SimpleNamespace

    from PIL import Image

    from tidal.engines.sglang_engine import SGLangEngine, SGLangEngineError
    from tidal.images import from_pil

    # No server: _validate reads the request, the length limit and the engine's name.
    engine = object.__new__(SGLangEngine)
    engine.max_model_len, engine.proc, engine.url, engine.log_path = 0, SimpleNamespace(pid=0), "-", "-"
    req = GenerationRequest("r7", [1, 2, 3], SamplingParams(max_new_tokens=4), images=(from_pil(Image.new("RGB", (8, 8))),))
    with pytest.raises(SGLangEngineError, match="request r7 has 1 image.*engine.kind=torch or vllm"):
        engine._validate(req)
    engine._validate(GenerationRequest("r8", [1, 2, 3], SamplingParams(max_new_tokens=4)))  # no image: accepted

"""What a vLLM engine sends for a tidal request and how it reads the answer, the same in both modes.

tidal's SamplingParams become vLLM's (`vllm_sampling_fields`: vLLM's EOS ignored, stop strings kept
in the output, the vision special tokens banned by their texts, `banned_words`); a request with
images goes with each image run collapsed to one pad and its pictures alongside (`vllm_prompt`),
and vLLM's expansion of that prompt must give back the request's own tokens (`check_expanded`).
tidal/engines/vllm_engine.py's docstring says why each of these is so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidal.types import GenerationRequest, SamplingParams

if TYPE_CHECKING:
    from tidal.models.vision import Vision

Completion = tuple[list[int], list[float], str]  # token ids, their log-probs, finish reason


class VLLMEngineError(RuntimeError):
    """A vLLM engine call failed; the message names the engine, the call and the request."""


def vllm_sampling_fields(p: SamplingParams, banned: tuple[str, ...] = ()) -> dict[str, Any]:
    """tidal SamplingParams → vLLM's. Only the request's own stop tokens end it (`ignore_eos`:
    the model's EOS is in stop_token_ids when the caller wants it, as with the torch engine).
    Stop strings: vLLM matches them in the text of the generated tokens with special tokens
    skipped (as tidal does) and keeps the token that completes one (`include_stop_str_in_output`;
    without it vLLM still returns that token but cuts the text). `banned`: the texts of tokens
    that are never sampled (`bad_words`; each must encode to its one token: `banned_words`)."""
    greedy = p.temperature <= 0
    fields = {
        "max_tokens": p.max_new_tokens,
        "temperature": 0.0 if greedy else p.temperature,
        "top_p": 1.0 if greedy else p.top_p,
        "top_k": 0 if greedy else p.top_k,
        "seed": p.seed,
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": True,
        "logprobs": 0,  # the sampled token's own log-prob only
    }
    if banned:
        fields["bad_words"] = list(banned)
    if p.stop:
        fields["stop"] = list(p.stop)
        fields["include_stop_str_in_output"] = True
        fields["skip_special_tokens"] = True  # the text they are matched in (tidal's convention)
    return fields


def banned_words(tokenizer, token_ids: tuple[int, ...]) -> tuple[str, ...]:
    """The texts vLLM's `bad_words` bans `token_ids` by. vLLM encodes each text (without special
    tokens added) and sets the logit of its last token to -inf at every step whose previous
    tokens match the rest, so a text that encodes to exactly its one token bans that token
    everywhere. (vLLM also bans the text with a space before it, which changes nothing here.)
    Raises ValueError for a token whose text does not encode back to it alone."""
    words = []
    for i in token_ids:
        text = tokenizer.convert_ids_to_tokens(int(i))
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids != [int(i)]:
            raise ValueError(f"the banned token {i} ({text!r}) encodes to {ids}, not to itself alone; vLLM's "
                             "bad_words could not ban it (is it registered as a special token in the tokenizer?)")
        words.append(text)
    return tuple(words)


def check_expanded(r: GenerationRequest, got: list[int] | None, vision: Vision) -> None:
    """vLLM's expansion of a request's collapsed prompt must be the request's prompt: the same
    image runs, token for token (its processor and tidal's disagree otherwise, e.g. on resizing)."""
    if got is None:
        raise VLLMEngineError(f"request {r.request_id}: vLLM's answer has no prompt token ids to check its image "
                              "expansion against")
    if list(got) == list(r.prompt_ids):
        return
    raise VLLMEngineError(f"request {r.request_id}: vLLM expanded the prompt to {len(got)} tokens with image runs of "
                          f"{[e - s for s, e in vision.runs(list(got))]} tokens; tidal's prompt has "
                          f"{len(r.prompt_ids)} tokens with runs of {[e - s for s, e in vision.runs(r.prompt_ids)]} "
                          "(its image processor and vLLM's disagree: both are built from the model's "
                          "preprocessor_config.json)")


def checked_finish_reason(reason: str | None, where: str) -> str:
    """vLLM's finish reason of a completion, which must be `stop` or `length` (else an error naming `where`)."""
    if reason in ("stop", "length"):
        return reason
    raise VLLMEngineError(f"{where}: vLLM finished it with reason {reason!r} (expected 'stop' or 'length')")


def completion(r: GenerationRequest, toks, lps, reason: str | None, vision: Vision | None = None,
               prompt_ids: list[int] | None = None) -> Completion:
    """One request's answer as tidal takes it, from either mode: for a request with images vLLM's
    expansion of its prompt (`prompt_ids`) must be the request's own (check_expanded), one
    log-prob per token, finish reason `stop` or `length`; else VLLMEngineError naming the request."""
    where = f"request {r.request_id}"
    if r.images:
        check_expanded(r, prompt_ids, vision)
    toks = list(toks)
    if lps is None or len(lps) != len(toks):
        raise VLLMEngineError(f"{where}: {len(toks)} tokens but {len(lps or ())} log-probs in vLLM's answer")
    return toks, [float(x) for x in lps], checked_finish_reason(reason, where)


def vllm_prompt(r: GenerationRequest, vision: Vision | None) -> dict[str, Any]:
    """What vLLM is given for a request: its token ids, and for a request with images each image
    run collapsed to one pad (vLLM expands it again itself), the pictures and their content ids
    (`multi_modal_uuids`: vLLM keys its caches by them instead of hashing the pixels)."""
    if not r.images:
        return {"prompt_token_ids": list(r.prompt_ids)}
    return {"prompt_token_ids": vision.collapse(list(r.prompt_ids)),
            "multi_modal_data": {"image": [b.pil() for b in r.images]},
            "multi_modal_uuids": {"image": [b.id for b in r.images]}}

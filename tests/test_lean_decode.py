"""The torch engine's lean decode step and preallocated KV cache (tidal/engines/lean_decode.py):
the same tokens as decoding through the model's own forward, for every architecture it takes,
and a refusal (then the model's forward) for the others."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.engine_checks import held_out_prompt_ids, perturbed_weights, requests, run
from tidal.engines.lean_decode import KVCache, LeanDecoder, _rope, _signed_sin
from tidal.engines.torch_engine import TorchEngine
from tidal.models import DEFAULT_MODEL_DIR, load_model, load_tokenizer

# fp32, two implementations of one decode step: attention as two matmuls with a float32 softmax
# (lean) vs torch's fused CPU attention kernel (the model's sdpa). Measured on this machine: engine
# log-probs equal on the trained weights and within 2.1e-5 on perturbed ones (48 prompts x 40
# tokens); logits of the random tiny models within 2.3e-7. 5e-4 leaves ~25x for other CPUs'
# summation orders; a wrong formula (a missing bias, norm or rotary half, a stale cache column)
# moves log-probs and logits by 0.1 and more.
TOL = 5e-4


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL_DIR)


def _engines(max_batch: int):
    model_dir = DEFAULT_MODEL_DIR
    pad = load_tokenizer(model_dir).pad_token_id
    return (TorchEngine(load_model(model_dir), pad, max_batch_size=max_batch),
            TorchEngine(load_model(model_dir), pad, max_batch_size=max_batch, lean_decode=False))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_tokens_equal_the_models_own_forward(tok, temperature):
    """48 held-out prompts through a batch of 16 (rows finish, leave and are replaced by joining
    ones: select, merge and cache growth all run), on the trained weights and on perturbed ones."""
    lean, ref = _engines(max_batch=16)
    prompts = held_out_prompt_ids(tok, 48)
    for version, weights in ((0, None), (3, perturbed_weights(seed=5))):
        if weights is not None:
            lean.update_weights(version, weights)
            ref.update_weights(version, weights)
        reqs = requests(prompts, tok, temperature=temperature, seed=40, max_new_tokens=40)
        ours, theirs = run(lean.generate(reqs)), run(ref.generate(reqs))
        assert lean.lean is True and ref.lean is False
        same = sum(a.token_ids == b.token_ids for a, b in zip(ours, theirs))
        assert same == len(reqs), f"v{version} T={temperature}: tokens differ on {len(reqs) - same} of {len(reqs)} prompts"
        assert [a.finish_reason for a in ours] == [b.finish_reason for b in theirs]
        worst = max(abs(x - y) for a, b in zip(ours, theirs) for x, y in zip(a.logprobs, b.logprobs, strict=True))
        assert worst < TOL, f"v{version} T={temperature}: log-probs differ by {worst:.3g}"
        assert all(r.version == version for r in ours)
    assert lean.decode_steps == ref.decode_steps  # same batches, same joins


def _tiny(kind: str, **extra):
    import transformers

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, **extra)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**common)).eval()
    with torch.no_grad():  # random biases and norms, so that a formula that skips one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _decode_both(model, steps: int, reserve: int):
    """Lean steps over a KVCache that must grow (`reserve` < steps) against the model's own
    forward over a DynamicCache, from one left-padded prefill; max |Δ logits| over all steps."""
    g = torch.Generator().manual_seed(1)
    B, S, V = 5, 7, model.config.vocab_size
    ids = torch.randint(0, V, (B, S), generator=g)
    attn = torch.ones(B, S, dtype=torch.long)
    for i in range(B):
        attn[i, :i] = 0
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        dc_lean, dc_ref = DynamicCache(), DynamicCache()
        for dc in (dc_lean, dc_ref):
            model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=dc, use_cache=True)
        kv = KVCache.from_dynamic(dc_lean, attn, reserve=reserve)
        lean, mask, nxt, worst = LeanDecoder(model), attn, attn.sum(-1), 0.0
        for _ in range(steps):
            t = torch.randint(0, V, (B,), generator=g)
            mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
            ref = model(input_ids=t[:, None], attention_mask=mask, position_ids=nxt[:, None], cache=dc_ref,
                        use_cache=True).logits[:, -1]
            worst = max(worst, float((lean(t, nxt, kv) - ref).abs().max()))
            nxt = nxt + 1
    return worst


@pytest.mark.parametrize("kind,extra", [
    ("qwen2", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    ("qwen3", {}),
    ("mistral", {"sliding_window": None}),
])
def test_lean_step_matches_the_model_for_each_architecture(kind, extra):
    model = _tiny(kind, **extra)
    assert LeanDecoder.unsupported(model) is None
    built = LeanDecoder.build(model)
    assert built is not None and built.prefills  # the probe agrees, on the decode step and the prefill
    worst = _decode_both(model, steps=9, reserve=2)  # the cache moves to a larger buffer twice
    assert worst < TOL, f"{kind} {extra}: lean logits differ by {worst:.3g}"
    worst = _prefill_both(model)
    assert worst < TOL, f"{kind} {extra}: the lean prefill differs by {worst:.3g}"
    worst = _prefill_both(model, shared=3)
    assert worst < TOL, f"{kind} {extra}: the lean prefill of a shared prefix differs by {worst:.3g}"


def _prefill_both(model, shared: int = 0):
    """The lean prefill of left-padded prompts (one row all real, one nearly all padding) against
    the model's forward: max |Δ| over the next-token logits and the real positions' keys and
    values of every layer (padding's are never read). `shared`: the rows' first `shared` real
    tokens are made the same, and `prefill_shared` computes them once."""
    g = torch.Generator().manual_seed(2)
    B, S, V = 5, 9, model.config.vocab_size
    ids = torch.randint(0, V, (B, S), generator=g)
    attn = torch.ones(B, S, dtype=torch.long)
    for i in range(B):
        pad = i if shared else 2 * i  # shared: every row has real tokens past the shared ones
        attn[i, :pad] = 0
        ids[i, pad:pad + shared] = ids[0, :shared]
    with torch.inference_mode():
        dc = DynamicCache()
        ref = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0), cache=dc,
                    use_cache=True).logits[:, -1]
        lean = LeanDecoder(model)
        layers, logits = lean.prefill_shared(ids, attn, shared) if shared else lean.prefill(ids, attn)
    real = attn.bool()[:, None, :, None]
    worst = float((logits - ref).abs().max())
    for (k, v), la in zip(layers, dc.layers, strict=True):
        worst = max(worst, float(((k - la.keys).abs() * real).max()), float(((v - la.values).abs() * real).max()))
    return worst


def test_a_prefill_computes_the_prompts_common_first_tokens_once(tok, monkeypatch):
    """Chat prompts of different lengths share their opening (the role header): the engine
    feeds it once per prefill, and every request samples what it samples when each prompt is
    fed whole (tokens equal, log-probs to float rounding)."""
    import tidal.engines.lean_decode as ld

    prompts = held_out_prompt_ids(tok, 12)
    prompts = [p + p[-4:] * (i % 3) for i, p in enumerate(prompts)]  # lengths differ: left padding
    c = next(i for i in range(len(prompts[0])) if len({p[i] for p in prompts}) > 1)  # the common opening
    assert c >= 2 and len({len(p) for p in prompts}) == 3
    out, fed = {}, {}
    for name, least in (("shared", 1), ("whole", 10 ** 9)):
        monkeypatch.setattr(ld, "MIN_SHARED_PREFIX_TOKENS", least)
        engine = TorchEngine(load_model(DEFAULT_MODEL_DIR), tok.pad_token_id, max_batch_size=16)
        out[name] = run(engine.generate(requests(prompts, tok, max_new_tokens=12, temperature=1.0)))
        fed[name] = engine.prefill_tokens
    assert fed["whole"] == sum(map(len, prompts)) and fed["shared"] == fed["whole"] - (len(prompts) - 1) * c
    for a, b in zip(out["shared"], out["whole"], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=TOL, rtol=0)


def test_a_model_the_lean_step_does_not_compute_falls_back_to_its_own_forward(tok):
    # A Qwen2 whose attention does something the lean formulas do not: the probe catches it.
    model = load_model(DEFAULT_MODEL_DIR)
    att = model.model.layers[0].self_attn
    plain = att.forward

    def scaled(*a, **k):
        out, weights = plain(*a, **k)
        return out * 1.5, weights

    att.forward = scaled
    assert LeanDecoder.unsupported(model) is None
    assert LeanDecoder.build(model) is None
    engine = TorchEngine(model, tok.pad_token_id, max_batch_size=8)
    reqs = requests(held_out_prompt_ids(tok, 4), tok, max_new_tokens=8)
    out = run(engine.generate(reqs))
    assert engine.lean is False and all(len(r.token_ids) > 0 for r in out)
    # An architecture outside the family is declined by name, before any probe.
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2))
    assert "gpt2" in LeanDecoder.unsupported(gpt2)
    assert "sliding" in LeanDecoder.unsupported(_tiny("mistral", sliding_window=4))


def test_rope_is_transformers_rotary_embedding_bit_for_bit():
    # The lean step's rotary embedding (a flip against a sine with its first half negated) claims
    # the same bits as transformers' q * cos + rotate_half(q) * sin, not merely close ones.
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 7, 32, generator=g) * 3, torch.randn(5, 2, 7, 32, generator=g) * 3
    angles = torch.rand(5, 7, 32, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    signed = _signed_sin(sin)[:, None]
    assert torch.equal(_rope(q, cos[:, None], signed), want_q)
    assert torch.equal(_rope(k, cos[:, None], signed), want_k)


def test_kv_cache_select_and_merge_keep_each_rows_positions():
    """Rows that leave are replaced by the last rows (order returned); joining rows land
    right-aligned at the window's end; padding is masked and zero."""
    L, K, D = 2, 1, 3

    def cache(lengths: list[int], fill: float, reserve: int) -> KVCache:
        T = max(lengths)
        dc = DynamicCache()
        attn = torch.zeros(len(lengths), T, dtype=torch.long)
        for i, n in enumerate(lengths):
            attn[i, T - n:] = 1
        for layer in range(L):
            k = torch.arange(len(lengths) * T, dtype=torch.float32).view(len(lengths), 1, T, 1).expand(-1, K, -1, D) + fill
            dc.update(k.clone(), -k.clone(), layer)
        return KVCache.from_dynamic(dc, attn, reserve)

    a = cache([3, 5, 2, 4], fill=0.0, reserve=4)
    row3 = a.row(3, 4)[0][0].clone()
    order = a.select([1, 3])  # rows 0 and 2 leave: row 3 moves into hole 0
    assert order == [3, 1] and len(a) == 2
    assert a.length == 5 and torch.equal(a.row(0, 4)[0][0], row3)
    b = cache([6, 2], fill=100.0, reserve=1)  # longer than a's window: a moves and shifts right
    m = a.merge(b)
    assert len(m) == 4 and m.length == 6
    assert m.attn.sum(-1).tolist() == [4, 5, 6, 2]
    keys, values = m.window(0)
    assert torch.equal(keys[2, :, :, :], b.window(0)[0][0])
    # The column the window grew by on the left is padding the live rows never had: zeroed
    # (attention weighs it by 0, and 0 * NaN of fresh memory would be NaN); all else is finite.
    assert (keys[:2, :, 0] == 0).all() and (values[:2, :, 0] == 0).all()
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    col = m.reserve_column()
    assert m.attn[:, -1].all() and col == m.hi
    m.k[:, :len(m), :, col], m.v[:, :len(m), :, col] = 7.0, -7.0  # what a decode step writes there
    m.hi += 1
    # More rows than the buffers hold: both move to larger ones, every row's window intact.
    before = [m.row(i, int(m.attn[i].sum()))[0][0].clone() for i in range(len(m))]
    c = cache([3], fill=200.0, reserve=2)
    m = m.merge(c)
    assert len(m) == 5 and m.k.shape[1] > 4
    assert all(torch.equal(m.row(i, b.shape[2])[0][0], b) for i, b in enumerate(before))
    assert torch.equal(m.row(4, 3)[0][0][0], c.window(0)[0][0])


def test_forward_hooks_see_every_decode_step(tok):
    """A hook registered on the model (debugging, timing) must fire on decode steps too: the
    lean step gives way to the model's forward while one is registered."""
    engine = TorchEngine(load_model(DEFAULT_MODEL_DIR), tok.pad_token_id, max_batch_size=8)
    reqs = requests(held_out_prompt_ids(tok, 2), tok, max_new_tokens=6)
    run(engine.generate(reqs))
    assert engine.lean is True
    calls = []
    handle = engine.model.model.layers[1].mlp.register_forward_hook(lambda *_: calls.append(1))
    steps0 = engine.decode_steps
    out = run(engine.generate(reqs))
    handle.remove()
    # One prefill plus one forward per decode step but the last (its token is not fed).
    assert len(calls) == 1 + (engine.decode_steps - steps0 - 1)
    assert [r.token_ids for r in out] == [r.token_ids for r in run(engine.generate(reqs))]


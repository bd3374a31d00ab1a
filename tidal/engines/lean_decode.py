"""The torch engine's decode step: a preallocated KV cache and, for the Llama family, a lean
forward pass.

`KVCache` holds the keys and values of the running batch in two preallocated tensors
[layers, rows, kv heads, capacity, head dim]. Every row's positions lie in the columns
[lo, hi) (left-padded: `mask` marks the real ones); a decode step writes column `hi`, so
the cache never grows by concatenation (what a `DynamicCache` does on every step). When
the capacity is used up the window moves to a buffer twice its length. Rows that leave
make holes that the last rows move into, so a step where a few rows finish copies those
few rows, not the batch; rows that join are copied in beside the others.

`LeanDecoder` is one decode step (one new token per row) of a Llama-family model (Llama,
Qwen2, Qwen3, Mistral without a sliding window, and the language model of Qwen2-VL and
Qwen2.5-VL, whose layers are Qwen2's) written as plain tensor ops on the model's own parameters: no module calls, no mask building, attention as two batched matmuls over
the cache window (for a single query token they beat the fused CPU attention kernel,
whose setup dominates at this size). The formulas are those of the transformers modules,
in the same order and dtypes, so the logits agree with the model's own forward to float
rounding; `LeanDecoder.build` checks that on a probe batch and declines (the engine then
runs the model's own forward over the same cache) when the model is of another kind or the
probe disagrees. A vision-language model's decode token has its three mRoPE components
equal (tidal/models/vision.py), and the model's rotary module, given 1-D positions, expands
them to three equal ones: the step is the same 1-D RoPE step, at the row's own position (the
engine's, which for a prompt with images is not its token count). It reads the parameters at every step, so weight updates (`copy_`) and
device moves are seen; a step while forward hooks are registered on the model (a debugging
or timing hook) runs the model's forward, so the hooks see every step.

`LeanDecoder.prefill` is the same formulas for a join's prompts at once (causal, left-padded, no
cached prefix, text only): the engine uses it when the probe also finds it equal to the model's
forward on the probe's prompts (`prefills`), and otherwise prefills through the model. It saves
transformers' mask building and cache bookkeeping: 4.4 ms against 5.0 ms for 10 prompts of 18
tokens on the default model, where most of a prefill is its matmuls (a one-off timing).

Legend: L layers, B rows, H query heads, K key/value heads, G = H / K, C capacity, D head dim.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from transformers import DynamicCache

log = logging.getLogger(__name__)

# Model types whose decoder layer is: x + attn(rmsnorm(x)); x + mlp(rmsnorm(x)), with rotary
# q/k (Qwen3: per-head RMSNorm on q and k first), grouped-query attention and a gated MLP.
LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")
# Vision-language models whose language model (model.model.language_model) is such a decoder.
VISION_LANGUAGE = ("qwen2_vl", "qwen2_5_vl")

# Largest |lean - model| logit difference on the probe, relative to the logits' scale, that
# counts as float rounding. Measured: 0 to 1.5e-5 absolute on logits of scale ~10 in float32
# (the two attention implementations sum in different orders); bfloat16 has 8 mantissa bits,
# so its rounding alone is ~4e-3 relative. A wrong formula (a missing norm, bias or rotary
# half) is off by O(1).
_PROBE_TOL = {torch.float32: 1e-4, torch.float64: 1e-4}
_PROBE_TOL_LOW_PRECISION = 5e-2
# A prefill computes its prompts' common first tokens once when that saves at least this many
# token positions (the shared part costs a pass of its own: a few dozen small ops per layer).
MIN_SHARED_PREFIX_TOKENS = 16


class KVCache:
    """Keys and values of the running batch, preallocated (see the module docstring).

    `k` and `v` are [L, rows capacity, K, C, D]; the first `n` rows are live and the
    columns [lo, hi) hold every live row's positions, each row's real ones (`mask`) a
    contiguous run that ends at `hi`. Masked columns hold zeros (or finite leftovers),
    never uninitialized memory: attention weighs them by 0, and 0 * NaN is NaN."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, n: int, lo: int, hi: int):
        self.k, self.v = k, v
        self.mask = mask  # [rows capacity, C] bool: the real positions
        self.n, self.lo, self.hi = n, lo, hi

    @classmethod
    def from_dynamic(cls, cache: DynamicCache, attn: torch.Tensor, reserve: int,
                     rows: torch.Tensor | None = None) -> KVCache:
        """A prefill's cache ([B, K, T, D] per layer, `attn` [B, T]) with room for `reserve`
        more tokens per row. `rows` [B'] (optional): row i of the result is the prefill's row
        rows[i] (prompts computed once for several requests); `attn` is then [B', T]."""
        keys = [la.keys for la in cache.layers]
        L, (B, K, T, D) = len(keys), keys[0].shape
        if rows is not None:
            B = len(rows)
        C = T + max(1, reserve)
        # Columns past the window are written before they are read: no need to zero them.
        k = keys[0].new_empty((L, B, K, C, D))
        v = keys[0].new_empty((L, B, K, C, D))
        for i, la in enumerate(cache.layers):
            k[i, :, :, :T] = la.keys if rows is None else la.keys[rows]
            v[i, :, :, :T] = la.values if rows is None else la.values[rows]
        mask = torch.zeros((B, C), dtype=torch.bool, device=attn.device)
        mask[:, :T] = attn.bool()
        return cls(k, v, mask, B, 0, T)

    def __len__(self) -> int:
        return self.n

    @property
    def length(self) -> int:
        return self.hi - self.lo

    @property
    def attn(self) -> torch.Tensor:
        """[n, hi - lo] bool: which positions of the window are real."""
        return self.mask[:self.n, self.lo:self.hi]

    def window(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [n, K, T, D] of the live rows, columns lo..end (default hi)."""
        cols = slice(self.lo, self.hi if end is None else end)
        return self.k[layer, :self.n, :, cols], self.v[layer, :self.n, :, cols]

    def row(self, i: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row i's last n positions, per layer ([1, K, n, D] each)."""
        cols = slice(self.hi - n, self.hi)
        return ([self.k[layer, i:i + 1, :, cols].clone() for layer in range(self.k.shape[0])],
                [self.v[layer, i:i + 1, :, cols].clone() for layer in range(self.v.shape[0])])

    def _reallocate(self, rows: int, columns: int) -> None:
        """Move the live window to new buffers of `rows` x `columns` (window at column 0)."""
        n, T = self.n, self.length
        k = self.k.new_empty((self.k.shape[0], rows, self.k.shape[2], columns, self.k.shape[4]))
        v = torch.empty_like(k)
        k[:, :n, :, :T] = self.k[:, :n, :, self.lo:self.hi]
        v[:, :n, :, :T] = self.v[:, :n, :, self.lo:self.hi]
        mask = self.mask.new_zeros((rows, columns))
        mask[:n, :T] = self.attn
        self.k, self.v, self.mask, self.lo, self.hi = k, v, mask, 0, T

    def reserve_column(self) -> int:
        """Make column `hi` free (moving the window to a buffer twice as long when full), mark
        it real for every live row and return it; the caller writes its keys and values."""
        if self.hi == self.k.shape[3]:
            self._reallocate(self.k.shape[1], max(2 * self.length, self.length + 16))
        self.mask[:self.n, self.hi] = True
        return self.hi

    def select(self, keep: list[int]) -> list[int]:
        """Keep the live rows `keep` (ascending). Kept rows past the new row count move into
        the holes the others left (a few finished rows cost a few row copies, not the batch);
        returns the new order (old row index at each new position), for the caller's own
        per-row state. Left padding that no remaining row needs is dropped from the window,
        so a batch that never empties does not carry the padding of rows long gone."""
        n = len(keep)
        kept = set(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in keep if i >= n]
        order = list(range(n))
        if holes:
            to = torch.tensor(holes, device=self.k.device)
            frm = torch.tensor(movers, device=self.k.device)
            # Only the window moves: columns outside it are never read (merge zeroes those the
            # window grows into), and the buffers' capacity can be several windows long.
            window = slice(self.lo, self.hi)
            self.k[:, to, :, window] = self.k[:, frm, :, window]
            self.v[:, to, :, window] = self.v[:, frm, :, window]
            self.mask[to] = self.mask[frm]
            for h, m in zip(holes, movers):
                order[h] = m
        self.n = n
        self.lo = self.hi - int(self.attn.sum(-1).max())
        return order

    def merge(self, other: KVCache) -> KVCache:
        """Append `other`'s rows, right-aligned at this window's end (in place when the buffers
        have the room; otherwise both move to new buffers). Returns the merged cache."""
        n, m, T = self.n, other.n, other.length
        if n + m > self.k.shape[1] or T > self.hi:
            rows = n + m if n + m <= self.k.shape[1] else max(n + m, self.k.shape[1] * 3 // 2)
            room = max(self.k.shape[3] - self.hi, other.k.shape[3] - other.hi, 1)
            self._reallocate(rows, max(self.length, T) + room)
            if T > self.hi:  # the window must reach T columns back from its end: shift right
                shift = T - self.hi
                self.k[:, :n, :, shift:T] = self.k[:, :n, :, :self.hi].clone()
                self.v[:, :n, :, shift:T] = self.v[:, :n, :, :self.hi].clone()
                self.mask[:n, shift:T] = self.mask[:n, :self.hi].clone()
                self.mask[:n, :shift] = False
                self.lo, self.hi = shift, T
        lo = min(self.lo, self.hi - T)
        new, start = slice(n, n + m), self.hi - T
        if lo < self.lo:  # the window grows left: the live rows' new columns are padding
            self.k[:, :n, :, lo:self.lo] = 0
            self.v[:, :n, :, lo:self.lo] = 0
        self.k[:, new, :, lo:start] = 0
        self.v[:, new, :, lo:start] = 0
        self.k[:, new, :, start:self.hi] = other.k[:, :m, :, other.lo:other.hi]
        self.v[:, new, :, start:self.hi] = other.v[:, :m, :, other.lo:other.hi]
        self.mask[new] = False
        self.mask[new, start:self.hi] = other.attn
        self.n, self.lo = n + m, lo
        return self


def model_decode(model, tok_B: torch.Tensor, pos_B: torch.Tensor, kv: KVCache) -> torch.Tensor:
    """One decode step through the model's own forward (any architecture): the window goes
    in as a DynamicCache, the new position's keys and values come back into column `hi`."""
    col = kv.reserve_column()  # first: it may move the window to a larger buffer
    cache = DynamicCache()
    for layer in range(kv.k.shape[0]):
        cache.update(*kv.window(layer, col), layer)
    logits = model(input_ids=tok_B[:, None], attention_mask=kv.mask[:kv.n, kv.lo:col + 1].long(),
                   position_ids=pos_B[:, None], cache=cache, use_cache=True).logits[:, -1]
    for layer, la in enumerate(cache.layers):
        kv.k[layer, :kv.n, :, col] = la.keys[:, :, -1]
        kv.v[layer, :kv.n, :, col] = la.values[:, :, -1]
    kv.hi = col + 1
    return logits


def common_prefix(prompts: list[list[int]], limit: int) -> int:
    """How many first tokens all `prompts` share, at most `limit`. (`os.path.commonprefix` compares
    the lexicographically smallest and largest sequences, whose common prefix is everyone's; it
    works on any sequences, here lists of token ids.)"""
    return min(len(os.path.commonprefix(prompts)), limit)


def _text_config(model):
    """The language model's config (a vision-language model nests it: `text_config`)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _text_model(model):
    """The decoder that holds embed_tokens/layers/norm/rotary_emb: `model.model`, or for a
    vision-language model `model.model.language_model`."""
    inner = getattr(model, "model", None)
    if getattr(model.config, "model_type", None) in VISION_LANGUAGE:
        inner = getattr(inner, "language_model", None)
    return inner


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm/Qwen2RMSNorm: normalized in float32, scaled in x's dtype."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _mlp_residual(layer, x: torch.Tensor) -> torch.Tensor:
    """x plus the layer's gated MLP of its post-attention RMSNorm (transformers' order and dtypes)."""
    ln, mlp = layer.post_attention_layernorm, layer.mlp
    h = _rms_norm(x, ln.weight, ln.variance_epsilon)
    gated = mlp.act_fn(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)) * F.linear(
        h, mlp.up_proj.weight, mlp.up_proj.bias)
    return x + F.linear(gated, mlp.down_proj.weight, mlp.down_proj.bias)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: `_rope` multiplies it into x's swapped halves."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin`, bit for bit: rotate_half(x) is x's halves
    swapped with the first negated, and -a * b == a * -b exactly. One flip of a view instead of
    rotate_half's two slices, negation and concatenation."""
    D = x.shape[-1]
    swapped = x.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin


class LeanDecoder:
    """One decode step of a Llama-family model over a `KVCache` (see the module docstring)."""

    def __init__(self, model):
        cfg = _text_config(model)
        self.model = model
        self.inner = _text_model(model)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.qk_norm = cfg.model_type == "qwen3"
        self._modules = list(model.modules())
        self.prefills = False  # whether the engine may prefill with `prefill` (set by the probe)

    def hooked(self) -> bool:
        """Whether forward hooks are registered on the model or any of its modules (or
        globally): the lean step would skip them, so such a step runs the model's forward."""
        from torch.nn.modules import module as nn_module

        return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks) or any(
            m._forward_hooks or m._forward_pre_hooks for m in self._modules)

    @classmethod
    def unsupported(cls, model) -> str | None:
        """Why the lean step cannot run this model (None: it can)."""
        kind = getattr(getattr(model, "config", None), "model_type", None)
        if kind not in LLAMA_FAMILY + VISION_LANGUAGE:
            return f"model type {kind!r} is not one of {LLAMA_FAMILY + VISION_LANGUAGE}"
        cfg = _text_config(model)
        inner = _text_model(model)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
                or not hasattr(model, "lm_head"):
            where = "model.language_model" if kind in VISION_LANGUAGE else "model"
            return (f"the model does not have the Llama module layout ({where}.embed_tokens/layers/norm/rotary_emb, "
                    "lm_head)")
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
            return "it has sliding-window layers"
        if kind == "mistral" and getattr(cfg, "sliding_window", None) is not None:
            return "it has a sliding window"
        if getattr(cfg, "pretraining_tp", 1) != 1:
            return "pretraining_tp != 1"
        for layer in inner.layers:
            att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if att is None or mlp is None or not all(hasattr(att, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) \
                    or not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
                return "a layer does not have q/k/v/o_proj and a gated MLP"
            norms = [layer.input_layernorm, layer.post_attention_layernorm] + (
                [att.q_norm, att.k_norm] if kind == "qwen3" else [])
            if not all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") for n in norms):
                return "a norm is not an RMSNorm"
            if any(type(m) is not torch.nn.Linear for m in (att.q_proj, att.k_proj, att.v_proj, att.o_proj,
                                                             mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
                return "a projection is not a plain nn.Linear (an adapter or quantized layer)"
        return None

    @classmethod
    def build(cls, model) -> LeanDecoder | None:
        """The lean step for `model` if it supports it and agrees with the model's own forward
        on a probe batch; otherwise None (with the reason logged)."""
        reason = cls.unsupported(model)
        if reason is None:
            lean = cls(model)
            reason = lean._probe()
            if reason is None:
                return lean
        log.info("torch engine: decoding through the model's own forward (%s)", reason)
        return None

    def _probe(self) -> str | None:
        """Decode 3 steps of 2 left-padded random rows both ways; a disagreement beyond float
        rounding means this model is not the architecture the lean step computes."""
        model = self.model
        p = next(model.parameters())
        g = torch.Generator().manual_seed(0)
        vocab = _text_config(model).vocab_size
        ids = torch.randint(0, vocab, (2, 5), generator=g).to(p.device)
        attn = torch.ones((2, 5), dtype=torch.long, device=p.device)
        attn[0, :2] = 0
        with torch.inference_mode():
            caches = []
            for _ in range(2):
                dc = DynamicCache()
                theirs = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                               cache=dc, use_cache=True, logits_to_keep=1).logits[:, -1]
                caches.append(KVCache.from_dynamic(dc, attn, reserve=2))  # 3 steps: one growth too
            pos = attn.sum(-1)
            # The lean prefill against the model's on the same rows: a disagreement turns off the
            # lean prefill only (the engine then prefills through the model's forward).
            layers, mine = self.prefill(ids, attn)
            real = attn.bool()[:, None, :, None]  # padding's keys and values are never read
            ref = caches[1]
            prefill_worst = float((mine.float() - theirs.float()).abs().max())
            for i, (k, v) in enumerate(layers):
                for got, want in ((k, ref.k[i, :, :, :5]), (v, ref.v[i, :, :, :5])):
                    prefill_worst = max(prefill_worst, float(((got - want).float().abs() * real).max()))
            # The same prompts with their first 2 tokens made common, computed once (`prefill_shared`),
            # against the lean prefill of the whole prompts (just checked against the model's).
            shared = ids.clone()
            shared[0, 2:4] = ids[1, :2]
            whole, whole_logits = self.prefill(shared, attn)
            layers, mine = self.prefill_shared(shared, attn, 2)
            prefill_worst = max(prefill_worst, float((mine.float() - whole_logits.float()).abs().max()))
            for (k, v), (wk, wv) in zip(layers, whole):
                prefill_worst = max(prefill_worst, float(((k - wk).float().abs() * real).max()),
                                    float(((v - wv).float().abs() * real).max()))
            prefill_scale = max(float(theirs.float().abs().max()), 1.0)
            worst, scale = 0.0, 0.0
            for step in range(3):
                tok = torch.randint(0, vocab, (2,), generator=g).to(p.device)
                mine, theirs = self(tok, pos + step, caches[0]), model_decode(model, tok, pos + step, caches[1])
                worst = max(worst, float((mine.float() - theirs.float()).abs().max()))
                scale = max(scale, float(theirs.float().abs().max()))
        tol = _PROBE_TOL.get(p.dtype, _PROBE_TOL_LOW_PRECISION) * max(scale, 1.0)
        if not worst <= tol:  # also catches NaN
            return f"its logits differ from the model's own forward by {worst:.3g} on a probe (tolerance {tol:.3g})"
        tol = _PROBE_TOL.get(p.dtype, _PROBE_TOL_LOW_PRECISION) * prefill_scale
        self.prefills = prefill_worst <= tol
        if not self.prefills:
            log.info("torch engine: prefilling through the model's own forward (the lean prefill differs by %.3g "
                     "on a probe, tolerance %.3g)", prefill_worst, tol)
        return None

    def prefill(self, input_ids: torch.Tensor, attn: torch.Tensor,
                past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Prompts with nothing cached, left-padded (input_ids, attn [B, S]): the keys and values of
        every layer ([B, K, S, D] each) and the next-token logits [B, V]. The same formulas as the
        decode step, for S tokens at once under a causal mask; a padding position attends to itself
        alone (nothing real attends to it), so its keys and values stay finite.

        `past`: the keys and values ([1, K, c, D] per layer) of c tokens that every row's tokens
        follow (a prefix all the prompts share, computed once): the rows' positions start at c
        and each of their real tokens attends to all c. Only the rows' own keys and values are
        returned."""
        inner, (B, S) = self.inner, input_ids.shape
        H, K, D = self.heads, self.kv_heads, self.head_dim
        G = H // K
        c = 0 if past is None else past[0][0].shape[2]
        pos = (attn.cumsum(-1) - 1).clamp(min=0) + c
        x = F.embedding(input_ids, inner.embed_tokens.weight)  # [B, S, hidden]
        cos, sin = inner.rotary_emb(x, pos)  # [B, S, D]
        cos, sin = cos[:, None], _signed_sin(sin)[:, None]
        eye = torch.eye(S, dtype=torch.bool, device=x.device)
        allowed = (eye.cumsum(0).bool()[None] & attn.bool()[:, None, :]) | eye  # [B, S query, S key]: causal, real keys
        if c:  # real tokens see the whole prefix; padding still only itself
            allowed = torch.cat([attn.bool()[:, :, None].expand(B, S, c), allowed], dim=-1)
        masked = ~allowed[:, None, None]  # [B, 1, 1, S, c + S]
        layers = []
        for layer in inner.layers:
            att = layer.self_attn
            ln = layer.input_layernorm
            h = _rms_norm(x, ln.weight, ln.variance_epsilon)
            q = F.linear(h, att.q_proj.weight, att.q_proj.bias).view(B, S, H, D)
            k = F.linear(h, att.k_proj.weight, att.k_proj.bias).view(B, S, K, D)
            v = F.linear(h, att.v_proj.weight, att.v_proj.bias).view(B, S, K, D).transpose(1, 2)
            if self.qk_norm:
                q = _rms_norm(q, att.q_norm.weight, att.q_norm.variance_epsilon)
                k = _rms_norm(k, att.k_norm.weight, att.k_norm.variance_epsilon)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, S, D], [B, K, S, D]
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            layers.append((k, v))
            if c:
                pk, pv = past[len(layers) - 1]
                k, v = torch.cat([pk.expand(B, -1, -1, -1), k], dim=2), torch.cat([pv.expand(B, -1, -1, -1), v], dim=2)
            scores = torch.matmul(q.reshape(B, K, G, S, D), k[:, :, None].transpose(-1, -2)) * self.scale
            probs = scores.masked_fill(masked, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(probs, v[:, :, None])  # [B, K, G, S, D]
            out = out.permute(0, 3, 1, 2, 4).reshape(B, S, H * D)
            x = x + F.linear(out, att.o_proj.weight, att.o_proj.bias)
            x = _mlp_residual(layer, x)
        x = _rms_norm(x[:, -1], inner.norm.weight, inner.norm.variance_epsilon)
        return layers, F.linear(x, self.model.lm_head.weight, self.model.lm_head.bias)

    def prefill_prompts(self, input_ids: torch.Tensor, attn: torch.Tensor, prompts: list[list[int]],
                        ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, int]:
        """`prefill` of the left-padded `prompts` (input_ids, attn), their common first tokens (a
        chat template's opening: system turn, role header) computed once when that saves enough
        (`prefill_shared`). Also returns how many token positions it computed."""
        lens = [len(p) for p in prompts]
        c = common_prefix(prompts, min(lens) - 1)  # every row feeds >= 1 token: its logits are needed
        if len(prompts) < 2 or (len(prompts) - 1) * c < MIN_SHARED_PREFIX_TOKENS:
            return *self.prefill(input_ids, attn), sum(lens)
        return *self.prefill_shared(input_ids, attn, c), sum(lens) - (len(prompts) - 1) * c

    def prefill_shared(self, input_ids: torch.Tensor, attn: torch.Tensor, c: int,
                       ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """`prefill` of prompts whose first c real tokens are the same in every row: those are
        computed once (one row) and each row's rest on top of them (`past`); the keys and values
        come back laid out as `prefill` gives them (left padding, the prefix, the rest)."""
        (B, S), dev = input_ids.shape, input_ids.device
        first = S - int(attn[0].sum())  # row 0's first real column
        prefix = self.prefill(input_ids[:1, first:first + c], torch.ones_like(attn[:1, :c]))[0]
        # Each row's rest, left-padded to S - c: its real columns are those of the whole prompt's
        # mask shifted by c; the tokens under its padding are never attended to.
        rest_attn = attn[:, :S - c]
        rest, logits = self.prefill(input_ids[:, c:], rest_attn, past=prefix)
        # Column j of row i (pad: S - the row's length): a padding column of its rest for j < pad
        # (finite, masked), prefix column j - pad, then its rest (column j of [prefix, rest]).
        j = torch.arange(S, device=dev)[None, :]
        pad = (S - c - rest_attn.sum(-1))[:, None]
        index = torch.where(j < pad, c + j, torch.where(j < pad + c, j - pad, j))  # [B, S]
        layers = []
        for (pk, pv), (k, v) in zip(prefix, rest):
            at = index[:, None, :, None].expand(B, k.shape[1], S, k.shape[3])
            layers.append((torch.cat([pk.expand(B, -1, -1, -1), k], dim=2).gather(2, at),
                           torch.cat([pv.expand(B, -1, -1, -1), v], dim=2).gather(2, at)))
        return layers, logits

    def __call__(self, tok_B: torch.Tensor, pos_B: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """Next-token logits [B, V] after feeding tok_B at positions pos_B; the new keys and
        values go to the cache's next column.

        A decode step at a few dozen rows is dozens of small ops per layer, each a fixed
        dispatch cost, so the step keeps their number down: the hidden state stays [B, hidden]
        (no sequence axis to view away), q and k get their rotary embedding as one tensor, and
        attention is one `baddbmm` (the query-key products, scaled, plus an additive mask built
        once per step) and one `bmm` over the (row, key/value head) pairs, the G query heads of
        a key/value head as G rows. The same formulas in the same order as the module's forward,
        so the logits agree with it to float rounding (the probe checks)."""
        if self.hooked():  # e.g. a debugging or timing hook: it must see every step
            return model_decode(self.model, tok_B, pos_B, kv)
        inner, B = self.inner, tok_B.shape[0]
        H, K, D = self.heads, self.kv_heads, self.head_dim
        G = H // K
        col = kv.reserve_column()
        T = col + 1 - kv.lo
        x = F.embedding(tok_B, inner.embed_tokens.weight)  # [B, hidden]
        cos, sin = inner.rotary_emb(x, pos_B[:, None])  # [B, 1, D]
        cos, sin = cos.reshape(B, 1, D), _signed_sin(sin).reshape(B, 1, D)
        # 0 where a row's column is real, -inf where it is padding: [B * K, G, T].
        masked = kv.mask[:B, None, kv.lo:col + 1].logical_not()
        bias = x.new_zeros((B, H, T)).masked_fill_(masked, float("-inf")).view(B * K, G, T)
        for i, layer in enumerate(inner.layers):
            att = layer.self_attn
            ln = layer.input_layernorm
            h = _rms_norm(x, ln.weight, ln.variance_epsilon)
            q = F.linear(h, att.q_proj.weight, att.q_proj.bias).view(B, H, D)
            k = F.linear(h, att.k_proj.weight, att.k_proj.bias).view(B, K, D)
            if self.qk_norm:
                q = _rms_norm(q, att.q_norm.weight, att.q_norm.variance_epsilon)
                k = _rms_norm(k, att.k_norm.weight, att.k_norm.variance_epsilon)
            qk = _rope(torch.cat((q, k), dim=1), cos, sin)  # [B, H + K, D]
            kv.k[i, :B, :, col] = qk[:, H:]
            kv.v[i, :B, :, col] = F.linear(h, att.v_proj.weight, att.v_proj.bias).view(B, K, D)
            keys, values = kv.window(i, col + 1)  # [B, K, T, D]
            scores = torch.baddbmm(bias, qk[:, :H].reshape(B * K, G, D), keys.reshape(B * K, T, D).transpose(1, 2),
                                   alpha=self.scale)  # [B * K, G, T]
            probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.bmm(probs, values.reshape(B * K, T, D)).view(B, H * D)
            x = x + F.linear(out, att.o_proj.weight, att.o_proj.bias)
            x = _mlp_residual(layer, x)
        x = _rms_norm(x, inner.norm.weight, inner.norm.variance_epsilon)
        kv.hi = col + 1
        return F.linear(x, self.model.lm_head.weight, self.model.lm_head.bias)

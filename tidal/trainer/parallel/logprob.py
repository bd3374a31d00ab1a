"""Log-probs and entropy straight from hidden states, in chunks of tokens, on vocabulary shards.

The output head's logits are the largest tensor of a policy update: tokens x vocabulary in
float32 (8k tokens at Qwen's 151,936-token vocabulary: 5 GiB, twice over with the
log-softmax). `head_logprobs` never holds them: it runs the head `chunk` tokens at a time
(hidden states -> that chunk's logits -> its log-probs and entropy), keeps only the hidden
states and one log-sum-exp and one entropy per token for the backward pass, and there
recomputes each chunk's logits to form its gradient (a custom autograd Function, the way
fused linear-cross-entropy kernels do it). Peak memory: chunk x vocabulary, whatever the
number of tokens.

Under tensor parallelism the head's weight is split by vocabulary rows (`Shard(0)`): each
rank holds logits for its own slice of the vocabulary only, and the softmax is made whole
with three all-reduces per chunk over the tp group (the max, the sum of exponentials, and the
target's logit with the expected logit), never gathering the vocabulary. The backward needs
one all-reduce of the hidden states' gradient (each rank's slice contributes a part).

Every rank of a tp group computes the same loss from these (replicated) outputs, so the
gradient into each rank's slice is the whole gradient for that slice: no reduction of the
outputs' gradients is needed, only of the hidden states'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, temperature: float, banned: torch.Tensor | None) -> torch.Tensor:
    z = (h @ w.t()).float()  # under autocast the matmul runs in bfloat16, the softmax in float32
    if temperature != 1.0:
        z.div_(temperature)
    if banned is not None and banned.numel():
        z.index_fill_(-1, banned, -1e9)  # tidal.models.vision.BANNED_LOGIT: gradient 0 there
    return z


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products of [n, V] tensors without an [n, V] temporary."""
    return (a.unsqueeze(1) @ b.unsqueeze(2)).view(-1)


class _HeadLogprobs(torch.autograd.Function):
    """Each chunk holds at most two [chunk, V_local] float32 tensors at once (the rest in place)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, group, vocab_start, banned):
        n, v_local = hidden.shape[0], weight.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent, lse = torch.empty_like(logp), torch.empty_like(logp)
        local_t = targets - vocab_start
        inside = (local_t >= 0) & (local_t < v_local)
        local_t = local_t.clamp(0, max(v_local - 1, 0))
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = _chunk_logits(hidden[s:e], weight, temperature, banned)
            m = _reduce(z.max(-1).values, group, dist.ReduceOp.MAX)
            tz = z.gather(-1, local_t[s:e, None])[:, 0] * inside[s:e]  # the target's logit, on its rank
            z.sub_(m[:, None])  # shifted logits from here on
            p = z.exp()
            sum_exp = _reduce(p.sum(-1), group)
            p.div_(sum_exp[:, None])
            # the target's logit and E_p[z - m], in one all-reduce
            tz, ez = _reduce(torch.stack([tz, _dot(p, z)]), group)
            lse_c = m + sum_exp.log()
            logp[s:e], ent[s:e], lse[s:e] = tz - lse_c, sum_exp.log() - ez, lse_c
        ctx.save_for_backward(hidden, weight, local_t, inside, lse, ent)
        ctx.temperature, ctx.chunk, ctx.group, ctx.banned = temperature, chunk, group, banned
        ctx.autocast = (hidden.device.type, torch.is_autocast_enabled(hidden.device.type),
                        torch.get_autocast_dtype(hidden.device.type))
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, local_t, inside, lse, ent = ctx.saved_tensors
        device, enabled, dtype = ctx.autocast
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        n = hidden.shape[0]
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for s in range(0, n, ctx.chunk):
                e = min(s + ctx.chunk, n)
                z = _chunk_logits(hidden[s:e], weight, ctx.temperature, ctx.banned)
                p = (z - lse[s:e, None]).exp_()
                # d logp/dz = onehot(target) - p;  dH/dz = -p (z - E_p[z]), E_p[z] = lse - H.
                # Together: gz = -p * (g_logp + g_ent (z - E_p[z])) + onehot * g_logp, built in z.
                g = g_logp[s:e] if g_logp is not None else torch.zeros(e - s, device=z.device)
                if g_ent is not None:
                    z.sub_((lse[s:e] - ent[s:e])[:, None]).mul_(g_ent[s:e, None]).add_(g[:, None])
                else:
                    z.copy_(g[:, None].expand_as(z))
                gz = p.mul_(z).neg_()
                del z
                if g_logp is not None:
                    rows = inside[s:e].nonzero()[:, 0]
                    gz[rows, local_t[s:e][rows]] += g[rows]
                if ctx.banned is not None and ctx.banned.numel():
                    gz.index_fill_(-1, ctx.banned, 0.0)  # a constant logit there: no gradient
                if ctx.temperature != 1.0:
                    gz.div_(ctx.temperature)
                grad_h[s:e] = (gz.to(weight.dtype) @ weight).float()
                grad_w += (gz.to(hidden.dtype).t() @ hidden[s:e]).float()
        _reduce(grad_h, ctx.group)  # each rank's vocabulary slice contributes a part
        return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), None, None, None, None, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  chunk: int = 512, banned: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy) [N] float32 under softmax(hidden @ weight.T / temperature),
    from hidden states [N, H] and the head's weight [V, H] (a DTensor split by vocabulary rows
    over a tp mesh, or a plain tensor), `chunk` tokens at a time. `banned`: vocabulary ids whose
    logit is pinned to -1e9 (a vision-language model's special tokens). Differentiable in
    `hidden` and `weight`; every rank of the weight's tp group must call it alike."""
    group, start, w = None, 0, weight
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if list(weight.placements) != [Shard(0)]:
            raise ValueError(f"the output head's weight must be split by vocabulary rows over one mesh dimension, "
                             f"got placements {weight.placements}")
        _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        group, start, w = weight.device_mesh.get_group(), int(offset[0]), weight.to_local()
    if banned is not None and banned.numel():
        banned = banned[(banned >= start) & (banned < start + w.shape[0])] - start
    return _HeadLogprobs.apply(hidden, w, targets, float(temperature), int(chunk), group, start, banned)


class head_scores:
    """While active, `model`'s output head returns, instead of logits, [N, 2] (log-prob of each of
    `targets`, entropy) from the hidden states it gets (`head_logprobs`, `chunk` tokens at a
    time, on the weight's vocabulary shards under tensor parallelism). The head runs inside the
    model's forward, so FSDP's gathered weight and its hooks are the ones a forward uses; the
    hidden states must be [N, H] in `targets`' order (tidal.trainer.layout.keep_rows)."""

    def __init__(self, model, targets: torch.Tensor, temperature: float, chunk: int, banned: torch.Tensor | None = None):
        self.head = model.get_output_embeddings()
        self.targets, self.temperature, self.chunk, self.banned = targets, temperature, chunk, banned

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logp, ent = head_logprobs(hidden.reshape(-1, hidden.shape[-1]), self.head.weight, self.targets,
                                  self.temperature, self.chunk, self.banned)
        return torch.stack([logp, ent], -1)

    def __enter__(self):
        self.head.forward = self._forward  # an instance attribute: nn.Module.__call__ runs it, hooks as ever
        return self

    def __exit__(self, *exc):
        del self.head.forward

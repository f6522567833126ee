"""The acceptance-aware Draft-OPD objective (docs/design.md, "Objective") and its estimators. Imports only torch
and its settings, `LossConfig` (config/schema.py, the bottom floor: fields `loss.*`, defaults and checks there).

An anchor's drafted block has K' <= K valid positions k = 1..K' (k is the absolute offset in the block) and
acceptance a (the first a drafted tokens were accepted):

    A = {k <= a} + the correction position k = a+1 (when a < K')    forward KL D(p_k || q_k), weight lambda_acc
    R = {a+1 <= k <= K'} (scope "all") or {k = a+1} ("first")       reverse KL D(q_k || p_k), lambda_rej gamma^(k-1)
    L = (lambda_acc sum_A FKL_k + lambda_rej sum_R gamma^(k-1) RKL_k) / (lambda_acc |A| + lambda_rej sum_R gamma^(k-1))

Position a+1 is in both sets. The a accepted tokens equal the committed ones, so its context is the same on the
committed and the drafted stream and one pair (p_{a+1}, q_{a+1}) serves both terms. A full accept (a = K') has no
correction position inside the block. `directions` "forward" / "reverse" (ablations) keep every position's weight
and the denominator as they are and only swap the divergence: one KL everywhere, weights unchanged.

Layout: per-position inputs are flattened over the valid block positions, anchor-major, every valid position
included (positions outside A and R carry weight 0):

    valid = arange(K) < valid_len[:, None]     # (N, K)
    x_flat = x[valid]                          # (T, ...), T = valid_len.sum()

Estimators (`objective_terms` dispatches on `LossConfig.estimator`; the inputs dataclass must match):
    full   FullInputs   exact KL over the vocabulary from the student's hidden states and lm_head weight; chunked
                        over tokens and vocabulary, student logits recomputed chunk-wise in backward, so no
                        [T x V] intermediate is ever live (like fused linear cross-entropy). Cost: the logits
                        are computed three times (two forward passes, one in backward), ~2x naive time on CPU.
    topk   TopkInputs   KL of the distributions coarse-grained to S + {tail}: S = teacher top-k ids united with the
                        draft's own top-m ids, tail = the rest of the mass on each side. A lower bound of the full
                        KL (data processing), equal to it when S covers the vocabulary.
    token  TokenInputs  forward KL as the Bernoulli KL of the committed token c: KL(Bern(p_c) || Bern(q_c));
                        reverse KL as k3 = e^d - d - 1, d = log p(y) - log q(y), on the drafted token y.
The teacher must already be in the student's vocabulary (an EAGLE-3 head with a reduced draft vocabulary gets the
target's logits restricted to the d2t ids by the caller); teacher inputs are constants (no gradient).

Caps (`clamp` is `loss.logprob_clamp`): a per-token loss above `clamp` counts as `clamp` in the value, and its gradient is scaled by
clamp / KL instead of cut (cap(x) = x * min(1, clamp / x) with the factor held constant). A hard cap gives
no gradient exactly where the student is confidently wrong (q(y) = 0.95 on a token the teacher gives 1e-7:
RKL 15.3), the positions reverse KL exists for; the scaled gradient keeps their direction and bounds their size.
The `token` estimator clamps the log-probs it uses at -clamp in the value only (the student's gradient passes
straight through the clamp, for the same reason). The exact estimators do not clamp per-vocabulary log-probs: at
V ~ 49k a near-uniform student has every log q < -10, and clamping there would zero the forward-KL gradient (and
smear the teacher for reverse KL).

Global normalisation: `objective_terms` returns the numerator (with grad) and this batch's denominator; the caller
divides by the denominator summed over all micro-batches and data-parallel ranks of one optimizer step
(`denominator` needs no logits, so it can be all-reduced before the forward). Summed gradients then equal the
gradient of the whole-batch loss; an engine that averages gradients over R ranks needs the loss times R.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draft_opd_ray.config.schema import REJECTED_SCOPES, LossConfig

# --------------------------------------------------------------------------------------------------------------
# Position sets and weights (no logits needed)


@dataclass(frozen=True)
class PositionSets:
    valid: torch.Tensor  # (N, K) bool: k <= K'
    accepted: torch.Tensor  # (N, K) bool: k <= a
    first_rejected: torch.Tensor  # (N, K) bool: k = a+1 <= K', the correction position
    rejected: torch.Tensor  # (N, K) bool: R under the scope

    @property
    def forward_set(self) -> torch.Tensor:  # (N, K) bool: A = accepted + correction position
        return self.accepted | self.first_rejected


def position_sets(
    accepted: torch.Tensor, valid_len: torch.Tensor, block_size: int, scope: str
) -> PositionSets:
    """A and R of §2.4 as boolean masks over block offsets k = 1..K (column k-1)."""
    if scope not in REJECTED_SCOPES:
        raise ValueError(f"rejected_scope must be one of {REJECTED_SCOPES}, got {scope!r}")
    if accepted.shape != valid_len.shape or accepted.dim() != 1:
        raise ValueError(f"accepted and valid_len must both be (N,), got {accepted.shape}, {valid_len.shape}")
    if bool(((accepted < 0) | (accepted > valid_len) | (valid_len > block_size)).any()):
        raise ValueError(f"need 0 <= accepted <= valid_len <= block_size = {block_size}")
    k0 = torch.arange(block_size, device=accepted.device)  # (K,) 0-based, k0 = k - 1
    a, kv = accepted[:, None], valid_len[:, None]  # (N, 1)
    valid = k0 < kv
    first = (k0 == a) & valid
    rejected = (k0 >= a) & valid if scope == "all" else first
    return PositionSets(valid=valid, accepted=k0 < a, first_rejected=first, rejected=rejected)


def position_weights(
    accepted: torch.Tensor, valid_len: torch.Tensor, block_size: int, spec: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position weights of the forward and reverse KL terms, each (N, K) float64."""
    sets = position_sets(accepted, valid_len, block_size, spec.rejected_scope)
    decay = spec.gamma ** torch.arange(block_size, dtype=torch.float64, device=accepted.device)  # (K,)
    w_acc = spec.lambda_acc * sets.forward_set.double()
    w_rej = spec.lambda_rej * decay * sets.rejected.double()
    if spec.directions == "mixed":
        return w_acc, w_rej
    total = w_acc + w_rej
    return (
        (total, torch.zeros_like(total)) if spec.directions == "forward" else (torch.zeros_like(total), total)
    )


def denominator(accepted: torch.Tensor, valid_len: torch.Tensor, block_size: int, spec: LossConfig) -> float:
    """lambda_acc |A| + lambda_rej sum_R gamma^(k-1) of these anchors, the same for every `directions`."""
    w_fwd, w_rev = position_weights(accepted, valid_len, block_size, spec)
    return float((w_fwd + w_rev).sum())


# --------------------------------------------------------------------------------------------------------------
# Estimators: per-token forward and reverse KL, each (T,)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _log_tiny(dtype: torch.dtype) -> float:
    return math.log(torch.finfo(dtype).tiny)


def _cap_scale(kl: torch.Tensor, clamp: float) -> torch.Tensor:
    """min(1, clamp / kl): the factor that caps a per-token loss at ``clamp`` (constant: no gradient)."""
    return (clamp / kl.detach().clamp(min=clamp)).to(kl.dtype)


def soft_cap(kl: torch.Tensor, clamp: float) -> torch.Tensor:
    """Value min(kl, clamp); gradient min(1, clamp / kl) x d kl, never zero (module docstring, "Caps")."""
    return kl * _cap_scale(kl, clamp)


def _clamp_value(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """x clamped to [lo, hi] in value; the gradient passes straight through."""
    return x + (x.detach().clamp(lo, hi) - x.detach())


def _chunk_logprobs(
    hidden: torch.Tensor,  # (Tc, H)
    weight: torch.Tensor,  # (Vc, H)
    teacher: torch.Tensor,  # (Tc, Vc)
    lse_q: torch.Tensor,  # (Tc,)
    lse_p: torch.Tensor,  # (Tc,)
) -> tuple[torch.Tensor, torch.Tensor]:
    dt = lse_q.dtype
    lq = (hidden @ weight.T).to(dt).sub_(lse_q[:, None])  # (Tc, Vc)
    # -inf teacher logits (masked tokens) become the smallest normal: p = 0 either way, and no nan in 0 * inf
    lp = teacher.to(dt).sub(lse_p[:, None]).clamp_(min=_log_tiny(dt))  # (Tc, Vc)
    return lq, lp


class _ChunkedKL(torch.autograd.Function):
    """sum_t cap(FKL_t) w_fwd_t + cap(RKL_t) w_rev_t without live [T x V] tensors; cap = `soft_cap`.

    Forward per token chunk: pass 1 takes the logsumexp of student and teacher logits over vocabulary chunks, pass 2
    accumulates both KLs. Backward recomputes the student logits chunk by chunk from the saved logsumexps, with
    dFKL/dz = q - p and dRKL/dz = q (log q - log p - RKL).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,  # (T, H)
        weight: torch.Tensor,  # (V, H)
        teacher: torch.Tensor,  # (T, V)
        w_fwd: torch.Tensor,  # (T,)
        w_rev: torch.Tensor,  # (T,)
        clamp: float,
        token_chunk: int,
        vocab_chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T, V, dt = hidden.shape[0], weight.shape[0], _acc_dtype(hidden)
        lse_q, lse_p = hidden.new_empty(T, dtype=dt), hidden.new_empty(T, dtype=dt)
        fkl, rkl = hidden.new_zeros(T, dtype=dt), hidden.new_zeros(T, dtype=dt)
        for t0 in range(0, T, token_chunk):
            ts = slice(t0, min(t0 + token_chunk, T))
            h = hidden[ts]
            parts_q, parts_p = [], []
            for v0 in range(0, V, vocab_chunk):
                vs = slice(v0, min(v0 + vocab_chunk, V))
                parts_q.append((h @ weight[vs].T).to(dt).logsumexp(-1))
                parts_p.append(teacher[ts, vs].to(dt).logsumexp(-1))
            lse_q[ts] = torch.stack(parts_q, -1).logsumexp(-1)
            lse_p[ts] = torch.stack(parts_p, -1).logsumexp(-1)
            for v0 in range(0, V, vocab_chunk):
                vs = slice(v0, min(v0 + vocab_chunk, V))
                lq, lp = _chunk_logprobs(h, weight[vs], teacher[ts, vs], lse_q[ts], lse_p[ts])
                p = lp.exp()
                d = lp.sub_(lq)  # (Tc, Vc) log p - log q
                fkl[ts] += p.mul_(d).sum(-1)
                rkl[ts] -= d.mul_(lq.exp_()).sum(-1)
        w_fwd, w_rev = w_fwd.to(dt), w_rev.to(dt)
        num = (w_fwd * torch.where(w_fwd > 0, fkl.clamp(max=clamp), 0)).sum() + (
            w_rev * torch.where(w_rev > 0, rkl.clamp(max=clamp), 0)
        ).sum()
        # gradient coefficients: the weight where the term is used, scaled by clamp / KL where it is capped
        coef_f = torch.where(w_fwd > 0, w_fwd * _cap_scale(fkl, clamp), 0)
        coef_r = torch.where(w_rev > 0, w_rev * _cap_scale(rkl, clamp), 0)
        ctx.save_for_backward(hidden, weight, teacher, lse_q, lse_p, coef_f, coef_r, rkl)
        ctx.chunks = (token_chunk, vocab_chunk)
        ctx.mark_non_differentiable(fkl, rkl)
        return num, fkl, rkl

    @staticmethod
    def backward(ctx, g_num: torch.Tensor, *_: torch.Tensor):  # type: ignore[override]
        hidden, weight, teacher, lse_q, lse_p, coef_f, coef_r, rkl = ctx.saved_tensors
        token_chunk, vocab_chunk = ctx.chunks
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T, V, dt = hidden.shape[0], weight.shape[0], lse_q.dtype
        grad_h = torch.zeros(hidden.shape, dtype=dt, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
        for t0 in range(0, T, token_chunk):
            ts = slice(t0, min(t0 + token_chunk, T))
            h = hidden[ts]
            a, b = (coef_f[ts] * g_num)[:, None], (coef_r[ts] * g_num)[:, None]  # (Tc, 1)
            for v0 in range(0, V, vocab_chunk):
                vs = slice(v0, min(v0 + vocab_chunk, V))
                lq, lp = _chunk_logprobs(h, weight[vs], teacher[ts, vs], lse_q[ts], lse_p[ts])
                q = lq.exp()
                g = lq.sub_(lp).sub_(rkl[ts, None]).mul_(q).mul_(b)  # b q (log q - log p - RKL)
                g.add_(q.sub_(lp.exp_()).mul_(a))  # + a (q - p)
                g = g.to(hidden.dtype)
                if grad_h is not None:
                    grad_h[ts] += g @ weight[vs]
                if grad_w is not None:
                    grad_w[vs] += g.T @ h
        out_h = grad_h.to(hidden.dtype) if grad_h is not None else None
        out_w = grad_w.to(weight.dtype) if grad_w is not None else None
        return out_h, out_w, None, None, None, None, None, None


def full_kl(
    hidden: torch.Tensor,  # (T, H)
    lm_head: torch.Tensor,  # (V, H)
    teacher_logits: torch.Tensor,  # (T, V) logits or log-probs
    w_fwd: torch.Tensor,  # (T,)
    w_rev: torch.Tensor,  # (T,)
    clamp: float,
    token_chunk: int = 1024,
    vocab_chunk: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact KLs, chunked: (sum_t w_fwd min(FKL_t, clamp) + w_rev min(RKL_t, clamp), FKL (T,), RKL (T,)).

    Only the first output carries a gradient (to `hidden` and `lm_head`)."""
    num, fkl, rkl = _ChunkedKL.apply(
        hidden, lm_head, teacher_logits.detach(), w_fwd, w_rev, clamp, token_chunk, vocab_chunk
    )
    return num, fkl, rkl


def teacher_log_tail(logprobs: torch.Tensor, *supports: torch.Tensor | None) -> torch.Tensor:
    """log of the mass of ``logprobs`` (..., V) outside the union of ``supports`` (..., s_i ids), summed in log
    space over the ids outside it: exact where ``1 - sum(p over the support)`` cancels to 0 (a confident teacher
    in float32 leaves a tail below ~1e-7, which that subtraction turns into log 0). -inf where the support covers
    every id."""
    outside = torch.ones_like(logprobs, dtype=torch.bool)
    for ids in supports:
        if ids is not None:
            outside.scatter_(-1, ids.to(logprobs.device), False)
    return logprobs.masked_fill(~outside, -math.inf).logsumexp(-1)


def topk_kl(
    student_logits: torch.Tensor,  # (T, V)
    teacher_ids: torch.Tensor,  # (T, k) teacher top-k ids
    teacher_logprobs: torch.Tensor,  # (T, k)
    draft_ids: torch.Tensor | None = None,  # (T, m) the draft's own top-m ids
    teacher_logprobs_at_draft: torch.Tensor | None = None,  # (T, m) teacher log-probs at draft_ids
    teacher_log_tail: torch.Tensor | None = None,  # (T,) log teacher mass outside S (`teacher_log_tail`)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and reverse KL over S + {tail}, each (T,), differentiable in the student logits.

    The teacher's tail is ``teacher_log_tail`` where given (the replay ships it, computed over the full teacher),
    else ``1 - sum(p over S)``, which is exact only while the tail is well above float32's rounding of the
    support's log-probs."""
    dt = _acc_dtype(student_logits)
    z = student_logits.to(dt)
    lse = z.logsumexp(-1, keepdim=True)  # (T, 1)
    ids, lp = teacher_ids, teacher_logprobs
    if draft_ids is not None:
        if teacher_logprobs_at_draft is None:
            raise ValueError("draft_ids need teacher_logprobs_at_draft")
        ids, lp = torch.cat([ids, draft_ids], -1), torch.cat([lp, teacher_logprobs_at_draft], -1)
    lp = lp.detach().to(dt).clamp(min=_log_tiny(dt))  # (T, S)
    S = ids.shape[-1]
    earlier = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril(-1)  # [i, j]: j < i
    keep = ~((ids[:, :, None] == ids[:, None, :]) & earlier).any(-1)  # (T, S) first occurrence of each id
    lq = z.gather(-1, ids) - lse  # (T, S)
    p, q = lp.exp() * keep, lq.exp() * keep
    if teacher_log_tail is not None:
        log_p_tail = teacher_log_tail.detach().to(dt).clamp(min=_log_tiny(dt))  # (T,)
        p_tail = log_p_tail.exp()
    else:
        p_tail = (1 - p.sum(-1)).clamp(min=0)  # (T,)
        log_p_tail = p_tail.clamp(min=torch.finfo(dt).tiny).log()
    # the student's tail in log space (exact, no 1 - sum cancellation); finfo.min keeps a fully covered row finite
    in_s = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, ids, True)
    log_q_tail = (z.masked_fill(in_s, torch.finfo(dt).min).logsumexp(-1) - lse[:, 0]).clamp(min=_log_tiny(dt))
    d = lp - lq
    fkl = (p * d).sum(-1) + p_tail * (log_p_tail - log_q_tail)
    rkl = -(q * d).sum(-1) + log_q_tail.exp() * (log_q_tail - log_p_tail)
    return fkl, rkl


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, accurate at both ends."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def token_kl(
    student_logits: torch.Tensor,  # (T, V) logits or log-probs
    committed_ids: torch.Tensor,  # (T,) committed token (the drafted one where the committed stream has none)
    drafted_ids: torch.Tensor,  # (T,)
    teacher_logprob_committed: torch.Tensor,  # (T,)
    teacher_logprob_drafted: torch.Tensor,  # (T,)
    clamp: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Single-token estimators: (Bernoulli FKL, k3 RKL, FKL log-prob clamped, RKL log-prob clamped), each (T,).

    Log-probs are clamped to [-clamp, log(1 - eps)] (the upper end keeps log(1 - p) finite)."""
    dt = _acc_dtype(student_logits)
    z = student_logits.to(dt)
    lse = z.logsumexp(-1)  # (T,)
    lq_c = z.gather(-1, committed_ids[:, None])[:, 0] - lse
    lq_y = z.gather(-1, drafted_ids[:, None])[:, 0] - lse
    lp_c, lp_y = teacher_logprob_committed.detach().to(dt), teacher_logprob_drafted.detach().to(dt)
    clamped_f = (lq_c.detach() < -clamp) | (lp_c < -clamp)
    clamped_r = (lq_y.detach() < -clamp) | (lp_y < -clamp)
    top = math.log1p(-torch.finfo(dt).eps)
    lq_c, lp_c = _clamp_value(lq_c, -clamp, top), lp_c.clamp(-clamp, top)
    lq_y, lp_y = _clamp_value(lq_y, -clamp, top), lp_y.clamp(-clamp, top)
    p = lp_c.exp()
    fkl = p * (lp_c - lq_c) + (1 - p) * (_log1mexp(lp_c) - _log1mexp(lq_c))
    delta = lp_y - lq_y
    rkl = delta.exp() - delta - 1
    return fkl, rkl, clamped_f, clamped_r


# --------------------------------------------------------------------------------------------------------------
# The objective


@dataclass
class FullInputs:
    hidden: torch.Tensor  # (T, H) student hidden states that feed the lm_head
    lm_head: torch.Tensor  # (V, H) student lm_head weight (frozen or trained)
    teacher_logits: torch.Tensor  # (T, V) teacher logits or log-probs in the student's vocabulary


@dataclass
class TopkInputs:
    student_logits: torch.Tensor  # (T, V)
    teacher_ids: torch.Tensor  # (T, k) long
    teacher_logprobs: torch.Tensor  # (T, k)
    draft_ids: torch.Tensor | None = None  # (T, m) long
    teacher_logprobs_at_draft: torch.Tensor | None = None  # (T, m)
    teacher_log_tail: torch.Tensor | None = None  # (T,)


@dataclass
class TokenInputs:
    student_logits: torch.Tensor  # (T, V) logits or log-probs
    committed_ids: torch.Tensor  # (T,) long; the drafted id where the committed stream has no token (k > a+1)
    drafted_ids: torch.Tensor  # (T,) long
    teacher_logprob_committed: torch.Tensor  # (T,)
    teacher_logprob_drafted: torch.Tensor  # (T,)


@dataclass
class ObjectiveTerms:
    numerator: torch.Tensor  # () with grad
    denominator: float  # this batch's; divide by the global one (module docstring)
    metrics: dict[str, float]  # this batch's loss parts, counts and means

    def loss(self, global_denominator: float | None = None) -> torch.Tensor:
        den = self.denominator if global_denominator is None else global_denominator
        return self.numerator / den if den > 0 else self.numerator * 0.0


def _capped_sum(kl: torch.Tensor, w: torch.Tensor, clamp: float) -> torch.Tensor:
    w = w.to(kl.dtype)
    return (w * torch.where(w > 0, soft_cap(kl, clamp), 0)).sum()


def objective_terms(
    inputs: FullInputs | TopkInputs | TokenInputs,
    accepted: torch.Tensor,  # (N,) long
    valid_len: torch.Tensor,  # (N,) long, K' per anchor
    block_size: int,
    spec: LossConfig,
) -> ObjectiveTerms:
    """Numerator and denominator of L (§2.4) for these anchors; inputs at the flattened valid positions."""
    expected = {"full": FullInputs, "topk": TopkInputs, "token": TokenInputs}[spec.estimator]
    if not isinstance(inputs, expected):
        raise TypeError(
            f"estimator {spec.estimator!r} takes {expected.__name__}, got {type(inputs).__name__}"
        )
    sets = position_sets(accepted, valid_len, block_size, spec.rejected_scope)
    w_fwd_nk, w_rev_nk = position_weights(accepted, valid_len, block_size, spec)
    device = inputs.hidden.device if isinstance(inputs, FullInputs) else inputs.student_logits.device
    w_fwd, w_rev = w_fwd_nk[sets.valid].to(device), w_rev_nk[sets.valid].to(device)  # (T,)
    T = w_fwd.shape[0]
    lp_clamped = 0
    if isinstance(inputs, FullInputs):
        _check_rows(T, inputs.hidden, inputs.teacher_logits)
        num, fkl, rkl = full_kl(
            inputs.hidden,
            inputs.lm_head,
            inputs.teacher_logits,
            w_fwd,
            w_rev,
            spec.logprob_clamp,
            spec.token_chunk,
            spec.vocab_chunk,
        )
    else:
        _check_rows(T, inputs.student_logits)
        if isinstance(inputs, TopkInputs):
            fkl, rkl = topk_kl(
                inputs.student_logits,
                inputs.teacher_ids,
                inputs.teacher_logprobs,
                inputs.draft_ids,
                inputs.teacher_logprobs_at_draft,
                inputs.teacher_log_tail,
            )
        else:
            fkl, rkl, cl_f, cl_r = token_kl(
                inputs.student_logits,
                inputs.committed_ids,
                inputs.drafted_ids,
                inputs.teacher_logprob_committed,
                inputs.teacher_logprob_drafted,
                spec.logprob_clamp,
            )
            lp_clamped = int(((cl_f & (w_fwd > 0)) | (cl_r & (w_rev > 0))).sum())
        num = _capped_sum(fkl, w_fwd, spec.logprob_clamp) + _capped_sum(rkl, w_rev, spec.logprob_clamp)
    den = float((w_fwd + w_rev).sum())
    metrics = _metrics(fkl.detach(), rkl.detach(), w_fwd, w_rev, den, spec.logprob_clamp)
    decay = spec.gamma ** torch.arange(block_size, dtype=torch.float64, device=accepted.device)
    metrics.update(
        n_acc=float(sets.forward_set.sum()),
        n_rej=float(sets.rejected.sum()),
        rej_weight=float((decay * sets.rejected).sum()),
        n_logprob_clamped=float(lp_clamped),
    )
    return ObjectiveTerms(numerator=num, denominator=den, metrics=metrics)


def _check_rows(T: int, *tensors: torch.Tensor) -> None:
    for x in tensors:
        if x.shape[0] != T:
            raise ValueError(f"inputs have {x.shape[0]} rows; the anchors have {T} valid block positions")


def _metrics(
    fkl: torch.Tensor, rkl: torch.Tensor, w_fwd: torch.Tensor, w_rev: torch.Tensor, den: float, clamp: float
) -> dict[str, float]:
    use_f, use_r = w_fwd > 0, w_rev > 0
    num_f = float(_capped_sum(fkl, w_fwd, clamp))
    num_r = float(_capped_sum(rkl, w_rev, clamp))
    scale = 1 / den if den > 0 else 0.0
    return {
        "loss": (num_f + num_r) * scale,
        "loss_fwd": num_f * scale,
        "loss_rev": num_r * scale,
        "denominator": den,
        "fkl_mean": float(fkl[use_f].mean()) if bool(use_f.any()) else 0.0,
        "rkl_mean": float(rkl[use_r].mean()) if bool(use_r.any()) else 0.0,
        "n_fwd": float(use_f.sum()),
        "n_rev": float(use_r.sum()),
        "n_clamped": float(((fkl > clamp) & use_f).sum() + ((rkl > clamp) & use_r).sum()),
    }


def sft_terms(
    student_logits: torch.Tensor,  # (T, V)
    committed_ids: torch.Tensor,  # (T,) long
) -> ObjectiveTerms:
    """ "SFT on OPD rollouts" ablation: cross-entropy on the committed tokens, no teacher; normalised by the
    (global) token count, so micro-batches combine like `objective_terms`."""
    ce = torch.nn.functional.cross_entropy(
        student_logits.to(_acc_dtype(student_logits)), committed_ids, reduction="sum"
    )
    n = float(committed_ids.numel())
    return ObjectiveTerms(
        numerator=ce, denominator=n, metrics={"loss": float(ce.detach()) / n if n else 0.0, "n_tokens": n}
    )

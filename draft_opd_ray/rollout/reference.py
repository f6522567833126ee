"""Reference speculative decoding in plain PyTorch: the ground truth for tests, and the rollout path for
anything vLLM cannot serve.

One verification step, per request (docs/design.md, "Method"):
    draft proposes y_1..y_K from the committed prefix            (Drafter.propose)
    target scores prefix + y_1..y_K in one forward                (p_1..p_{K+1})
    greedy:   accept while y_k == argmax p_k; then emit argmax p_{a+1}
    sampling: accept y_k with prob min(1, p_k(y_k) / q_k(y_k)); on the first rejection emit a sample of
              normalize(max(0, p_k - q_k)); after a full accept emit a sample of p_{K+1}
so the output equals the target's greedy output, or is distributed as the target's samples.

Requests are batched: the target scores all active requests in one right-padded forward (no KV cache:
the sequences here are short, and recomputation keeps padding and acceptance bookkeeping trivially
correct). Produces the same `RequestRecord`s as the vLLM rollout worker.

Drafters (`drafts/drafter.py`; each kind's in its folder, built by `DraftKind.drafter`) that condition on
target hidden states (EAGLE-3, DFlash: `FeatureDrafter`) get them from the verification pass itself, as vLLM
does: after a step that accepted a tokens the pass over prefix + y_1..y_K holds exact states for every
committed position but the last (the correction/bonus token, which no forward has consumed yet). So the
drafter always sees the states of positions 0..len(seq)-2, from the prefill for the first step and from the
previous verification afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draft_opd_ray.drafts.drafter import Drafter, FeatureDrafter, padded_forward, right_pad, sampling_probs
from draft_opd_ray.wire import RequestRecord


def padded_logits(model: torch.nn.Module, seqs: Sequence[list[int]], pad_id: int = 0) -> torch.Tensor:
    """Logits of a causal LM over right-padded sequences: (B, Lmax, V) in float32."""
    ids, mask = right_pad(seqs, pad_id)
    return model(input_ids=ids, attention_mask=mask).logits.float()


@dataclass
class StepResult:
    accepted: int
    emitted: list[int]  # accepted drafted tokens + the correction/bonus token
    teacher_logprob_drafted: list[float]


def verify_block(
    p: torch.Tensor,
    q: torch.Tensor,
    drafted: list[int],
    temperature: float,
    generator: torch.Generator | None,
) -> StepResult:
    """Lossless acceptance of one drafted block. p: (K+1, V) target probs at the K+1 positions, q: (K, V)."""
    K = len(drafted)
    logp = torch.log(p.clamp_min(1e-30))
    lp = [float(logp[k, drafted[k]]) for k in range(K)]
    for k, y in enumerate(drafted):
        if temperature == 0:
            ok = int(p[k].argmax()) == y
        else:
            ratio = float(p[k, y] / q[k, y].clamp_min(1e-30))
            u = float(torch.rand((), generator=generator))
            ok = u < min(1.0, ratio)
        if not ok:
            if temperature == 0:
                fix = int(p[k].argmax())
            else:
                resid = (p[k] - q[k]).clamp_min(0)
                resid = resid / resid.sum() if resid.sum() > 0 else p[k]
                fix = int(torch.multinomial(resid, 1, generator=generator))
            return StepResult(k, drafted[:k] + [fix], lp)
    bonus = int(p[K].argmax()) if temperature == 0 else int(torch.multinomial(p[K], 1, generator=generator))
    return StepResult(K, list(drafted) + [bonus], lp)


@torch.no_grad()
def speculative_generate(
    target: torch.nn.Module,
    drafter: Drafter,
    prompts: Sequence[list[int]],
    *,
    num_speculative_tokens: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] = (),
    seed: int = 0,
    policy_version: int = 0,
) -> list[RequestRecord]:
    """Speculative decoding of a batch of prompts; one record per prompt (docs/design.md, "Records"). An answer
    ends at the first of ``stop_token_ids`` it emits (the target's eos ids), kept, as vLLM ends it."""
    stop = frozenset(stop_token_ids)
    gen = torch.Generator().manual_seed(seed)
    recs = [
        RequestRecord(prompt_ids=list(p), response_ids=[], request_id=str(i)) for i, p in enumerate(prompts)
    ]
    indices = tuple(drafter.hidden_state_indices) if isinstance(drafter, FeatureDrafter) else ()
    # Prefill: the first response token comes from the target alone and belongs to no step.
    logits, feats = padded_forward(target, [r.prompt_ids for r in recs], indices)
    # features of positions 0..len(seq)-2 per request (FeatureDrafter only), refreshed by every verification
    ctx: list[torch.Tensor] = [torch.empty(0)] * len(recs)
    for i, r in enumerate(recs):
        p0 = sampling_probs(logits[i, len(r.prompt_ids) - 1], temperature)
        tok = int(p0.argmax()) if temperature == 0 else int(torch.multinomial(p0, 1, generator=gen))
        r.response_ids.append(tok)
        if feats is not None:
            ctx[i] = feats[i, : len(r.prompt_ids)].clone()
    active = [i for i, r in enumerate(recs) if not _finished(r, max_new_tokens, stop)]
    while active:
        seqs = [recs[j].prompt_ids + recs[j].response_ids for j in active]
        if isinstance(drafter, FeatureDrafter):
            drafted, q = drafter.propose(
                seqs, num_speculative_tokens, temperature, gen, features=[ctx[j] for j in active]
            )
        else:
            drafted, q = drafter.propose(seqs, num_speculative_tokens, temperature, gen)
        logits, feats = padded_forward(target, [s + d for s, d in zip(seqs, drafted)], indices)
        for i, (j, s, d) in enumerate(zip(active, seqs, drafted)):
            r = recs[j]
            p = sampling_probs(logits[i, len(s) - 1 : len(s) + len(d)], temperature) if temperature else None
            if p is None:  # greedy: keep real probabilities for the teacher log-probs
                real = torch.softmax(logits[i, len(s) - 1 : len(s) + len(d)], dim=-1)
                res = verify_block(real, q[i], d, 0.0, gen)
            else:
                res = verify_block(p, q[i], d, temperature, gen)
            r.anchor_pos.append(len(s) - 1)
            r.drafted.append(list(d))
            r.accepted.append(res.accepted)
            r.policy_version.append(policy_version)
            r.teacher_logprob_drafted.append(res.teacher_logprob_drafted)
            r.response_ids.extend(res.emitted)
            if feats is not None:  # exact for s + y_1..y_a; the correction/bonus token has no state yet
                ctx[j] = feats[i, : len(s) + res.accepted].clone()
            _truncate(r, max_new_tokens, stop)
        active = [j for j in active if not _finished(recs[j], max_new_tokens, stop)]
    return recs


def _truncate(r: RequestRecord, max_new_tokens: int, stop: frozenset[int]) -> None:
    """Cut the answer after its first stop id, then at ``max_new_tokens``; sets the finish reason."""
    first = next((j for j, t in enumerate(r.response_ids) if t in stop), None)
    if first is not None:
        r.response_ids = r.response_ids[: first + 1]
        r.finish_reason = "stop"
    if len(r.response_ids) >= max_new_tokens:
        r.response_ids = r.response_ids[:max_new_tokens]
        r.finish_reason = r.finish_reason or "length"


def _finished(r: RequestRecord, max_new_tokens: int, stop: frozenset[int]) -> bool:
    _truncate(r, max_new_tokens, stop)
    return r.finish_reason != ""


@torch.no_grad()
def target_generate(
    target: torch.nn.Module,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> list[list[int]]:
    """The target's own greedy decoding (one token per forward), the reference for lossless tests; an answer
    ends at the first of ``stop_token_ids``."""
    stop = frozenset(stop_token_ids)
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    while not all(done):
        idx = [i for i, d in enumerate(done) if not d]
        logits = padded_logits(target, [list(prompts[i]) + out[i] for i in idx])
        for j, i in enumerate(idx):
            tok = int(logits[j, len(prompts[i]) + len(out[i]) - 1].argmax())
            out[i].append(tok)
            if tok in stop or len(out[i]) >= max_new_tokens:
                done[i] = True
    return out

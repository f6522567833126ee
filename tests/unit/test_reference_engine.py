"""The PyTorch reference engine is lossless: greedy output equals the target's own greedy output, and sampled
output is distributed as the target's samples (chi-square test at significance 0.001)."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2
from transformers import LlamaForCausalLM

from draft_opd_ray.drafts.standalone.drafter import CausalLMDrafter
from draft_opd_ray.rollout.records import tau
from draft_opd_ray.rollout.reference import speculative_generate, target_generate
from draft_opd_ray.wire import consistency_error
from tests.helpers import tiny_lm

PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1, 3, 9], [6]]


@pytest.mark.parametrize("num_speculative_tokens", [1, 3, 5])
def test_greedy_equals_target_greedy(num_speculative_tokens: int) -> None:
    target, draft = tiny_lm(64, 0), tiny_lm(64, 1)
    want = target_generate(target, PROMPTS, max_new_tokens=24)
    recs = speculative_generate(
        target,
        CausalLMDrafter(draft),
        PROMPTS,
        num_speculative_tokens=num_speculative_tokens,
        max_new_tokens=24,
    )
    assert [r.response_ids for r in recs] == want
    for r in recs:
        assert consistency_error(r) is None, consistency_error(r)
        assert all(len(d) == num_speculative_tokens for d in r.drafted)


def test_cached_proposals_equal_full_recomputation() -> None:
    """The drafter's KV-cached, left-padded proposals = k full greedy forwards per prefix, and its q rows are the
    draft's softmax at each step (temperature 1)."""
    draft = tiny_lm(64, 1)
    drafted, q = CausalLMDrafter(draft).propose(PROMPTS, 4, 0.0, None)
    _, q1 = CausalLMDrafter(draft).propose(PROMPTS, 4, 1.0, torch.Generator().manual_seed(0))
    for b, p in enumerate(PROMPTS):
        cur = list(p)
        for j in range(4):
            with torch.no_grad():
                logits = draft(torch.tensor([cur])).logits[0, -1]
            assert drafted[b][j] == int(logits.argmax())
            assert q[b, j, drafted[b][j]] == 1.0
            cur.append(drafted[b][j])
        with torch.no_grad():
            first = torch.softmax(draft(torch.tensor([p])).logits[0, -1], -1)
        torch.testing.assert_close(q1[b, 0], first, atol=1e-5, rtol=1e-4)


def test_draft_equal_to_target_accepts_everything() -> None:
    target = tiny_lm(64, 0)
    recs = speculative_generate(
        target, CausalLMDrafter(target), PROMPTS, num_speculative_tokens=4, max_new_tokens=21
    )
    assert all(a == 4 for r in recs for a in r.accepted)
    assert tau(recs) == 5.0
    assert [r.response_ids for r in recs] == target_generate(target, PROMPTS, max_new_tokens=21)


def test_eos_stops_and_records_stay_consistent() -> None:
    target, draft = tiny_lm(64, 0), tiny_lm(64, 1)
    free = target_generate(target, PROMPTS[:1], max_new_tokens=30)[0]
    eos = free[7]  # a token the target emits: generation must stop right after it
    recs = speculative_generate(
        target,
        CausalLMDrafter(draft),
        PROMPTS[:1],
        num_speculative_tokens=3,
        max_new_tokens=30,
        stop_token_ids=(eos,),
    )
    resp = recs[0].response_ids
    assert resp == free[: free.index(eos) + 1] and recs[0].finish_reason == "stop"
    assert consistency_error(recs[0]) is None


def exact_joint(
    target: LlamaForCausalLM, prompt: list[int], n: int, vocab: int
) -> dict[tuple[int, ...], float]:
    """P(t_1..t_n | prompt) for every outcome, by enumeration of the target at temperature 1."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pp in probs.items():
            with torch.no_grad():
                logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -1].float()
            p = torch.softmax(logits, -1)
            for t in range(vocab):
                nxt[prefix + (t,)] = pp * float(p[t])
        probs = nxt
    return probs


def test_sampling_matches_target_distribution() -> None:
    vocab, n_tok, samples = 6, 3, 12000
    target, draft = tiny_lm(vocab, 0), tiny_lm(vocab, 3)
    with torch.no_grad():  # moderate temperature: every outcome has some mass
        target.lm_head.weight.div_(15)
        draft.lm_head.weight.div_(15)
    prompt = [1, 2]
    exact = exact_joint(target, prompt, n_tok, vocab)
    recs = speculative_generate(
        target,
        CausalLMDrafter(draft),
        [prompt] * samples,
        num_speculative_tokens=2,
        max_new_tokens=n_tok,
        temperature=1.0,
        seed=7,
    )
    counts = dict.fromkeys(itertools.product(range(vocab), repeat=n_tok), 0)
    for r in recs:
        counts[tuple(r.response_ids)] += 1
    # pool outcomes with expected count < 5 into one bin, then Pearson chi-square
    obs, exp, tail_o, tail_e = [], [], 0, 0.0
    for key, p in exact.items():
        e = p * samples
        if e < 5:
            tail_o, tail_e = tail_o + counts[key], tail_e + e
        else:
            obs.append(counts[key])
            exp.append(e)
    if tail_e > 0:
        obs.append(tail_o)
        exp.append(tail_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    p_value = chi2.sf(stat, len(obs) - 1)
    assert p_value > 1e-3, (stat, len(obs), p_value)
    # the draft is a different model, so some proposals were rejected: the residual path was exercised
    assert any(a < 2 for r in recs for a in r.accepted)

"""EAGLE-3 and DFlash drafters in the PyTorch reference engine.

On a tiny random target (64-token vocabulary) with drafts fitted for a few steps to its greedy output (so they
accept sometimes), the batched engine, which hands the drafter the target states of its own verification pass, is
lossless, writes consistent records and accepts exactly what a one-sequence loop with freshly computed features
accepts. (The reference engine against vLLM: tests/integration/test_reference_vs_vllm.py.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from draft_opd_ray.drafts.dflash.drafter import DFlashDrafter
from draft_opd_ray.drafts.dflash.model import DFlashConfig, DFlashDraft
from draft_opd_ray.drafts.drafter import FeatureDrafter
from draft_opd_ray.drafts.eagle3.drafter import Eagle3Drafter
from draft_opd_ray.drafts.eagle3.model import Eagle3Config, Eagle3Draft
from draft_opd_ray.drafts.standalone.drafter import CausalLMDrafter
from draft_opd_ray.rollout.reference import speculative_generate, target_generate
from draft_opd_ray.wire import consistency_error
from tests.helpers import fit_dflash, fit_eagle3, greedy_spec_decode, target_pass, tiny_lm

NUM_SPECULATIVE_TOKENS = 4


V, H = 64, 32
PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1, 3, 9], [6, 11, 30]]
NEW = 24


@pytest.fixture(scope="module")
def tiny_lm_case() -> tuple[LlamaForCausalLM, dict]:
    """A sharp random 4-layer target (varied greedy text) and one pass over its greedy continuations of PROMPTS."""
    target = tiny_lm(V, 0, hidden=H, layers=4)
    outs = target_generate(target, PROMPTS, max_new_tokens=NEW)
    batch = target_pass(target, [p + o for p, o in zip(PROMPTS, outs)], [len(p) for p in PROMPTS])
    return target, batch


def tiny_eagle3(target: LlamaForCausalLM) -> Eagle3Draft:
    c = Eagle3Config(
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=H // 4,
        intermediate_size=2 * H,
        vocab_size=V,
        draft_vocab_size=V,
        aux_layer_ids=(1, 2, 3),
        rope_theta=float(target.config.rope_parameters["rope_theta"]),
    )
    torch.manual_seed(1)
    return Eagle3Draft(c, target.model.embed_tokens.weight.detach())


def tiny_dflash(target: LlamaForCausalLM) -> DFlashDraft:
    c = DFlashConfig(
        hidden_size=H,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=H // 4,
        intermediate_size=2 * H,
        vocab_size=V,
        block_size=NUM_SPECULATIVE_TOKENS + 1,
        mask_token_id=V - 1,
        target_layer_ids=(0, 2),
        rope_theta=float(target.config.rope_parameters["rope_theta"]),
    )
    torch.manual_seed(2)
    return DFlashDraft(c, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach())


def sequential_decode(
    target: torch.nn.Module,
    drafter: FeatureDrafter,
    prompt: list[int],
    num_speculative_tokens: int,
    max_new: int,
) -> tuple[list[int], list[int]]:
    """One request, greedy; the drafter computes its own features each step. (response, accepted per step)."""
    return greedy_spec_decode(
        target,
        lambda seq: drafter.propose([seq], num_speculative_tokens, 0.0, None)[0][0],
        prompt,
        max_new,
        num_speculative_tokens,
    )


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_feature_drafters_are_lossless_and_reuse_verification_states(tiny_lm_case, kind: str) -> None:
    target, batch = tiny_lm_case
    drafter: Eagle3Drafter | DFlashDrafter
    if kind == "eagle3":
        drafter = Eagle3Drafter(target, fit_eagle3(tiny_eagle3(target), batch, steps=30, lr=3e-3))
    else:
        drafter = DFlashDrafter(target, fit_dflash(tiny_dflash(target), batch, steps=20, lr=3e-3, anchors=16))
    assert isinstance(drafter, FeatureDrafter)
    recs = speculative_generate(
        target, drafter, PROMPTS, num_speculative_tokens=NUM_SPECULATIVE_TOKENS, max_new_tokens=NEW
    )
    assert [r.response_ids for r in recs] == target_generate(target, PROMPTS, max_new_tokens=NEW)
    for r, p in zip(recs, PROMPTS):
        assert consistency_error(r) is None, consistency_error(r)
        # batched, padded, states from the verification pass == one sequence, states recomputed each step
        assert r.accepted == sequential_decode(target, drafter, p, NUM_SPECULATIVE_TOKENS, NEW)[1]
    accepted = [a for r in recs for a in r.accepted]
    assert any(a > 0 for a in accepted) and any(a < NUM_SPECULATIVE_TOKENS for a in accepted), (
        accepted
    )  # not vacuous


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_feature_drafters_sample_consistent_records(tiny_lm_case, kind: str) -> None:
    target, _ = tiny_lm_case
    drafter = (
        Eagle3Drafter(target, tiny_eagle3(target))
        if kind == "eagle3"
        else DFlashDrafter(target, tiny_dflash(target))
    )
    recs = speculative_generate(
        target,
        drafter,
        PROMPTS,
        num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
        max_new_tokens=NEW,
        temperature=1.0,
        stop_token_ids=(3,),
        seed=5,
    )
    for r in recs:
        assert consistency_error(r) is None, consistency_error(r)
        assert all(len(d) == NUM_SPECULATIVE_TOKENS for d in r.drafted)


def test_dflash_block_bounds_k(tiny_lm_case) -> None:
    target, _ = tiny_lm_case
    with pytest.raises(ValueError, match="block_size - 1"):
        speculative_generate(
            target,
            DFlashDrafter(target, tiny_dflash(target)),
            PROMPTS,
            num_speculative_tokens=NUM_SPECULATIVE_TOKENS + 1,
            max_new_tokens=4,
        )
    assert not isinstance(CausalLMDrafter(target), FeatureDrafter)

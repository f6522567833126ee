"""FLOPs formulas against a brute-force count (torch's FlopCounterMode) on tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from draft_opd_ray.drafts.eagle3.model import Eagle3Config, Eagle3Draft
from draft_opd_ray.flops import eagle3_train_flops, model_config_info, target_forward_flops
from draft_opd_ray.models.target import read_target_info

CFG = Eagle3Config(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=300,
    draft_vocab_size=120,
    aux_layer_ids=(1, 2, 3),
)


@pytest.mark.parametrize("ttt_steps", [1, 3])
@pytest.mark.parametrize("lm_head_trainable", [False, True])
def test_eagle3_train_flops_match_flop_counter(ttt_steps: int, lm_head_trainable: bool) -> None:
    torch.manual_seed(0)
    model = Eagle3Draft(CFG)
    model.lm_head.weight.requires_grad_(lm_head_trainable)
    B, T = 2, 10
    ids = torch.randint(0, CFG.vocab_size, (B, T))
    feats = torch.randn(B, T, 3 * CFG.hidden_size)
    with FlopCounterMode(display=False) as fwd:
        out = model(ids, feats, ttt_steps=ttt_steps)
    loss = sum(o.float().pow(2).mean() for o in out)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()  # type: ignore[union-attr]
    want = eagle3_train_flops(CFG, B, T, ttt_steps, lm_head_trainable=lm_head_trainable)
    assert fwd.get_total_flops() == want.forward
    assert bwd.get_total_flops() == want.backward


def test_target_forward_flops_match_flop_counter(tiny_target: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(tiny_target), dtype=torch.float32, attn_implementation="sdpa"
    )
    ids = torch.randint(3, 1000, (2, 12))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(input_ids=ids)
    want = target_forward_flops(read_target_info(tiny_target), 2, 12)
    assert fc.get_total_flops() == pytest.approx(want, rel=0.01)
    # the same shapes read off the loaded model (how the standalone student and recipe count)
    assert target_forward_flops(model_config_info(model), 2, 12) == want


def test_six_p_t_rule_of_thumb() -> None:
    """Without attention and fc, a trained layer + frozen head is (6 P_layer + 4 P_head) per token-step."""
    c = Eagle3Config(**{**CFG.__dict__, "aux_layer_ids": (1,)})
    f = eagle3_train_flops(c, 1, 1, 1)
    H = c.hidden_size
    layer_p = 2 * H * (64 + 2 * 32) + 64 * H + 3 * H * c.intermediate_size
    attn = 4 * 4 * 16 * 1
    assert f.total == 6 * layer_p + 4 * H * c.draft_vocab_size + 3 * attn + 4 * H * H


def test_eagle3_block_flops_match_flop_counter() -> None:
    """The student side of Draft-OPD: block_hidden over all anchors + the frozen head at the block positions."""
    from draft_opd_ray.flops import eagle3_block_flops

    torch.manual_seed(0)
    model = Eagle3Draft(CFG)
    model.lm_head.weight.requires_grad_(False)
    T, N, K = 24, 5, 4
    ids = torch.randint(0, CFG.vocab_size, (1, T))
    feats = torch.randn(1, T, 3 * CFG.hidden_size)
    anchors = torch.tensor([[3, 7, 11, 15, 19]])
    drafted = torch.randint(0, CFG.vocab_size, (1, N, K))
    with FlopCounterMode(display=False) as fwd:
        logits = model.lm_head(model.block_hidden(ids, feats, anchors, drafted))
    with FlopCounterMode(display=False) as bwd:
        logits.float().pow(2).mean().backward()
    want = eagle3_block_flops(CFG, T, N, K)
    assert fwd.get_total_flops() == pytest.approx(want.forward, rel=0.03)
    assert bwd.get_total_flops() == pytest.approx(want.backward, rel=0.03)


def test_feature_pass_flops_match_flop_counter(tiny_target: Path) -> None:
    """SFT's target forward as `sft/features.py` runs it (the decoder over the padded batch, the LM head on the
    rows its losses read) is what `feature_pass_flops` charges a batch, with the loss rows of `mask_batch`."""
    from transformers import AutoModelForCausalLM

    from draft_opd_ray.flops import feature_pass_flops
    from draft_opd_ray.sft.features import target_features
    from draft_opd_ray.sft.trainer import mask_batch

    model = AutoModelForCausalLM.from_pretrained(
        str(tiny_target), dtype=torch.float32, attn_implementation="sdpa"
    )
    g = torch.Generator().manual_seed(0)
    lengths, prompt_lens = [12, 9, 7], [5, 3, 6]
    seqs = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        target_features(model, seqs, [1], torch.arange(256), 4, prompt_lens)
    rows = int(mask_batch(lengths, prompt_lens)["loss_mask"].sum())
    info = read_target_info(tiny_target)
    want = feature_pass_flops(info, len(seqs), max(lengths), rows)
    assert fc.get_total_flops() == pytest.approx(want, rel=0.01)
    assert want < target_forward_flops(info, len(seqs), max(lengths))  # the head on every padded row: more


def test_sft_charges_each_answers_target_forward_once_unless_on_the_fly() -> None:
    from draft_opd_ray.sft.trainer import target_charge

    assert target_charge("cache", continued=False) == "none"  # charged up front, with the cache
    assert target_charge("cache", continued=True) == "first_epoch"  # a continued draft: where first used
    assert target_charge("on_the_fly", continued=False) == "every_batch"  # the target runs again each epoch
    assert target_charge("on_the_fly", continued=True) == "every_batch"

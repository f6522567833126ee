"""SFT recipes, losses and batches on a tiny random target: EAGLE-3 target init reproduces the target's layer, the
TTT loss on response anchors equals full-row TTT, features and soft labels match, every kind's recipe builds,
exports and counts its FLOPs; the standalone loss equals a direct soft cross-entropy; trajectories, schedules and
cache keys. (Training through DeepSpeed: tests/integration/test_sft_deepspeed.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.drafts.eagle3.model import init_eagle3
from draft_opd_ray.drafts.eagle3.recipe import (
    draft_vocab_counts,
    init_from_target,
    ttt_anchors,
    ttt_topk_loss,
)
from draft_opd_ray.drafts.recipe import RecipeInputs
from draft_opd_ray.drafts.registry import draft_kind
from draft_opd_ray.optim import lr_factor
from draft_opd_ray.sft.data import (
    Trajectory,
    _write,
    answer_trajectories,
    mix_trajectories,
    read_trajectories,
)
from draft_opd_ray.sft.features import SeqFeatures, load_hf_target, target_features
from draft_opd_ray.sft.trainer import collate


def test_trajectory_parquet_round_trip(trajectories: Path) -> None:
    rows = read_trajectories(trajectories)
    assert len(rows) == 2 and len(rows[0].prompt_ids) == 8 and len(rows[0].response_ids) == 24


def test_target_init_reproduces_the_target_layer(tiny_target: Path) -> None:
    """Step 0 of a target-initialised head = the target's hidden state after the high aux layer."""
    hf = load_hf_target(tiny_target, torch.float32)
    model = init_eagle3(tiny_target)
    init_from_target(model, tiny_target)
    ids = torch.randint(3, 300, (1, 12))
    hs = hf(input_ids=ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i] for i in model.config.aux_layer_ids], -1)
    h = model(ids, feats, ttt_steps=1)[0]  # logits of step 0
    hi = model.config.aux_layer_ids[-1]
    want = model.lm_head(model.norm(hs[hi + 1]))
    torch.testing.assert_close(h, want, atol=5e-3, rtol=5e-3)


def test_features_topk_renormalised(tiny_target: Path) -> None:
    hf = load_hf_target(tiny_target, torch.float32)
    draft_ids = torch.arange(0, 512, 2)
    (f, idx, p, top1), _ = target_features(hf, [[5, 6, 7, 8], [9, 10]], (1, 2), draft_ids, topk=4)
    assert f.shape == (4, 2 * hf.config.hidden_size) and idx.shape == p.shape == (4, 4) and top1.shape == (4,)
    torch.testing.assert_close(p.sum(-1), torch.ones(4))
    assert int(idx.max()) < draft_ids.numel()


def test_kv_cache_for_a_chunk_holds_its_longest_requests(tiny_target: Path) -> None:
    """Brute force: bytes of K and V over every layer and kv head for the chunk's longest prompt + answer."""
    from draft_opd_ray.sft.data import kv_cache_gb_for

    c = json.loads((tiny_target / "config.json").read_text())
    per_tok = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"]
    prompts = [[1] * n for n in (5, 50, 20, 7)]
    want = 1.1 * per_tok * 2 * ((50 + 10) + (20 + 10)) / 1e9  # bf16, the 2 longest
    assert kv_cache_gb_for(tiny_target, prompts, 2, 10, "bfloat16") == pytest.approx(want)
    assert kv_cache_gb_for(tiny_target, prompts, 2, 10, "float32") == pytest.approx(2 * want)
    assert kv_cache_gb_for(tiny_target, [range(10**9)], 1, 1, "float32") == 8.0  # capped (a 1e9-token prompt)


def test_features_head_only_on_scored_rows(tiny_target: Path) -> None:
    """With prompt lengths, the soft labels of rows >= prompt_len - 1 equal the full forward's; others are zero."""
    hf = load_hf_target(tiny_target, torch.float32)
    draft_ids = torch.arange(0, 512, 2)
    seqs, plens = [[5, 6, 7, 8, 9, 11], [9, 10, 12]], [3, 1]
    full = target_features(hf, seqs, (1, 2), draft_ids, topk=4)
    part = target_features(hf, seqs, (1, 2), draft_ids, topk=4, prompt_lens=plens)
    for p, a, b in zip(plens, full, part):
        torch.testing.assert_close(a[0], b[0])  # features on every row
        for x, y in zip(a[1:], b[1:]):
            torch.testing.assert_close(x[p - 1 :], y[p - 1 :])
            assert not y[: max(0, p - 1)].any()
    logits = hf(input_ids=torch.tensor([seqs[0]])).logits[0]  # brute force: the HF forward's own head
    assert full[0][3].tolist() == logits.argmax(-1).tolist()


def _full_row_ttt_loss(model, b: dict, steps: int, decay: float) -> torch.Tensor:
    """Brute force: TTT over every row of the sequence (``Eagle3Draft.forward``), masked to the loss rows."""
    logits = model(b["input_ids"], b["features"], ttt_steps=steps, attention_mask=b["attention_mask"])
    T, total = b["input_ids"].shape[1], torch.zeros(())
    for i, lg in enumerate(logits):
        n = T - i - 1
        logq = torch.log_softmax(lg[:, :n].float(), -1)
        m = b["loss_mask"][:, i + 1 :].float()
        ce = -(b["topk_p"][:, i + 1 :] * logq.gather(-1, b["topk_ids"][:, i + 1 :])).sum(-1)
        total = total + decay**i * (ce * m).sum() / m.sum().clamp_min(1.0)
    return total


def seq_features(
    ids: torch.Tensor,
    prompt_len: int,
    width: int,
    vd: int,
    g: torch.Generator,
    top1: torch.Tensor | None = None,
) -> SeqFeatures:
    """One cached trajectory with random features (width A*H) and random top-4 soft labels over ``vd`` ids."""
    n = len(ids)
    feats = torch.randn(n, width, generator=g)
    topk_ids = torch.randint(0, vd, (n, 4), generator=g)
    topk_p = torch.softmax(torch.randn(n, 4, generator=g), -1)
    top1 = torch.randint(3, 300, (n,), generator=g) if top1 is None else top1
    return SeqFeatures(ids, prompt_len, feats, topk_ids, topk_p, top1)


def test_ttt_loss_on_response_anchors_equals_full_row_ttt(tiny_target: Path) -> None:
    """The SFT loss unrolls only from rows that are scored; value and gradients equal full-sequence TTT."""
    g = torch.Generator().manual_seed(3)
    model = init_eagle3(tiny_target, draft_vocab_size=128, token_counts=torch.arange(49152, 0, -1))
    A_H = len(model.config.aux_layer_ids) * model.config.hidden_size
    items = [  # lengths, prompt lengths (one response of a single token)
        seq_features(torch.randint(3, 300, (n,), generator=g), p, A_H, 128, g)
        for n, p in ((20, 7), (13, 2), (17, 16))
    ]
    b = collate(items, torch.float32)
    anchor, valid = ttt_anchors(b["loss_mask"], 3)
    # sequence 0: loss rows 6..19 -> anchors 4..19 (two prompt rows score later steps); padding after
    assert anchor[0, : int(valid[0].sum())].tolist() == list(range(4, 20))
    assert not bool(valid[1, 12:].any()) and anchor[2, : int(valid[2].sum())].tolist() == list(range(13, 17))
    for steps in (1, 3):
        model.zero_grad()
        want = _full_row_ttt_loss(model, b, steps, 0.8)
        want.backward()
        g_want = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad()
        got, metrics = ttt_topk_loss(model, b, steps, 0.8)
        got.backward()
        g_got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert len(g_got) == len(g_want) and all(
            torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(g_got, g_want)
        )
        assert set(metrics) == {f"{k}_{i}" for k in ("loss", "acc") for i in range(steps)}


def test_eagle3_recipe_counts_the_flops_it_runs(tiny_target: Path) -> None:
    """The EAGLE-3 recipe's FLOPs per step = what the TTT loss's matmuls do (torch's FLOP counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (30, 22)]
    draft = DraftConfig(draft_vocab_size=256, ttt_steps=3)
    recipe = draft_kind(draft.kind).recipe(tiny_target, draft, RecipeInputs(seqs, [12, 5]))
    A_H = len(recipe.feature_ids) * recipe.model.config.hidden_size
    items = [
        seq_features(torch.tensor(s), p, A_H, 256, g, top1=torch.tensor(s)) for s, p in zip(seqs, (12, 5))
    ]
    b = collate(items, torch.float32)
    with FlopCounterMode(display=False) as counter:
        loss, _ = recipe.loss(recipe.model, b)
        loss.backward()
    assert recipe.flops(b) == pytest.approx(counter.get_total_flops(), rel=0.05)


@pytest.mark.parametrize("kind", ["eagle3", "standalone", "dflash"])
def test_every_kind_builds_its_recipe_and_exports_what_its_loader_reads(
    tiny_target: Path, tmp_path: Path, kind: str
) -> None:
    """`draft_kind(draft.kind).recipe` builds the kind's recipe (the kinds table): the draft, the features it conditions on (HF
    hidden_states indices), the label vocabulary, a finite loss with gradients and positive FLOPs on a collated
    batch, and a saved folder that the kind's loader reads back with identical weights; ``start_from`` that
    folder continues from those weights."""
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (18, 11)]
    draft = DraftConfig(
        kind=kind, draft_vocab_size=256, ttt_steps=2, num_layers=2, block_size=5, num_speculative_tokens=4
    )
    recipe = draft_kind(kind).recipe(tiny_target, draft, RecipeInputs(seqs, [6, 4]))
    assert recipe.kind == kind
    if kind == "standalone":
        assert recipe.feature_ids == () and recipe.model.config.num_hidden_layers == 2
    else:
        assert recipe.feature_ids == tuple(recipe.model.hidden_state_indices)
    vd = 256 if kind == "eagle3" else 49152
    assert recipe.label_ids.shape == (vd,)
    width = len(recipe.feature_ids) * 64
    b = collate([seq_features(torch.tensor(s), p, width, vd, g) for s, p in zip(seqs, (6, 4))], torch.float32)
    loss, _ = recipe.loss(recipe.model, b)
    loss.backward()
    assert torch.isfinite(loss) and recipe.flops(b) > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in recipe.model.parameters())
    out = recipe.save(recipe.model, tmp_path / "d", tiny_target)
    trained = {n: p for n, p in recipe.model.named_parameters() if p.requires_grad}
    for model in (
        draft_kind(kind).load(out, tiny_target),
        draft_kind(kind).recipe(tiny_target, draft, RecipeInputs(seqs, [6, 4], start_from=out)).model,
    ):
        sd = model.state_dict()
        assert trained and all(torch.equal(sd[n], p) for n, p in trained.items())


def test_draft_vocabulary_counts_response_tokens_only() -> None:
    seqs, plens = [[1, 2, 3, 3, 5], [2, 2, 7]], [2, 1]
    counts = draft_vocab_counts(seqs, plens, 9)
    assert counts.tolist() == [0, 0, 1, 2, 0, 1, 0, 1, 0]  # 3, 3, 5 and 2, 7


def test_schedule_counts_tokens_not_minutes() -> None:
    from draft_opd_ray.sft.trainer import schedule_progress

    # the budget is trained tokens: the schedule depends on the data seen, never on the wall clock
    assert schedule_progress(0, 1000, 0, 1_000_000) == 0.0
    assert schedule_progress(10, 1000, 500_000, 1_000_000) == pytest.approx(0.5)
    assert schedule_progress(900, 1000, 100_000, 1_000_000) == pytest.approx(0.9)  # epochs can lead
    assert schedule_progress(10, 1000, 2_000_000, 1_000_000) == 1.0
    assert schedule_progress(250, 1000, 123, None) == pytest.approx(0.25)  # no token budget: epochs
    # a FLOPs budget (the matched-FLOPs arm) ends the schedule with training
    assert schedule_progress(5, 10**6, 10, None, 3e12, 1e13) == pytest.approx(0.3)


def test_an_epoch_cap_before_the_token_budget_is_named() -> None:
    """`sft.epochs` is a guard; when it would end training before `sft.train_tokens` the trainer says so after the
    first epoch, with the epochs the budget needs (a 5.12M-token plateau once stopped at 20 epochs = 3.21M)."""
    from draft_opd_ray.sft.trainer import epoch_cap_note

    note = epoch_cap_note(160_614, 1, 20, 5_120_000)
    assert note is not None and "~3,212,280 trained tokens" in note and "set sft.epochs=32" in note
    assert epoch_cap_note(160_614, 1, 32, 5_120_000) is None  # the budget fits
    assert epoch_cap_note(160_614, 1, 20, None) is None  # no token budget: epochs are the budget
    assert epoch_cap_note(0, 0, 20, 5_120_000) is None  # no epoch finished yet


def test_progress_bar_counts_the_budget_that_ends_training() -> None:
    """The matched-FLOPs arm's bar counts FLOPs (its ETA was the 1,000-epoch guard's, "51 h", for a 3-minute run);
    a token budget counts tokens; epochs alone count steps."""
    from draft_opd_ray.sft.trainer import Budget, TrainState, progress_measure

    state = TrainState(step=10, tokens=4000, flops_draft=2e12, flops_target=5e12)
    assert progress_measure(state, Budget(None, 20, max_flops=1e13), 640_000, 0.0) == (
        1e13,
        7e12,
        "FLOP",
    )
    assert progress_measure(state, Budget(8000, 20), 640_000, 1e12) == (8000, 4000, "tok")
    assert progress_measure(state, Budget(None, 20), 640, 0.0) == (640, 10, "step")


def test_lr_schedule() -> None:
    assert lr_factor(0.0, 0.1, "cosine") < 0.01 and lr_factor(0.1, 0.1, "cosine") == pytest.approx(1.0)
    assert lr_factor(1.0, 0.1, "cosine") == pytest.approx(0.1) and lr_factor(0.5, 0.0, "constant") == 1.0


def test_stage_logs_trainer_rows_through_the_run_logger(tmp_path: Path) -> None:
    """The trainer's rows carry stage/step/time of their own; the run's MetricsLogger must not clash."""
    from draft_opd_ray.metrics import MetricsLogger, read_metrics
    from draft_opd_ray.sft.stage import log_sft_row

    m = MetricsLogger(tmp_path, wandb_mode="disabled", project="t", entity=None, config={})
    log_sft_row(m, {"stage": "sft", "step": 3, "time": 1.0, "loss": 2.5, "acc_0": 0.5})
    m.close()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row["stage"] == "sft" and row["step"] == 3 and row["loss"] == 2.5 and row["acc_0"] == 0.5


def test_standalone_kd_loss_is_soft_cross_entropy(tiny_target: Path) -> None:
    import tempfile

    from draft_opd_ray.drafts.standalone.model import build_standalone_from_target, load_standalone
    from draft_opd_ray.drafts.standalone.recipe import standalone_kd_loss

    with tempfile.TemporaryDirectory() as d:
        lm = load_standalone(build_standalone_from_target(tiny_target, d, layer_ids=(0, 3)), tiny_target)
    g = torch.Generator().manual_seed(0)
    B, T, k, V = 2, 7, 4, lm.config.vocab_size
    batch = {
        "input_ids": torch.randint(3, 300, (B, T), generator=g),
        "attention_mask": torch.ones(B, T, dtype=torch.bool),
        "loss_mask": torch.rand(B, T, generator=g) > 0.3,
        "topk_ids": torch.randint(0, V, (B, T, k), generator=g),
        "topk_p": torch.softmax(torch.randn(B, T, k, generator=g), -1),
        "top1": torch.randint(0, V, (B, T), generator=g),
    }
    batch["attention_mask"][1, 5:] = False
    batch["loss_mask"] &= batch["attention_mask"]
    loss, _ = standalone_kd_loss(lm, batch, chunk_rows=3)
    with torch.no_grad():
        logq = torch.log_softmax(
            lm(batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits, -1
        )
        ce = -(batch["topk_p"] * logq.gather(-1, batch["topk_ids"])).sum(-1)
        want = ce[batch["loss_mask"]].mean()
    assert torch.allclose(loss, want, atol=1e-5)


def test_dataset_answers_become_trajectories_and_mix(embedded_target: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_target)
    rows = answer_trajectories(
        [[5, 6], [7], [8]], ["Hello there, friend.", "x " * 50, ""], tok, max_new_tokens=20, eos_token_id=2
    )
    assert len(rows) == 2  # the empty answer is dropped
    assert rows[0].prompt_ids == [5, 6]
    assert rows[0].response_ids == [*tok("Hello there, friend.", add_special_tokens=False)["input_ids"], 2]
    assert len(rows[1].response_ids) == 20 and 2 not in rows[1].response_ids  # cut: no end token
    with pytest.raises(ValueError, match="2 prompts but 1 answers"):
        answer_trajectories([[1], [2]], ["a"], tok, max_new_tokens=4, eos_token_id=2)
    base = tmp_path / "base.parquet"
    _write(base, [Trajectory([1, 2], [3, 4])])
    mixed = mix_trajectories(base, rows, tmp_path / "cache")
    assert read_trajectories(mixed) == [Trajectory([1, 2], [3, 4]), *rows]
    assert mix_trajectories(base, rows, tmp_path / "cache") == mixed  # keyed: written once
    assert mix_trajectories(base, [], tmp_path / "cache") == base


def test_standalone_layers_drop_the_middle_of_the_stack() -> None:
    from draft_opd_ray.drafts.standalone.recipe import standalone_layer_ids

    assert standalone_layer_ids(20, 30) == (*range(10), *range(20, 30))
    assert standalone_layer_ids(3, 30) == (0, 1, 29)
    assert standalone_layer_ids(1, 30) == (0,)
    assert standalone_layer_ids(29, 30) == (*range(15), *range(16, 30))
    with pytest.raises(ValueError, match="1..29 layers"):
        standalone_layer_ids(30, 30)


def test_trajectory_cache_key_names_the_generation_precision(embedded_target: Path) -> None:
    import hashlib

    from draft_opd_ray.sft.data import _target_fingerprint, cache_key

    target = embedded_target
    prompts = [[1, 2, 3], [4]]
    f32 = cache_key(target, prompts, 256, (2,))
    # float32 keys are the ones written before the setting existed: old caches stay valid
    h = hashlib.sha256(_target_fingerprint(target).encode())
    h.update(json.dumps({"max_new_tokens": 256, "stop": [2], "temperature": 0}).encode())
    for p in prompts:
        h.update(json.dumps(p).encode())
    assert f32 == h.hexdigest()[:20] == cache_key(target, prompts, 256, (2,), "float32")
    assert cache_key(target, prompts, 256, (2,), "bfloat16") != f32


def test_warm_start_key_names_what_changes_the_draft() -> None:
    """The warm start's cache key moves with every setting that changes the trained draft (here the lr, a study
    budget, the draft vocabulary as written, the prompts, the stop ids) and not with reuse or the extra exports."""
    import dataclasses

    from draft_opd_ray.config.schema import Config, DraftConfig, SFTStudyConfig
    from draft_opd_ray.sft.stage import _key

    cfg = Config()

    def sft(**kw: Any) -> Config:
        return dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, **kw))

    base = _key(cfg, "t", [[5, 6]], (2,))
    assert _key(sft(reuse=False, study=SFTStudyConfig(curve_tokens=[100])), "t", [[5, 6]], (2,)) == base
    replay_teacher = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, source="replay"))
    assert _key(replay_teacher, "t", [[5, 6]], (2,)) == base  # where Draft-OPD takes its teacher: not SFT's
    others = [
        dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, topk=8)),
        sft(lr=2e-3),
        sft(study=SFTStudyConfig(max_flops=1e12)),
        dataclasses.replace(cfg, draft=DraftConfig(draft_vocab_size=8192)),
    ]
    assert all(_key(c, "t", [[5, 6]], (2,)) != base for c in others)
    assert _key(cfg, "t", [[5]], (2,)) != base and _key(cfg, "t", [[5, 6]], (2, 3)) != base


def test_a_retrained_warm_start_replaces_the_cached_one_whole(tmp_path: Path) -> None:
    """`sft.reuse=false` retrains a warm start the cache already holds: the new folder takes its place whole (a
    folder cannot be renamed over a full one), and no temporary folder is left beside it."""
    from draft_opd_ray.sft.stage import cache_warm_start

    warm = tmp_path / "warm_starts" / "key" / "draft"
    for version in ("first", "second"):
        trained = tmp_path / version
        trained.mkdir()
        (trained / "config.json").write_text(version)
        (trained / f"{version}.safetensors").write_text(version)
        cache_warm_start(trained, warm)
        assert (warm / "config.json").read_text() == version
    assert sorted(p.name for p in warm.iterdir()) == ["config.json", "second.safetensors"]
    assert sorted(p.name for p in warm.parent.iterdir()) == ["draft"]

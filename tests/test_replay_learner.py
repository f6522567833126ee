"""Replay (teacher on the draft's own blocks, branches packed into one tree-masked forward) against naive
per-anchor forwards, and the DeepSpeed learner stepping each draft kind's student on the acceptance-aware
objective (the standalone student's block distributions against naive per-position forwards)."""

from __future__ import annotations

import random

import pytest
import torch

from draft_opd_ray.algo.loss import LossSpec
from draft_opd_ray.opd.batch import ReplayItem
from draft_opd_ray.opd.replay import ReplayActor


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from draft_opd_ray.models.eagle3 import init_eagle3, save_eagle3
    from draft_opd_ray.models.target import ensure_embedded_target
    from draft_opd_ray.models.tiny import build_tiny_target
    from draft_opd_ray.rollout.reference import target_generate

    target = build_tiny_target(
        tmp_path_factory.mktemp("t"), tokenizer_from=ensure_embedded_target(), head_dim=32
    )
    draft = save_eagle3(init_eagle3(target, aux_layer_ids=[0, 1, 2]), tmp_path_factory.mktemp("d"), target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt = [1, 45, 900, 12, 7, 300]
    resp = target_generate(model, [prompt], max_new_tokens=24)[0]
    seq = prompt + resp
    rng = random.Random(0)
    K = 4
    anchors, drafted, accepted = [], [], []
    for n, a in [(6, 0), (9, 2), (14, 4), (20, 1), (24, 3)]:  # (anchor position, accepted)
        y = seq[n + 1 : n + 1 + a] + [rng.randrange(100, 40000) for _ in range(K - a)]
        anchors.append(n)
        drafted.append(y[:K])
        accepted.append(a)
    item = ReplayItem(seq, anchors, drafted, accepted, policy_version=0)
    return target, draft, model, item, K


def test_teacher_matches_naive_per_anchor_forward(setup) -> None:
    target, _, model, item, K = setup
    replay = ReplayActor(str(target), aux_layer_ids=[0, 1, 2], draft_ids=None, k=K)
    (t,) = replay.score([item])
    for j, (n, y, a) in enumerate(zip(item.anchor_pos, item.drafted, item.accepted)):
        kk = int(t.valid_len[j])
        for k in range(1, kk + 1):  # p_k = target(x_{<=n} y_{<k}), one full forward each (the naive way)
            ctx = item.input_ids[: n + 1] + y[: k - 1]
            with torch.no_grad():
                want = torch.log_softmax(model(torch.tensor([ctx])).logits[0, -1], -1)
            assert torch.allclose(t.teacher_logprobs[j, k - 1], want, atol=1e-4), (j, k)
        assert int(t.replay_accepted[j]) == a  # greedy target output: drafts agree exactly up to a
    assert t.features.shape == (len(item.input_ids), 3 * model.config.hidden_size)
    assert t.valid_len.tolist() == [4, 4, 4, 4, 4]


def test_learner_steps_and_loss_decreases(setup) -> None:
    from draft_opd_ray.opd.learner import Learner

    target, draft, _, item, K = setup
    replay = ReplayActor(str(target), aux_layer_ids=[0, 1, 2], draft_ids=None, k=K)
    batch = replay.score([item])
    spec = LossSpec(
        gamma=0.8,
        lambda_acc=1.0,
        lambda_rej=1.0,
        rejected_scope="all",
        estimator="full",
        directions="mixed",
        clamp=10.0,
        vocab_chunk=8192,
    )
    learner = Learner(
        str(draft),
        str(target),
        spec=spec,
        lr=3e-3,
        betas=[0.9, 0.95],
        weight_decay=0.0,
        warmup_ratio=0.0,
        schedule="constant",
        total_steps=10,
        zero_stage=0,
        grad_clip=1.0,
    )
    before = learner.rollout_state()
    losses = [learner.step(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses
    after = learner.rollout_state()
    assert set(before) == set(after) and "embed_tokens.weight" not in after
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert learner.version == 4


def test_topk_payload_is_the_full_teacher_top_k_and_trains(setup) -> None:
    """payload=topk ships the top k of the same teacher distributions, is far smaller, and the learner steps on
    it with loss.estimator=topk (the estimator itself is checked against brute force in test_loss.py)."""
    from draft_opd_ray.opd.learner import Learner
    from draft_opd_ray.opd.batch import payload_bytes

    target, draft, _, item, K = setup
    (full,) = ReplayActor(str(target), aux_layer_ids=[0, 1, 2], draft_ids=None, k=K).score([item])
    (top,) = ReplayActor(
        str(target), aux_layer_ids=[0, 1, 2], draft_ids=None, k=K, payload="topk", topk=8
    ).score([item])
    assert full.teacher_logprobs is not None and top.teacher_logprobs is None
    assert top.teacher_topk_ids is not None and top.teacher_topk_logprobs is not None
    want_lp, want_ids = full.teacher_logprobs.topk(8, dim=-1)
    assert torch.equal(top.teacher_topk_ids, want_ids) and torch.allclose(top.teacher_topk_logprobs, want_lp)
    assert payload_bytes(top) < payload_bytes(full) / 4

    def learner(estimator: str) -> Learner:
        spec = LossSpec(0.8, 1.0, 1.0, "all", estimator, "mixed", 10.0, 8192)
        return Learner(
            str(draft),
            str(target),
            spec=spec,
            lr=3e-3,
            betas=[0.9, 0.95],
            weight_decay=0.0,
            warmup_ratio=0.0,
            schedule="constant",
            total_steps=10,
            zero_stage=0,
            grad_clip=1.0,
        )

    lt = learner("topk")
    losses = [lt.step([top])["loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses


def test_split_mini_batches_keeps_sequences_whole_and_balanced() -> None:
    from types import SimpleNamespace

    from draft_opd_ray.opd.learner import split_mini_batches

    sizes = [5, 1, 7, 3, 3, 9, 2, 2]
    batch = [SimpleNamespace(anchor_pos=list(range(n)), i=i) for i, n in enumerate(sizes)]
    for parts in (1, 2, 3, 4, 8, 20):
        groups = split_mini_batches(batch, parts)  # type: ignore[arg-type]
        assert [b.i for g in groups for b in g] == list(range(len(sizes)))  # every sequence once, in order
        assert all(groups) and len(groups) == min(parts, len(sizes))
        if parts > 1:
            loads = [sum(len(b.anchor_pos) for b in g) for g in groups]
            assert max(loads) <= sum(sizes) / len(groups) + max(sizes), loads
    with pytest.raises(ValueError, match="mini_batches"):
        split_mini_batches(batch, 0)  # type: ignore[arg-type]


def _spec(estimator: str = "full") -> LossSpec:
    return LossSpec(0.8, 1.0, 1.0, "all", estimator, "mixed", 10.0, 8192)


def _learner(draft, target, kind: str, estimator: str = "full"):
    from draft_opd_ray.opd.learner import Learner

    return Learner(
        str(draft),
        str(target),
        kind=kind,
        spec=_spec(estimator),
        lr=3e-3,
        betas=[0.9, 0.95],
        weight_decay=0.0,
        warmup_ratio=0.0,
        schedule="constant",
        total_steps=10,
        zero_stage=0,
        grad_clip=1.0,
    )


def test_standalone_student_matches_naive_forward_and_trains(setup, tmp_path) -> None:
    """q_k of a standalone LM draft is its distribution after x_{<=n} y_{<k}: the learner gets it for every anchor
    and position from one tree-masked forward, equal to one full forward per position."""
    from draft_opd_ray.models.standalone import build_standalone_from_target, load_standalone
    from draft_opd_ray.opd.students import StandaloneStudent, replay_needs

    target, _, _, item, K = setup
    draft = build_standalone_from_target(target, tmp_path / "sa", num_layers=1)
    feats, ids = replay_needs("standalone", str(draft), str(target))
    assert feats == [] and ids is None
    (t,) = ReplayActor(str(target), aux_layer_ids=feats, draft_ids=ids, k=K).score([item])
    assert t.features.shape == (len(item.input_ids), 0)
    student = StandaloneStudent(str(draft), str(target))
    with torch.no_grad():
        got = torch.log_softmax(student.block_hidden(t) @ student.lm_head.T, -1)
    naive = load_standalone(draft).eval()
    for j, (n, y) in enumerate(zip(item.anchor_pos, item.drafted)):
        for k in range(1, int(t.valid_len[j]) + 1):
            ctx = item.input_ids[: n + 1] + y[: k - 1]
            with torch.no_grad():
                want = torch.log_softmax(naive(torch.tensor([ctx])).logits[0, -1], -1)
            assert torch.allclose(got[j, k - 1], want, atol=1e-4), (j, k)
    learner = _learner(draft, target, "standalone")
    before = learner.rollout_state()
    losses = [learner.step([t])["loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses
    assert "lm_head.weight" not in before  # tied: written once, as save_pretrained does
    out = learner.save(str(tmp_path / "sa_out"))
    reloaded = load_standalone(out, target)
    assert torch.equal(
        reloaded.state_dict()["model.layers.0.mlp.up_proj.weight"],
        learner.model.state_dict()["model.layers.0.mlp.up_proj.weight"],
    )


def test_dflash_student_trains_on_replayed_blocks(setup, tmp_path) -> None:
    """A DFlash student drafts all K offsets in one pass from the target features before the anchor; the learner
    steps it on the same replayed teacher (features of its own target layers) and exports a loadable drafter."""
    from draft_opd_ray.models.dflash import init_dflash, load_dflash, save_dflash
    from draft_opd_ray.opd.students import DFlashStudent, replay_needs

    target, _, _, item, K = setup
    draft = save_dflash(init_dflash(target, num_layers=1, block_size=K + 1), tmp_path / "df", target)
    feats, ids = replay_needs("dflash", str(draft), str(target))
    (t,) = ReplayActor(str(target), aux_layer_ids=feats, draft_ids=ids, k=K).score([item])
    student = DFlashStudent(str(draft), str(target))
    with torch.no_grad():  # one anchor at a time gives the same block states (blocks are isolated)
        whole = student.block_hidden(t)
        one = student.model(t.input_ids[None], t.features[None], t.anchor_pos[None, 2:3])[0, 0, 1 : K + 1]
    assert whole.shape == (len(item.anchor_pos), K, student.model.config.hidden_size)
    assert torch.allclose(whole[2], one, atol=1e-5)
    learner = _learner(draft, target, "dflash")
    losses = [learner.step([t])["loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses
    load_dflash(learner.save(str(tmp_path / "df_out")), target)


@pytest.mark.parametrize("kind", ["eagle3", "standalone", "dflash"])
def test_redraft_blocks_are_the_current_drafts_greedy_proposals(setup, tmp_path, kind: str) -> None:
    """replay.mode=redraft: every anchor's block equals what the draft proposes from that prefix alone (its
    vLLM-equivalent `propose`, or HF greedy generation for a standalone LM), acceptance is the leading agreement
    with the committed stream, and a published weight version changes the blocks."""
    from draft_opd_ray.models.dflash import init_dflash, save_dflash
    from draft_opd_ray.models.standalone import build_standalone_from_target, load_standalone
    from draft_opd_ray.opd.students import make_student, replay_needs

    target, eagle_dir, model, item, K = setup
    if kind == "eagle3":
        draft = eagle_dir
    elif kind == "standalone":
        draft = build_standalone_from_target(target, tmp_path / "sa", num_layers=2)
    else:
        draft = save_dflash(init_dflash(target, num_layers=1, block_size=K + 1), tmp_path / "df", target)
    feats, ids = replay_needs(kind, str(draft), str(target))
    replay = ReplayActor(
        str(target),
        aux_layer_ids=feats,
        draft_ids=ids,
        k=K,
        mode="redraft",
        draft_kind=kind,
        draft_dir=str(draft),
    )
    (t,) = replay.score([item])
    seq = torch.tensor(item.input_ids)
    with torch.no_grad():
        hs = model(seq[None], output_hidden_states=True).hidden_states
        f = torch.cat([hs[i] for i in feats], dim=-1) if feats else None
        ref = make_student(kind, str(draft), str(target)).model.eval()
        lm = load_standalone(draft).eval() if kind == "standalone" else None
        for j, n in enumerate(item.anchor_pos):
            if lm is not None:
                out = lm.generate(seq[None, : n + 1], max_new_tokens=K, do_sample=False, min_new_tokens=K)
                want = out[0, n + 1 :]
            else:
                want = ref.propose(seq[None, : n + 1], f[:, : n + 1], torch.tensor([n + 1]), K)[0][0]
            assert t.drafted[j].tolist() == want.tolist(), (kind, j)
            stream = item.input_ids[n + 1 : n + 1 + K]
            a = next(
                (i for i, (x, y) in enumerate(zip(want.tolist(), stream)) if x != y), min(K, len(stream))
            )
            assert int(t.accepted[j]) == a
    # a new version of the draft: different blocks from the next call on
    sd = make_student(kind, str(draft), str(target)).rollout_state()
    g = torch.Generator().manual_seed(1)
    noisy = {
        k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g)
        if v.is_floating_point() and v.dim() == 2
        else v
        for k, v in sd.items()
    }
    assert replay.load_draft_weights(noisy, 3) == 3
    (t2,) = replay.score([item])
    assert t2.policy_version == 3 and not torch.equal(t2.drafted, t.drafted)
    with pytest.raises(ValueError, match="unknown names"):
        replay.load_draft_weights({"nope.weight": torch.zeros(1)}, 4)

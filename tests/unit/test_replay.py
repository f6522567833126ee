"""Replay (teacher on the draft's own blocks, branches packed into one tree-masked forward) against naive
per-anchor forwards, the packing by its definition, the top-k payload, each draft kind's student side on the
replayed blocks, and `replay.mode=redraft` (the current draft's greedy blocks). No learner: the DeepSpeed steps are
in tests/integration/test_learner_deepspeed.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from draft_opd_ray.wire import ReplayItem, branch_mask, pack_branches, payload_bytes
from tests.helpers import perturbed, replay_actor


def test_teacher_matches_naive_per_anchor_forward(replay_case) -> None:
    c = replay_case
    item = c.item
    replay = replay_actor(c.target, [0, 1, 2], None, c.num_speculative_tokens)
    (t,) = replay.score([item])
    for j, (n, y, a) in enumerate(zip(item.anchor_pos, item.drafted, item.accepted)):
        kk = int(t.valid_len[j])
        for k in range(1, kk + 1):  # p_k = target(x_{<=n} y_{<k}), one full forward each (the naive way)
            ctx = item.input_ids[: n + 1] + y[: k - 1]
            with torch.no_grad():
                want = torch.log_softmax(c.model(torch.tensor([ctx])).logits[0, -1], -1)
            assert torch.allclose(t.teacher_logprobs[j, k - 1], want, atol=1e-4), (j, k)
        assert int(t.replay_accepted[j]) == a  # greedy target output: drafts agree exactly up to a
    assert t.features.shape == (len(item.input_ids), 3 * c.model.config.hidden_size)
    assert t.valid_len.tolist() == [4, 4, 4, 4, 4]


def test_pack_branches_by_definition() -> None:
    """Block position k of anchor (n, y, a) sits on the stream (row n+k-1) for k <= a+1; later positions are a
    branch y_{a+1}.. appended after the stream at positions n+a+1.., seeing x_{<=n+a} and its own earlier tokens."""
    seq = list(range(100, 120))
    blocks = [[1, 2, 3, 4], [seq[9], 5, 6, 7], [seq[18], seq[19], 8, 9]]
    item = ReplayItem(seq, [2, 8, 17], blocks, [0, 1, 3], 0)
    packed = pack_branches(item, 4)
    T = len(seq)
    # anchor 0 (a=0): row 2, then the branch y_1..y_3; anchor 1 (a=1): rows 8, 9, then y_2, y_3; anchor 2 (a=3,
    # the stream cut 2 tokens after it): rows 17, 18, 19 only, no teacher for k=4
    assert packed.input_ids.tolist() == seq + [1, 2, 3, 5, 6]
    assert packed.position_ids.tolist() == list(range(T)) + [3, 4, 5, 10, 11]
    assert [r.tolist() for r in packed.rows] == [[2, T, T + 1, T + 2], [8, 9, T + 3, T + 4], [17, 18, 19]]
    spans = [(T, 3, 2), (T + 3, 2, 9)]
    assert torch.equal(packed.mask, branch_mask(T + 5, T, spans))
    allowed = packed.mask == 0
    for q in range(T + 5):
        for key in range(T + 5):
            if q < T:
                want = key <= q
            else:
                start, n, last = next(s for s in spans if s[0] <= q < s[0] + s[1])
                want = key <= last or start <= key <= q
            assert bool(allowed[q, key]) == want, (q, key)


def test_topk_payload_is_the_full_teacher_top_k(replay_case) -> None:
    """payload=topk ships the top k of the same teacher distributions and is far smaller (the learner steps on
    it in test_learner_deepspeed.py; the estimator itself is checked against brute force in test_loss.py)."""
    c = replay_case
    (full,) = replay_actor(c.target, [0, 1, 2], None, c.num_speculative_tokens).score([c.item])
    (top,) = replay_actor(c.target, [0, 1, 2], None, c.num_speculative_tokens, payload="topk", topk=8).score(
        [c.item]
    )
    assert full.teacher_logprobs is not None and top.teacher_logprobs is None
    assert top.teacher_topk_ids is not None and top.teacher_topk_logprobs is not None
    want_lp, want_ids = full.teacher_logprobs.topk(8, dim=-1)
    assert torch.equal(top.teacher_topk_ids, want_ids) and torch.allclose(top.teacher_topk_logprobs, want_lp)
    assert payload_bytes(top) < payload_bytes(full) / 4


def test_standalone_student_matches_naive_forward(replay_case, tmp_path) -> None:
    """q_k of a standalone LM draft is its distribution after x_{<=n} y_{<k}: the student gets it for every anchor
    and position from one tree-masked forward, equal to one full forward per position."""
    from draft_opd_ray.drafts.registry import draft_kind
    from draft_opd_ray.drafts.standalone.model import load_standalone
    from draft_opd_ray.drafts.standalone.student import StandaloneStudent

    c = replay_case
    item = c.item
    draft = c.draft("standalone", tmp_path / "sa")
    assert draft_kind("standalone").replay_needs(str(draft), str(c.target)) == ([], None)
    (t,) = c.replay("standalone", draft).score([item])
    assert t.features.shape == (len(item.input_ids), 0)
    student = StandaloneStudent(str(draft), str(c.target))
    assert student.features == () and student.draft_ids is None
    with torch.no_grad():
        got = torch.log_softmax(student.block_hidden(t) @ student.lm_head.T, -1)
    naive = load_standalone(draft).eval()
    for j, (n, y) in enumerate(zip(item.anchor_pos, item.drafted)):
        for k in range(1, int(t.valid_len[j]) + 1):
            ctx = item.input_ids[: n + 1] + y[: k - 1]
            with torch.no_grad():
                want = torch.log_softmax(naive(torch.tensor([ctx])).logits[0, -1], -1)
            assert torch.allclose(got[j, k - 1], want, atol=1e-4), (j, k)
    assert "lm_head.weight" not in student.rollout_state()  # tied: written once, as save_pretrained does


def test_dflash_student_drafts_every_block_alone(replay_case, tmp_path) -> None:
    """A DFlash student drafts all K offsets in one pass from the target features before the anchor: the block
    states of all anchors at once equal those of one anchor at a time (blocks are isolated)."""
    from draft_opd_ray.drafts.dflash.student import DFlashStudent

    c = replay_case
    draft = c.draft("dflash", tmp_path / "df")
    (t,) = c.replay("dflash", draft).score([c.item])
    student = DFlashStudent(str(draft), str(c.target))
    assert student.features == tuple(student.model.hidden_state_indices) and student.draft_ids is None
    with torch.no_grad():
        whole = student.block_hidden(t)
        one = student.model(t.input_ids[None], t.features[None], t.anchor_pos[None, 2:3])[
            0, 0, 1 : c.num_speculative_tokens + 1
        ]
    assert whole.shape == (len(c.item.anchor_pos), c.num_speculative_tokens, student.model.config.hidden_size)
    assert torch.allclose(whole[2], one, atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle3", "standalone", "dflash"])
def test_redraft_blocks_are_the_current_drafts_greedy_proposals(replay_case, tmp_path, kind: str) -> None:
    """replay.mode=redraft: every anchor's block equals what the draft proposes from that prefix alone (its
    vLLM-equivalent `propose`, or HF greedy generation for a standalone LM), acceptance is the leading agreement
    with the committed stream, and a published weight version changes the blocks."""
    from draft_opd_ray.drafts.registry import draft_kind
    from draft_opd_ray.drafts.standalone.model import load_standalone

    c = replay_case
    item = c.item
    draft = c.draft(kind, tmp_path / kind, num_layers=2 if kind == "standalone" else 1)
    feats, _ = draft_kind(kind).replay_needs(str(draft), str(c.target))
    replay = c.replay(kind, draft, mode="redraft", draft_dir=str(draft))
    (t,) = replay.score([item])
    seq = torch.tensor(item.input_ids)
    with torch.no_grad():
        hs = c.model(seq[None], output_hidden_states=True).hidden_states
        f = torch.cat([hs[i] for i in feats], dim=-1) if feats else None
        ref = draft_kind(kind).student(str(draft), str(c.target)).model.eval()
        lm = load_standalone(draft).eval() if kind == "standalone" else None
        for j, n in enumerate(item.anchor_pos):
            if lm is not None:
                out = lm.generate(
                    seq[None, : n + 1],
                    max_new_tokens=c.num_speculative_tokens,
                    do_sample=False,
                    min_new_tokens=c.num_speculative_tokens,
                )
                want = out[0, n + 1 :]
            else:
                want = ref.propose(
                    seq[None, : n + 1], f[:, : n + 1], torch.tensor([n + 1]), c.num_speculative_tokens
                )[0][0]
            assert t.drafted[j].tolist() == want.tolist(), (kind, j)
            stream = item.input_ids[n + 1 : n + 1 + c.num_speculative_tokens]
            a = next(
                (i for i, (x, y) in enumerate(zip(want.tolist(), stream)) if x != y),
                min(c.num_speculative_tokens, len(stream)),
            )
            assert int(t.accepted[j]) == a
    # a new version of the draft: different blocks from the next call on
    noisy = perturbed(draft_kind(kind).student(str(draft), str(c.target)).rollout_state(), 0.5, seed=1)
    assert replay.load_draft_weights(noisy, 3) == 3
    (t2,) = replay.score([item])
    assert t2.policy_version == 3 and not torch.equal(t2.drafted, t.drafted)
    with pytest.raises(ValueError, match="unknown names"):
        replay.load_draft_weights({"nope.weight": torch.zeros(1)}, 4)


def test_replay_actor_rejects_unknown_settings(replay_case) -> None:
    c = replay_case
    with pytest.raises(ValueError, match="replay.mode"):
        replay_actor(c.target, [], None, c.num_speculative_tokens, mode="fresh")
    with pytest.raises(
        ValueError, match=r"redraft and draft_topm > 0 need the draft folder \(ReplayRun.draft_dir\)"
    ):
        replay_actor(c.target, [], None, c.num_speculative_tokens, mode="redraft")
    with pytest.raises(ValueError, match="redraft and draft_topm > 0 need the draft folder"):
        replay_actor(c.target, [], None, c.num_speculative_tokens, payload="topk", topk=4, draft_topm=2)
    with pytest.raises(RuntimeError, match="holds no draft"):
        replay_actor(c.target, [], None, c.num_speculative_tokens).load_draft_weights({}, 1)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_sft_soft_labels_are_the_replays_teacher(replay_case, dtype: str) -> None:
    """One `teacher` setting feeds both arms: with the default truncation (top-16 over the draft vocabulary) the
    replay's teacher at an anchor's accepted positions, which lie on the sequence itself, is SFT's soft label at
    the same position of the same sequence (SFT renormalises its top-k). In float32 the two forwards (the replay's
    sequence + branches, SFT's sequence) agree to rounding, so the top-k ids are equal; at the default `auto`
    precision (bfloat16 on a CPU with AVX512-BF16 or AMX, on a GPU) they agree up to near-ties that bfloat16
    cannot order: the same top-1, the same ids but for the tail, probabilities within bfloat16's resolution."""
    from draft_opd_ray.config.schema import Config
    from draft_opd_ray.device import resolve_dtype
    from draft_opd_ray.opd.replay import ReplayActor, ReplayRun
    from draft_opd_ray.sft.features import forward_dtype, load_hf_target, target_features

    c, cfg = replay_case, Config()
    cfg.teacher = dataclasses.replace(cfg.teacher, dtype=dtype)
    cfg.loss = dataclasses.replace(cfg.loss, draft_topm=0)  # the teacher alone: no draft copy to rank with
    exact = resolve_dtype(dtype) == "float32"
    draft_ids = list(range(0, c.model.config.vocab_size, 3))
    kept = cfg.teacher.kept(len(draft_ids))
    assert (
        kept == 16 and cfg.teacher.kept(8) == 8 and dataclasses.replace(cfg.teacher, topk=None).kept(99) == 99
    )
    replay = ReplayActor(
        ReplayRun(str(c.target), [0, 1, 2], draft_ids), cfg.draft, cfg.teacher, cfg.loss, cfg.replay
    )
    assert replay.model.dtype == forward_dtype(cfg.teacher.dtype)  # `auto` resolved by the replay itself
    (t,) = replay.score([c.item])
    hf = load_hf_target(c.target, forward_dtype(cfg.teacher.dtype))
    with torch.no_grad():
        ((_, ids, p, _),) = target_features(
            hf, [c.item.input_ids], (1, 2), torch.tensor(draft_ids), topk=kept
        )
    assert t.teacher_topk_ids is not None and t.teacher_topk_logprobs is not None
    assert t.teacher_topk_ids.shape[-1] == ids.shape[-1] == kept
    compared = 0
    for j, (n, a) in enumerate(zip(c.item.anchor_pos, c.item.accepted)):
        for k in range(1, min(a + 1, int(t.valid_len[j])) + 1):  # p_k on the stream: row n + k - 1
            mine, theirs = t.teacher_topk_ids[j, k - 1], ids[n + k - 1]
            q, ref = torch.softmax(t.teacher_topk_logprobs[j, k - 1].float(), -1), p[n + k - 1].float()
            if exact:
                assert torch.equal(mine, theirs), (j, k)
                torch.testing.assert_close(q, ref)
            else:
                assert mine[0] == theirs[0], (j, k)
                common = sorted(set(mine.tolist()) & set(theirs.tolist()))
                assert len(common) >= kept - 2, (j, k, mine, theirs)
                at = {int(i): x for i, x in zip(mine, q)}
                ref_at = {int(i): x for i, x in zip(theirs, ref)}
                for i in common:
                    torch.testing.assert_close(at[i], ref_at[i], atol=1e-2, rtol=5e-2)
            compared += 1
    assert compared == sum(
        min(a + 1, c.num_speculative_tokens) for a in c.item.accepted
    )  # a block of K: at most K positions


def _verification_pass(c, item: ReplayItem, k: int):  # noqa: ANN001, ANN202 - the test's own helper
    """`CapturedSteps` as vLLM's verification computes them, naively: per step, one forward over x_{<=n} y whose
    rows n..n+K' (drafted rows, then the bonus row) go through the capture's own `teacher_rows`."""
    import numpy as np

    from draft_opd_ray.rollout.verify_capture import teacher_rows
    from draft_opd_ray.wire import CapturedSteps

    ids, vals, tails = [], [], []
    for n, y in zip(item.anchor_pos, item.drafted):
        with torch.no_grad():
            logits = c.model(torch.tensor([item.input_ids[: n + 1] + y])).logits[0, n:]
        v, i, t = teacher_rows(logits, k, None)
        ids.append(i.numpy())
        vals.append(v.numpy())
        tails.append(t.numpy())
    return CapturedSteps(
        list(item.anchor_pos),
        [list(y) for y in item.drafted],
        list(item.accepted),
        np.stack(ids),
        np.stack(vals),
        np.stack(tails),
    )


def test_a_captured_teacher_is_the_replays_with_no_teacher_forward(replay_case) -> None:
    """`teacher.source=verify`: verify row k-1 of a step is block position k's teacher, rejected suffix included.
    The item built from captured rows (top-16, narrowed to the actor's top-8 with the rest folded into the tail)
    equals the replay's packed forward at every drafted position; the replay's target ran over the committed
    sequence only (the features), and for a draft with no features it never loads."""
    from draft_opd_ray.wire import TeacherSummary

    c = replay_case
    K = c.num_speculative_tokens
    cap = _verification_pass(c, c.item, 16)
    captured = dataclasses.replace(c.item, captured=cap.select(range(len(c.item.anchor_pos))))
    (want,) = replay_actor(c.target, [0, 1, 2], None, K, payload="topk", topk=8).score([c.item])
    (got,) = replay_actor(c.target, [0, 1, 2], None, K, payload="topk", topk=8, source="verify").score(
        [captured]
    )
    assert got.teacher_captured and not want.teacher_captured
    assert torch.equal(got.valid_len, want.valid_len) and torch.equal(got.accepted, want.accepted)
    assert torch.equal(got.teacher_topk_ids, want.teacher_topk_ids)
    assert torch.allclose(got.teacher_topk_logprobs, want.teacher_topk_logprobs, atol=1e-4)
    assert torch.allclose(got.teacher_log_tail, want.teacher_log_tail, atol=1e-4)
    # the one forward the replay still runs (plain, where the replay packs the branches beside it)
    assert torch.allclose(got.features, want.features, atol=1e-5)
    s, w = TeacherSummary.of(got), TeacherSummary.of(want)
    assert s.target_ran and s.scored_tokens == len(c.item.input_ids) < w.scored_tokens

    bare = replay_actor(c.target, [], None, K, payload="topk", topk=8, source="verify")
    (alone,) = bare.score([captured])
    assert bare._model is None and not TeacherSummary.of(alone).target_ran
    assert torch.equal(alone.teacher_topk_ids, want.teacher_topk_ids)


def test_captured_steps_select_keeps_the_chosen_steps_in_order(replay_case) -> None:
    c = replay_case
    cap = _verification_pass(c, c.item, 4)
    two = cap.select([3, 1])
    assert two.anchor_pos == [c.item.anchor_pos[3], c.item.anchor_pos[1]]
    assert two.accepted == [c.item.accepted[3], c.item.accepted[1]]
    assert (two.topk_ids[0] == cap.topk_ids[3]).all() and (two.log_tail[1] == cap.log_tail[1]).all()


def test_captured_feature_rows_leave_the_replay_no_target_forward(replay_case) -> None:
    """EAGLE-3 with the engine's feature rows (`CapturedSteps.features`, here the target's own hidden states at the
    draft's layers, by position): the item carries them (the last token's row zeros: never an input, never read),
    the actor never loads the target, and the summary counts no target forward."""
    import numpy as np

    from draft_opd_ray.wire import TeacherSummary

    c = replay_case
    K, seq = c.num_speculative_tokens, c.item.input_ids
    with torch.no_grad():
        hs = c.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i][0] for i in (0, 1, 2)], -1)
    cap = _verification_pass(c, c.item, 8)
    cap.features, cap.feature_seen = feats, np.ones(len(seq), dtype=bool)
    captured = dataclasses.replace(c.item, captured=cap.select(range(len(c.item.anchor_pos))))
    actor = replay_actor(c.target, [0, 1, 2], None, K, payload="topk", topk=8, source="verify")
    (got,) = actor.score([captured])
    assert actor._model is None and got.features_captured and not TeacherSummary.of(got).target_ran
    assert torch.equal(got.features[:-1], feats[:-1]) and not got.features[-1].any()
    (want,) = replay_actor(c.target, [0, 1, 2], None, K, payload="topk", topk=8).score([c.item])
    assert torch.allclose(got.features[:-1], want.features[:-1], atol=1e-5)
    cap.feature_seen[3] = False  # a row the capture lacks: the replay computes the features
    (fallback,) = actor.score(
        [dataclasses.replace(captured, captured=cap.select(range(len(c.item.anchor_pos))))]
    )
    assert not fallback.features_captured and TeacherSummary.of(fallback).target_ran

"""The verify-pass capture's math and bookkeeping without an engine (rollout/verify_capture.py): the teacher rows
against brute force, the row maps of the two runners on vLLM's own documented layout, the steps handed out, and
check_teacher's comparison and option parsing. The real engine runs it in
tests/integration/test_verify_capture_vllm.py; vLLM's files are held to these layouts in
tests/conformance/test_verify_capture.py."""

from __future__ import annotations

import math
import types
from typing import Any

import numpy as np
import pytest
import torch

from draft_opd_ray.rollout import verify_capture as vc
from draft_opd_ray.wire import CapturedSteps, RequestRecord, TeacherItem


def _brute(row: torch.Tensor, k: int) -> tuple[list[float], list[int], float]:
    """float64 log-softmax by hand, sorted top k, tail as log(sum of the other probabilities)."""
    x = row.double()
    lse = math.log(sum(math.exp(v) for v in x.tolist()))
    lp = [v - lse for v in x.tolist()]
    order = sorted(range(len(lp)), key=lambda i: -lp[i])
    top = order[:k]
    rest = [math.exp(lp[i]) for i in order[k:]]
    return [lp[i] for i in top], top, math.log(sum(rest)) if rest else -math.inf


@pytest.mark.parametrize("use_vocab", [False, True])
def test_teacher_rows_are_the_log_softmax_top_k_and_tail(use_vocab: bool) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g) * 3
    vocab = torch.tensor([3, 7, 8, 11, 20, 21, 30, 39]) if use_vocab else None
    vals, ids, tail = vc.teacher_rows(logits, 4, vocab)
    for r in range(5):
        row = logits[r] if vocab is None else logits[r, vocab]
        bv, bi, bt = _brute(row, 4)
        assert ids[r].tolist() == bi
        assert vals[r].tolist() == pytest.approx(bv, abs=1e-5)
        assert float(tail[r]) == pytest.approx(bt, abs=1e-5)
    # k larger than the vocabulary: everything is in the top k, nothing in the tail
    v2, _, t2 = vc.teacher_rows(logits[:1, :3], 10, None)
    assert v2.shape == (1, 3) and float(t2[0]) == -math.inf


class _V1Sampler:
    """Stands in for vLLM's V1 sampler: accepts a fixed count per request, marks the rest -1, as vLLM's output
    (B, max_spec_len + 1) does."""

    def __init__(self, accepted: list[int]) -> None:
        self.accepted = accepted
        self.seen: list[torch.Tensor] = []
        self.other = "an attribute the runner reads"

    def __call__(self, metadata: Any, draft_probs: Any, logits: torch.Tensor, sampling_metadata: Any) -> Any:
        self.seen.append(logits.clone())
        width = metadata.max_spec_len + 1
        out = torch.full((len(self.accepted), width), -1)
        for b, a in enumerate(self.accepted):
            out[b, : a + 1] = 7
        return types.SimpleNamespace(sampled_token_ids=out)


def _v1_call() -> tuple[Any, Any, torch.Tensor]:
    """vLLM's own example (`_calc_spec_decode_metadata`'s comments; the conformance tier builds it with vLLM's
    code): 5 requests drafting 3, 0, 2, 0, 1 tokens, scheduled 4, 100, 3, 100, 2 tokens."""
    num_draft = [3, 0, 2, 0, 1]
    meta = types.SimpleNamespace(  # the fields of vllm.v1.spec_decode.metadata.SpecDecodeMetadata
        draft_token_ids=torch.tensor([501, 502, 503, 601, 602, 701]),
        num_draft_tokens=num_draft,
        max_spec_len=3,
        logits_indices=torch.tensor([0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]),
    )
    positions = torch.arange(300) + 1000  # the position of token index t is 1000 + t
    req_ids = ["a-1", "b-2", "c-3", "d-4", "e-5"]
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=req_ids),
        positions=positions,
        input_ids=types.SimpleNamespace(gpu=torch.arange(300) + 9000),  # token index t holds id 9000 + t
        # CachedRequestState.prompt_token_ids (v1/worker/gpu_input_batch.py)
        requests={
            r: types.SimpleNamespace(prompt_token_ids=[i + 1] * (i + 2)) for i, r in enumerate(req_ids)
        },
    )
    logits = torch.randn(11, 50, generator=torch.Generator().manual_seed(1))
    return meta, runner, logits


def test_v1_rows_per_request_and_the_sampler_untouched() -> None:
    meta, runner, logits = _v1_call()
    inner = _V1Sampler([2, 0, 1, 0, 1])
    runner.rejection_sampler = inner
    cap = vc.install(runner, 3, None)
    assert runner.rejection_sampler is cap and cap.other == inner.other  # the runner reads through it
    before, rng = logits.clone(), torch.get_rng_state()
    out = runner.rejection_sampler(meta, None, logits, None)
    assert torch.equal(inner.seen[0], before) and torch.equal(
        logits, before
    )  # vLLM's sampler got the very rows
    assert torch.equal(torch.get_rng_state(), rng)  # and the capture drew no random number
    assert out.sampled_token_ids.shape == (5, 4)
    steps = cap.take()
    assert sorted(steps) == ["a-1", "c-3", "e-5"]  # no drafts, no step (prefill rows, a bonus-only row)
    a, c, e = steps["a-1"], steps["c-3"], steps["e-5"]
    assert (a.anchor_pos, a.drafted, a.accepted) == ([1000], [[501, 502, 503]], [2])
    assert (c.anchor_pos, c.drafted, c.accepted) == ([1104], [[601, 602]], [1])
    assert (e.anchor_pos, e.drafted, e.accepted) == ([1207], [[701]], [1])
    # the committed token each step's first row scores (token indices 0, 104, 207) and the prompts, once
    assert (a.anchor_ids, c.anchor_ids, e.anchor_ids) == ([9000], [9104], [9207])
    assert (a.prompt_ids, c.prompt_ids, e.prompt_ids) == ([1, 1], [3, 3, 3, 3], [5] * 6)
    want_vals, want_ids, want_tail = vc.teacher_rows(logits, 3, None)
    for s, rows in ((a, range(0, 4)), (c, range(5, 8)), (e, range(9, 11))):
        n = len(rows)
        assert s.topk_ids.shape == (1, n, 3)
        assert np.array_equal(s.topk_ids[0], want_ids[list(rows)].numpy())
        assert np.allclose(s.topk_logprobs[0], want_vals[list(rows)].numpy())
        assert np.allclose(s.log_tail[0], want_tail[list(rows)].numpy())
    assert cap.take() == {}  # handed out once
    runner.rejection_sampler(meta, None, logits, None)  # a later step of the same requests: no prompt again
    assert all(x.prompt_ids is None for x in cap.take().values())
    del runner.requests["a-1"]  # finished: the runner drops it, and so does the capture
    cap.take()
    assert "a-1" not in cap.handed and "c-3" in cap.handed


def test_a_request_taken_while_it_runs_joins_into_one_record() -> None:
    """A server takes the capture while requests run: the chunks join (`CapturedSteps.then`) into the steps one
    take at the end would give, and the record rebuilt from them has the prompt and committed tokens."""
    meta, runner, logits = _v1_call()
    runner.rejection_sampler = _V1Sampler([2, 0, 1, 0, 1])
    cap = vc.install(runner, 3, None)
    whole = vc.install(
        types.SimpleNamespace(**{**vars(runner), "rejection_sampler": _V1Sampler([2, 0, 1, 0, 1])}), 3, None
    )
    for scale in (1.0, 2.0, 3.0):
        cap(meta, None, logits * scale, None)
        whole(meta, None, logits * scale, None)
    one = whole.take()["a-1"]
    first = cap.take()["a-1"]
    cap(meta, None, logits * 4, None)
    whole(meta, None, logits * 4, None)
    joined = first.then(cap.take()["a-1"])
    one = one.then(whole.take()["a-1"])
    for f in ("anchor_pos", "drafted", "accepted", "prompt_ids", "anchor_ids"):
        assert getattr(joined, f) == getattr(one, f), f
    for f in ("topk_ids", "topk_logprobs", "log_tail"):
        assert np.array_equal(getattr(joined, f), getattr(one, f)), f
    rec = joined.record("a", 3)
    assert (
        rec.prompt_ids == [1, 1]
        and rec.response_ids == [9000, 501, 502] * 4
        and rec.policy_version == [3] * 4
    )
    assert rec.captured is joined and rec.finish_reason == "length"


def test_joined_steps_pad_blocks_and_merge_feature_rows_by_position() -> None:
    def steps(anchor: list[int], k1: int, feats: list[int] | None) -> CapturedSteps:
        n = len(anchor)
        f = seen = None
        if feats is not None:
            size = max(feats) + 1
            f = torch.zeros(size, 2)
            seen = np.zeros(size, dtype=bool)
            for p in feats:
                f[p], seen[p] = float(anchor[0] * 100 + p), True
        return CapturedSteps(
            anchor,
            [[1] * (k1 - 1)] * n,
            [0] * n,
            np.ones((n, k1, 2), np.int32),
            np.zeros((n, k1, 2), np.float32),
            np.zeros((n, k1), np.float32),
            False,
            f,
            seen,
            [7, 7],
            [5] * n,
        )

    a, b = steps([2], 3, [0, 1, 2, 3]), steps([3, 4], 2, [3, 4, 5])
    j = a.then(b)
    assert (
        j.topk_ids.shape == (3, 3, 2)
        and j.topk_ids[1:, 2].sum() == 0
        and np.isneginf(j.log_tail[1:, 2]).all()
    )
    assert j.prompt_ids == [7, 7] and j.anchor_ids == [5, 5, 5] and j.anchor_pos == [2, 3, 4]
    assert j.features is not None and j.feature_seen is not None and j.feature_seen.all()
    assert j.features[:, 0].tolist() == [200.0, 201.0, 202.0, 303.0, 304.0, 305.0]  # the later chunk wins
    assert steps([2], 3, None).then(b).features is b.features
    with pytest.raises(ValueError, match="without its prompt"):
        dataclasses_replace(a, prompt_ids=None).record("x", 0)


def dataclasses_replace(x: Any, **kw: Any) -> Any:
    import dataclasses

    return dataclasses.replace(x, **kw)


def test_steps_of_several_calls_pad_to_the_longest_block() -> None:
    meta, runner, logits = _v1_call()
    runner.rejection_sampler = _V1Sampler([3, 0, 2, 0, 0])
    cap = vc.install(runner, 2, None)
    cap(meta, None, logits, None)
    cap(meta, None, logits * 2, None)
    e = cap.take()["e-5"]
    assert e.accepted == [0, 0] and e.topk_ids.shape == (2, 2, 2)


def test_steps_pad_to_the_longest_block_and_survive_the_rpc_encoding() -> None:
    def step(anchor: int, drafted: list[int], accepted: int, grammar: bool) -> tuple[Any, ...]:
        n = len(drafted) + 1
        ids = np.arange(2 * n, dtype=np.int32).reshape(n, 2)
        return (
            anchor,
            drafted,
            accepted,
            ids,
            np.zeros((n, 2), np.float32),
            np.zeros(n, np.float32),
            grammar,
            anchor + 1000,
        )

    packed = vc._pack([step(5, [1, 2], 1, False), step(8, [4], 0, True)], 2)
    c = vc.decode(vc.encode(packed))
    assert c.topk_ids.shape == (2, 3, 2) and c.grammar and c.accepted == [1, 0] and c.anchor_pos == [5, 8]
    assert np.isneginf(c.topk_logprobs[1, 2]).all() and np.isneginf(c.log_tail[1, 2])  # padding
    assert np.array_equal(c.topk_ids, packed.topk_ids) and np.array_equal(c.log_tail, packed.log_tail)
    assert c.anchor_ids == [1005, 1008] and c.prompt_ids is None


def test_v2_rows_from_cu_num_logits() -> None:
    """Model Runner V2: request b owns rows cu_num_logits[b]..[b+1], its last the bonus row; a drafted id is the
    input id one token after its row's token."""
    cu = np.array([0, 3, 4, 6])  # drafts 2, 0, 1
    logits_indices = torch.tensor([1, 2, 3, 10, 20, 21])
    input_ids = torch.arange(100) + 5000
    batch = types.SimpleNamespace(
        req_ids=["x-1", "y-2", "z-3"],
        num_reqs=3,
        cu_num_logits_np=cu,
        logits_indices=logits_indices,
        positions=torch.arange(100) * 10,
        input_ids=input_ids,
    )

    def inner(logits: Any, input_batch: Any, draft_logits: Any = None, invalid_drafts: Any = None) -> Any:
        return types.SimpleNamespace(num_sampled=torch.tensor([2, 1, 1]))

    all_ids = torch.arange(3 * 50).reshape(3, 50)  # req_states.all_token_ids (v1/worker/gpu/states.py)
    states = types.SimpleNamespace(
        req_id_to_index={"x-1": 0, "y-2": 1, "z-3": 2},
        prompt_len=types.SimpleNamespace(np=np.array([2, 3, 4])),
        all_token_ids=types.SimpleNamespace(gpu=all_ids),
    )
    runner = types.SimpleNamespace(speculator=object(), rejection_sampler=inner, req_states=states)
    cap = vc.install(runner, 2, None)
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(2))
    cap(logits, batch, None, None)
    steps = cap.take()
    assert sorted(steps) == ["x-1", "z-3"]
    assert (steps["x-1"].anchor_pos, steps["x-1"].drafted, steps["x-1"].accepted) == (
        [10],
        [[5002, 5003]],
        [1],
    )
    assert (steps["z-3"].anchor_pos, steps["z-3"].drafted, steps["z-3"].accepted) == ([200], [[5021]], [0])
    assert (steps["x-1"].anchor_ids, steps["z-3"].anchor_ids) == ([5001], [5020])  # the first rows' input ids
    assert (steps["x-1"].prompt_ids, steps["z-3"].prompt_ids) == ([0, 1], [100, 101, 102, 103])
    assert not steps["x-1"].grammar
    # V2 has no drafter to tap: asking for feature rows installs the teacher capture alone, and says so
    vc.install(runner, 2, None, features=True)
    assert not vc.taps_features(runner) and steps["x-1"].features is None


def test_v2_with_device_side_draft_budget_is_refused() -> None:
    runner = types.SimpleNamespace(
        speculator=object(), rejection_sampler=object(), adaptive_verification=object()
    )
    with pytest.raises(RuntimeError, match="teacher.source=replay"):
        vc.install(runner, 2, None)


def test_external_id_inverts_vllms_suffix() -> None:
    assert vc.external_id("12-abcdef01") == "12"
    assert vc.external_id("my-request-abcdef01") == "my-request"


# ------------------------------------------------------------------------------------- check_teacher's comparison


def _record_and_item(noise: float = 0.0, swap: bool = False) -> tuple[RequestRecord, TeacherItem]:
    """One request with two steps over a 12-token vocabulary, its capture made from the replay's teacher."""
    g = torch.Generator().manual_seed(3)
    V, K, k = 12, 3, 4
    prompt, response = [1, 2, 3], [4, 5, 6, 7, 8, 9]
    teacher = torch.log_softmax(torch.randn(2, K, V, generator=g) * 2, -1)
    drafted, accepted, anchors = [[4, 9, 9], [6, 7, 1]], [1, 2], [3, 5]
    ids = np.zeros((2, K + 1, k), np.int32)
    vals = np.full((2, K + 1, k), -np.inf, np.float32)
    tail = np.full((2, K + 1), -np.inf, np.float32)
    for i in range(2):
        v, t = teacher[i].topk(k, -1)
        ids[i, :K], vals[i, :K] = t.numpy(), v.numpy() + noise
        outside = teacher[i].scatter(-1, t, -math.inf).logsumexp(-1)
        tail[i, :K] = outside.numpy()
    if swap:  # a top-k id that is not the replay's (far from its k-th value)
        ids[0, 0, 0] = int(teacher[0, 0].argmin())
    cap = CapturedSteps(anchors, drafted, accepted, ids, vals, tail)
    rec = RequestRecord(prompt, response, anchors, drafted, accepted, [0, 0], captured=cap)
    item = TeacherItem(
        torch.tensor(prompt + response),
        torch.zeros(9, 0),
        torch.tensor(anchors),
        torch.tensor(drafted),
        torch.tensor([3, 3]),
        torch.tensor(accepted),
        torch.tensor(accepted),
        teacher,
        0,
    )
    return rec, item


def test_compare_passes_the_same_teacher_and_catches_a_difference() -> None:
    from draft_opd_ray.check_teacher import compare

    rec, item = _record_and_item()
    same = compare([rec], [item], 1e-4)
    assert same.ok(1e-4) and same.positions == 6 and same.steps == 2 and same.max_abs_logprob_diff < 1e-6
    off = compare(*([x] for x in _record_and_item(noise=3e-4)), 1e-4)
    assert not off.ok(1e-4) and off.max_abs_logprob_diff == pytest.approx(3e-4, rel=1e-2)
    swapped = compare(*([x] for x in _record_and_item(swap=True)), 1e-4)
    assert swapped.topk_mismatches == 1 and not swapped.ok(1e-4)


def test_compare_counts_rows_past_the_kept_response_and_wrong_lengths() -> None:
    from draft_opd_ray.check_teacher import compare

    rec, item = _record_and_item()
    item.valid_len = torch.tensor([3, 2])
    bad = compare([rec], [item], 1e-4)
    assert bad.valid_len_mismatches == 1 and not bad.ok(1e-4)
    rec.response_ids = rec.response_ids[:3]  # T = 6: step 2 (anchor 5, 2 accepted) keeps 1 row of context
    item.valid_len = torch.tensor([3, 1])
    cut = compare([rec], [item], 1e-4)
    assert cut.valid_len_mismatches == 0 and cut.cut_by_length == 2 and cut.positions == 4


def test_check_options_refuse_bad_keys_before_anything_loads() -> None:
    from draft_opd_ray.check_teacher import parse
    from draft_opd_ray.errors import ConfigError

    rest, opts = parse(["draft.kind=standalone", "check.prompts.source=jsonl", "check.prompts.path=p.jsonl"])
    assert rest == ["draft.kind=standalone"] and opts.prompts.source == "jsonl" and opts.dtype == "float32"
    assert opts.prompts.max_prompts == 8  # a few MT-Bench prompts by default, the file's first 8 otherwise
    for bad, key in (
        ("check.dtyp=float32", "check.dtyp"),
        ("check.dtype=float16", "check.dtype"),
        ("check.prompts.source=csv", "check.prompts.source"),
        ("check.max_new_tokens=0", "check.max_new_tokens"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            parse([bad])


def test_draft_mass_outside_the_teacher_top_k_by_brute_force() -> None:
    """check_teacher's `draft_mass`: the draft's own q at the replayed positions, against a position-by-position
    count over ids (a student whose block states are fixed rows and whose head is the identity)."""
    from types import SimpleNamespace

    from draft_opd_ray.check_teacher import draft_mass

    _, item = _record_and_item()
    item.valid_len = torch.tensor([3, 2])
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 3, 12, generator=g) * 2
    student = SimpleNamespace(block_hidden=lambda b: hidden, lm_head=torch.eye(12))
    got = draft_mass(student, [item], [4, 12], m=3)
    top_m = outside_m = outside = 0.0
    for j, v in enumerate([3, 2]):
        for r in range(v):
            q = torch.softmax(hidden[j, r], -1).tolist()
            t = set(item.teacher_logprobs[j, r].topk(4).indices.tolist())
            mine = sorted(range(12), key=lambda i: -q[i])[:3]
            top_m += sum(q[i] for i in mine)
            outside_m += sum(q[i] for i in mine if i not in t)
            outside += sum(q[i] for i in range(12) if i not in t)
    assert got["draft_topm_mass"] == pytest.approx(top_m / 5, rel=1e-5)
    assert got["draft_topm_outside_topk"]["4"] == pytest.approx(outside_m / 5, rel=1e-5)
    assert got["draft_mass_outside_topk"]["4"] == pytest.approx(outside / 5, rel=1e-5)
    # a teacher top-k that is the whole vocabulary leaves nothing outside
    assert got["draft_topm_outside_topk"]["12"] == got["draft_mass_outside_topk"]["12"] == 0.0


# ------------------------------------------------------------------------------------------- feature rows (EAGLE-3)


class _Proposer:
    """The drafter: a class method `propose`, called by keyword as the V1 runner does."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def propose(self, **kwargs: Any) -> str:
        self.calls.append(kwargs)
        return "drafts"


def test_feature_rows_by_request_and_position_last_write_wins() -> None:
    """Two steps of two requests: request a's step 1 (anchor 5, rows at positions 5..8) accepts 1, so positions 7
    and 8 hold rejected rows until step 2 (anchor 7) computes them again from committed tokens; request b's prefill
    (positions 0..2) comes in step 1. The drafter's `propose` gets the same arguments, and the runner still sees its
    proposer's own class (an instance attribute, not a proxy)."""
    meta, runner, logits = _v1_call()
    runner.rejection_sampler = _V1Sampler([2, 0, 1, 0, 1])
    drafter = _Proposer()
    runner.drafter = drafter
    cap = vc.install(runner, 3, None, features=True)
    assert isinstance(runner.drafter, _Proposer) and isinstance(drafter.propose, vc.FeatureTap)
    assert vc.taps_features(runner)
    cap = vc.install(runner, 3, None, features=True)  # installed again: one tap, over vLLM's own method
    assert isinstance(drafter.propose, vc.FeatureTap) and not isinstance(drafter.propose.inner, vc.FeatureTap)
    runner.rejection_sampler(meta, None, logits, None)  # a step so that request "a-1" has captured steps

    def call(req_ids: list[str], positions: list[int], starts: list[int], fill: float) -> None:
        runner.input_batch.req_ids = req_ids
        hidden = torch.stack([torch.full((6,), fill + p) for p in positions])
        out = drafter.propose(
            num_speculative_tokens=3,
            target_positions=torch.tensor(positions),
            target_hidden_states=hidden,
            common_attn_metadata=types.SimpleNamespace(query_start_loc_cpu=torch.tensor(starts)),
        )
        assert out == "drafts" and torch.equal(drafter.calls[-1]["target_hidden_states"], hidden)
        hidden.zero_()  # the runner reuses its buffers: the capture must have copied

    call(["a-1", "c-3"], [5, 6, 7, 8, 0, 1, 2], [0, 4, 7], fill=100.0)  # 7, 8 rejected in a's step
    call(["a-1"], [7, 8, 9, 10], [0, 4], fill=200.0)  # step 2 from committed tokens
    steps = cap.take()
    a = steps["a-1"]
    assert a.features is not None and a.feature_seen is not None
    assert a.features.shape == (11, 6) and a.feature_seen.tolist() == [False] * 5 + [True] * 6
    assert a.features[5:7, 0].tolist() == [105.0, 106.0] and a.features[7:11, 0].tolist() == [
        207,
        208,
        209,
        210,
    ]
    c = steps["c-3"]
    assert c.features is not None and c.features[:3, 0].tolist() == [100.0, 101.0, 102.0]
    assert "e-5" in steps and steps["e-5"].features is None  # a request the drafter was never handed
    back = vc.decode(vc.encode(a))
    assert back.features is not None and torch.equal(back.features, a.features)
    assert back.feature_seen is not None and np.array_equal(back.feature_seen, a.feature_seen)
    assert cap.features == {}
    # a running request's prefill rows taken before its first step: kept for the take that has its steps
    call(["b-2"], [0, 1], [0, 2], fill=300.0)
    assert "b-2" not in cap.take() and list(cap.features) == ["b-2"]
    del runner.requests["b-2"]  # it ended without a step: dropped at the next take
    cap.take()
    assert cap.features == {}


def test_captured_features_need_every_row_a_block_reads() -> None:
    from draft_opd_ray.wire import captured_features

    feats = torch.arange(24, dtype=torch.bfloat16).reshape(6, 4)
    seen = np.ones(6, dtype=bool)
    cap = CapturedSteps(
        [1, 3], [[5], [6]], [1, 0], *(np.zeros((2, 2, 1)),) * 2, np.zeros((2, 2)), False, feats, seen
    )
    got = captured_features(cap, 5)  # the last token (position 4) was never an input: zeros
    assert (
        got is not None
        and got.dtype == torch.bfloat16
        and torch.equal(got[:4], feats[:4])
        and not got[4].any()
    )
    anchored = CapturedSteps(
        [1, 4], [[5], [6]], [1, 0], *(np.zeros((2, 2, 1)),) * 2, np.zeros((2, 2)), False, feats, seen
    )
    got = captured_features(anchored, 5)  # a step anchored on the last token: its row 0 is that token's
    assert got is not None and got[4].tolist() == feats[4].tolist()
    seen[2] = False  # a prefix-cache hit: a prompt row never computed
    assert captured_features(cap, 5) is None
    assert (
        captured_features(CapturedSteps([1], [[5]], [1], *(np.zeros((1, 2, 1)),) * 2, np.zeros((1, 2))), 5)
        is None
    )


def test_a_capture_without_its_sampler_yet_raises_instead_of_recursing() -> None:
    bare = object.__new__(vc.VerifyCapture)  # what a copy or an unpickling sees before __init__'s attributes
    with pytest.raises(AttributeError):
        _ = bare.max_spec_len

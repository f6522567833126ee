"""The acceptance-aware objective (docs/design.md, "Objective") against brute-force computations on small vocabularies:
position sets and weights by their definitions, each estimator by its direct formula, the chunked `full` path's
values and gradients against naive autograd (float64), and global normalisation across micro-batches and ranks."""

from __future__ import annotations

import math

import pytest
import torch

from draft_opd_ray.algo.loss import (
    FullInputs,
    TokenInputs,
    TopkInputs,
    denominator,
    full_kl,
    objective_terms,
    position_sets,
    sft_terms,
    teacher_log_tail,
    token_kl,
    topk_kl,
)
from draft_opd_ray.config.schema import LossConfig

F64 = torch.float64


def spec(**kw) -> LossConfig:
    base: dict = dict(
        gamma=0.8,
        lambda_acc=1.0,
        lambda_rej=1.0,
        rejected_scope="all",
        estimator="full",
        directions="mixed",
        logprob_clamp=10.0,
        vocab_chunk=5,
        token_chunk=4,
    )
    return LossConfig(**{**base, **kw})


def anchors(seed: int, n: int, num_speculative_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (accepted, valid_len), including full accepts, a = 0 and short blocks (K' < K)."""
    g = torch.Generator().manual_seed(seed)
    valid_len = torch.randint(1, num_speculative_tokens + 1, (n,), generator=g)
    valid_len[0] = num_speculative_tokens
    accepted = (torch.rand(n, generator=g) * (valid_len + 1)).long().clamp(max=valid_len)
    accepted[0], accepted[1] = num_speculative_tokens, 0
    return accepted, valid_len


def tensors(seed: int, t: int, h: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g, dtype=F64)
    weight = torch.randn(v, h, generator=g, dtype=F64) / math.sqrt(h) * 2
    teacher = torch.randn(t, v, generator=g, dtype=F64) * 1.5
    return hidden, weight, teacher


def exact_kls(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force: softmax by exp / sum, both KLs summed over the vocabulary."""
    q = student_logits.exp() / student_logits.exp().sum(-1, keepdim=True)
    p = teacher_logits.exp() / teacher_logits.exp().sum(-1, keepdim=True)
    return (p * (p.log() - q.log())).sum(-1), (q * (q.log() - p.log())).sum(-1)


def brute_objective(
    fkl: list[float], rkl: list[float], accepted: torch.Tensor, valid_len: torch.Tensor, sp: LossConfig
) -> tuple[float, float]:
    """Numerator and denominator of §2.4, position by position from the set definitions."""
    num = den = 0.0
    t = 0
    for a, kv in zip(accepted.tolist(), valid_len.tolist()):
        for k in range(1, kv + 1):
            in_a = k <= a + 1  # accepted, or the correction position (exists since k <= K')
            in_r = k >= a + 1 if sp.rejected_scope == "all" else k == a + 1
            wa = sp.lambda_acc if in_a else 0.0
            wr = sp.lambda_rej * sp.gamma ** (k - 1) if in_r else 0.0
            f, r = min(fkl[t], sp.logprob_clamp), min(rkl[t], sp.logprob_clamp)
            if sp.directions == "mixed":
                num += wa * f + wr * r
            else:
                num += (wa + wr) * (f if sp.directions == "forward" else r)
            den += wa + wr
            t += 1
    assert t == len(fkl)
    return num, den


# ---------------------------------------------------------------------------------------------------------------
# Position sets and weights


def test_position_set_counts_for_16_token_blocks() -> None:
    accepted, valid_len = torch.tensor([16, 0, 3]), torch.tensor([16, 16, 16])
    sets = position_sets(accepted, valid_len, 16, "all")
    rest = sets.rejected & ~sets.first_rejected
    counts = torch.stack([sets.accepted.sum(1), sets.first_rejected.sum(1), rest.sum(1)], 1)
    assert counts.tolist() == [[16, 0, 0], [0, 1, 15], [3, 1, 12]]
    # the correction position k = a+1 is in A (forward KL) and in R (reverse KL)
    assert sets.forward_set.sum(1).tolist() == [16, 1, 4]
    assert bool((sets.forward_set & sets.rejected)[2, 3]) and sets.first_rejected[2].nonzero().item() == 3


def test_rejected_scope_first_vs_all() -> None:
    accepted, valid_len = torch.tensor([3, 5, 0, 2]), torch.tensor([10, 5, 4, 3])
    first = position_sets(accepted, valid_len, 10, "first")
    every = position_sets(accepted, valid_len, 10, "all")
    assert first.rejected.sum(1).tolist() == [1, 0, 1, 1]
    assert every.rejected.sum(1).tolist() == [7, 0, 4, 1]
    assert not bool((every.rejected & ~every.valid).any())  # nothing beyond K'
    assert torch.equal(first.rejected, every.first_rejected)
    sp = spec(gamma=0.5, rejected_scope="first")
    # first: |A| = 4 + 5 + 1 + 3, R = {4}, {}, {1}, {3}
    assert denominator(accepted, valid_len, 10, sp) == pytest.approx(13 + 0.5**3 + 1 + 0.5**2)
    with pytest.raises(ValueError):
        position_sets(torch.tensor([4]), torch.tensor([3]), 4, "all")


def test_three_anchor_example_by_hand() -> None:
    """K = 4, gamma = 0.5, lambda_acc = 2, lambda_rej = 3. Anchors: a = 0 (K' = 4), a = 2 (K' = 3), a = 4 (K' = 4).
    A = {1} / {1, 2, 3} / {1, 2, 3, 4}; R = {1, 2, 3, 4} / {3} / {}."""
    accepted, valid_len = torch.tensor([0, 2, 4]), torch.tensor([4, 3, 4])
    sp = spec(gamma=0.5, lambda_acc=2.0, lambda_rej=3.0)
    hidden, weight, teacher = tensors(0, 11, 6, 13)
    fw, rv = exact_kls(hidden @ weight.T, teacher)
    fw, rv = fw.tolist(), rv.tolist()
    # flat rows: anchor 1 -> 0..3, anchor 2 -> 4..6, anchor 3 -> 7..10
    num = 2 * (fw[0] + fw[4] + fw[5] + fw[6] + fw[7] + fw[8] + fw[9] + fw[10])
    num += 3 * (rv[0] + 0.5 * rv[1] + 0.25 * rv[2] + 0.125 * rv[3] + 0.25 * rv[6])
    den = 2 * 8 + 3 * (1 + 0.5 + 0.25 + 0.125 + 0.25)
    assert denominator(accepted, valid_len, 4, sp) == pytest.approx(den) == pytest.approx(22.375)
    terms = objective_terms(FullInputs(hidden, weight, teacher), accepted, valid_len, 4, sp)
    assert terms.denominator == pytest.approx(den)
    assert terms.numerator.item() == pytest.approx(num, rel=1e-12)
    assert terms.loss().item() == pytest.approx(num / den, rel=1e-12)
    m = terms.metrics
    assert (m["n_acc"], m["n_rej"], m["rej_weight"]) == (8, 5, pytest.approx(2.125))
    assert m["loss_fwd"] + m["loss_rev"] == pytest.approx(m["loss"])


@pytest.mark.parametrize("directions", ["mixed", "forward", "reverse"])
@pytest.mark.parametrize("scope", ["all", "first"])
def test_full_objective_matches_brute_force(directions: str, scope: str) -> None:
    accepted, valid_len = anchors(1, 6, 5)
    T = int(valid_len.sum())
    hidden, weight, teacher = tensors(2, T, 8, 19)
    weights = dict(gamma=0.7, lambda_acc=1.5, lambda_rej=0.5)
    sp = spec(directions=directions, rejected_scope=scope, **weights)
    fw, rv = exact_kls(hidden @ weight.T, teacher)
    num, den = brute_objective(fw.tolist(), rv.tolist(), accepted, valid_len, sp)
    terms = objective_terms(FullInputs(hidden, weight, teacher), accepted, valid_len, 5, sp)
    assert terms.numerator.item() == pytest.approx(num, rel=1e-12)
    assert terms.denominator == pytest.approx(den) == denominator(accepted, valid_len, 5, sp)
    # the ablations keep every position's weight and the denominator: only the divergence changes
    assert den == pytest.approx(denominator(accepted, valid_len, 5, spec(rejected_scope=scope, **weights)))
    if directions == "forward":
        assert terms.metrics["n_rev"] == 0 and terms.metrics["loss_rev"] == 0
    if directions == "reverse":
        assert terms.metrics["n_fwd"] == 0 and terms.metrics["loss_fwd"] == 0


# ---------------------------------------------------------------------------------------------------------------
# The chunked `full` estimator


@pytest.mark.parametrize("chunks", [(1, 1), (3, 4), (4, 7), (64, 64)])
def test_full_chunked_values_and_gradients_match_naive(chunks: tuple[int, int]) -> None:
    token_chunk, vocab_chunk = chunks
    T, H, V = 9, 6, 23
    hidden, weight, teacher = tensors(3, T, H, V)
    g = torch.Generator().manual_seed(4)
    w_fwd, w_rev = torch.rand(T, generator=g, dtype=F64), torch.rand(T, generator=g, dtype=F64)
    w_fwd[2], w_rev[5] = 0, 0
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    num, fkl, rkl = full_kl(h1, w1, teacher, w_fwd, w_rev, 10.0, token_chunk, vocab_chunk)
    num.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lq, lp = torch.log_softmax(h2 @ w2.T, -1), torch.log_softmax(teacher, -1)
    naive_f, naive_r = (lp.exp() * (lp - lq)).sum(-1), (lq.exp() * (lq - lp)).sum(-1)
    naive = (w_fwd * naive_f + w_rev * naive_r).sum()
    naive.backward()
    torch.testing.assert_close(num, naive, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fkl, naive_f.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rkl, naive_r.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12)


def test_full_gradcheck_and_frozen_lm_head() -> None:
    hidden, weight, teacher = tensors(5, 5, 4, 11)
    w_fwd, w_rev = torch.tensor([1.0, 0, 2, 0.5, 1], dtype=F64), torch.tensor([0, 1.0, 0.3, 1, 0], dtype=F64)
    h, w = hidden.requires_grad_(), weight.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda h, w: full_kl(h, w, teacher, w_fwd, w_rev, 10.0, 2, 3)[0], (h, w))
    num, _, _ = full_kl(h, weight, teacher, w_fwd, w_rev, 10.0, 2, 3)  # frozen (shared target) lm_head
    (grad_h,) = torch.autograd.grad(num, h)
    assert grad_h.shape == h.shape and weight.grad is None


# ---------------------------------------------------------------------------------------------------------------
# `topk` and `token` estimators


def test_topk_with_k_equal_vocab_equals_full() -> None:
    T, H, V = 7, 5, 16
    hidden, weight, teacher = tensors(6, T, H, V)
    student = hidden @ weight.T
    lp = torch.log_softmax(teacher, -1)
    ids = lp.topk(V, -1).indices
    draft_ids = student.topk(3, -1).indices  # all duplicates of teacher ids here
    fkl, rkl = topk_kl(student, ids, lp.gather(-1, ids), draft_ids, lp.gather(-1, draft_ids))
    fw, rv = exact_kls(student, teacher)
    torch.testing.assert_close(fkl, fw, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(rkl, rv, rtol=1e-10, atol=1e-12)


def test_topk_matches_coarse_grained_brute_force() -> None:
    T, V, k, m = 6, 20, 4, 3
    g = torch.Generator().manual_seed(7)
    student = torch.randn(T, V, generator=g, dtype=F64) * 2
    lp_full = torch.log_softmax(torch.randn(T, V, generator=g, dtype=F64) * 2, -1)
    t_ids = lp_full.topk(k, -1).indices
    d_ids = student.topk(m, -1).indices
    d_ids[:, 0] = t_ids[:, 1]  # force a duplicate in every row
    s = student.clone().requires_grad_()
    fkl, rkl = topk_kl(s, t_ids, lp_full.gather(-1, t_ids), d_ids, lp_full.gather(-1, d_ids))
    q_full = torch.softmax(student, -1)
    for t in range(T):
        S = set(t_ids[t].tolist()) | set(d_ids[t].tolist())
        p = {v: math.exp(lp_full[t, v].item()) for v in S}
        q = {v: q_full[t, v].item() for v in S}
        p_tail, q_tail = 1 - sum(p.values()), 1 - sum(q.values())
        f = sum(p[v] * math.log(p[v] / q[v]) for v in S) + p_tail * math.log(p_tail / q_tail)
        r = sum(q[v] * math.log(q[v] / p[v]) for v in S) + q_tail * math.log(q_tail / p_tail)
        assert fkl[t].item() == pytest.approx(f, rel=1e-9)
        assert rkl[t].item() == pytest.approx(r, rel=1e-9)
        assert 0 <= f <= exact_kls(student[t], lp_full[t])[0].item() + 1e-12  # a lower bound of the full KL
    (fkl.sum() + rkl.sum()).backward()
    assert s.grad is not None and bool(torch.isfinite(s.grad).all())


def test_topk_tail_of_a_confident_float32_teacher_is_exact() -> None:
    """A teacher whose mass outside S is ~1e-8 in float32: ``1 - sum(p over S)`` cancels to 0 there, so the tail's
    log would be log(tiny) = -87 and the reverse KL's tail term q_tail * (log q_tail + 87) would dwarf the true KL.
    With the tail the replay ships (`teacher_log_tail`, summed in log space), the estimator is the coarse-grained
    KL computed in float64 (a lower bound of the full KL, both directions), and so is its gradient."""
    V, k, m = 2000, 16, 16
    g = torch.Generator().manual_seed(1)
    base = torch.randn(1, V, generator=g)
    zt = base.clone()
    zt[0, 7] = 25.0  # the teacher: one token, tail mass ~1e-8
    zs = base * 1.5
    zs[0, 7] = 12.0  # the student agrees on the top token, with ~3% of its mass elsewhere
    lp_full = torch.log_softmax(zt, -1)  # float32, as the replay ships it
    t_lp, t_ids = lp_full.topk(k, -1)
    d_ids = zs.topk(m, -1).indices
    tail = teacher_log_tail(lp_full, t_ids, d_ids)
    s = zs.clone().requires_grad_()
    fkl, rkl = topk_kl(s, t_ids, t_lp, d_ids, lp_full.gather(-1, d_ids), tail)
    (grad,) = torch.autograd.grad(rkl.sum(), s)

    # float64 brute force: the KLs of the distributions coarse-grained to S + {tail}
    P, Q = torch.log_softmax(zt.double(), -1)[0].exp(), torch.softmax(zs.double(), -1)[0]
    in_s = torch.zeros(V, dtype=torch.bool)
    in_s[t_ids[0]] = True
    in_s[d_ids[0]] = True
    p_c, q_c = torch.cat([P[in_s], P[~in_s].sum()[None]]), torch.cat([Q[in_s], Q[~in_s].sum()[None]])
    f_want, r_want = (p_c * (p_c / q_c).log()).sum().item(), (q_c * (q_c / p_c).log()).sum().item()
    assert tail.item() == pytest.approx(math.log(P[~in_s].sum().item()), rel=1e-5)
    assert rkl.item() == pytest.approx(r_want, rel=1e-4) and fkl.item() == pytest.approx(
        f_want, rel=1e-3, abs=1e-9
    )
    f_full, r_full = exact_kls(zs.double(), zt.double())
    assert rkl.item() <= r_full.item() * (1 + 1e-4) and fkl.item() <= f_full.item() * (
        1 + 1e-4
    )  # lower bounds (float32)
    zq = zs.double().clone().requires_grad_()
    q_log = torch.log_softmax(zq, -1)[0]
    qc_log = torch.cat([q_log[in_s], q_log[~in_s].logsumexp(-1)[None]])
    (want,) = torch.autograd.grad((qc_log.exp() * (qc_log - p_c.log())).sum(), zq)
    torch.testing.assert_close(grad.double(), want, rtol=1e-3, atol=1e-6)

    # the fallback (no shipped tail) is what the replay shipped before: 1 - sum cancels and inflates the RKL
    _, r_cancelled = topk_kl(zs, t_ids, t_lp, d_ids, lp_full.gather(-1, d_ids))
    assert r_cancelled.item() > 2 * r_full.item()


def test_token_estimators_match_direct_formulas() -> None:
    T, V = 8, 16
    g = torch.Generator().manual_seed(8)
    student = torch.randn(T, V, generator=g, dtype=F64)
    teacher = torch.log_softmax(torch.randn(T, V, generator=g, dtype=F64), -1)
    c, y = torch.randint(0, V, (T,), generator=g), torch.randint(0, V, (T,), generator=g)
    lp_c, lp_y = teacher.gather(-1, c[:, None])[:, 0], teacher.gather(-1, y[:, None])[:, 0]
    fkl, rkl, cl_f, cl_r = token_kl(student, c, y, lp_c, lp_y, clamp=10.0)
    q_all = torch.softmax(student, -1)
    for t in range(T):
        p, q = math.exp(lp_c[t].item()), q_all[t, c[t]].item()
        bern = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
        delta = lp_y[t].item() - math.log(q_all[t, y[t]].item())
        assert fkl[t].item() == pytest.approx(bern, rel=1e-9)
        assert rkl[t].item() == pytest.approx(math.exp(delta) - delta - 1, rel=1e-9)
    assert not bool(cl_f.any() or cl_r.any())
    # the student's own log-probs work as logits too
    fkl2, rkl2, _, _ = token_kl(torch.log_softmax(student, -1), c, y, lp_c, lp_y, clamp=10.0)
    torch.testing.assert_close(fkl2, fkl)
    torch.testing.assert_close(rkl2, rkl)


def test_token_objective_matches_brute_force_with_logprob_clamps() -> None:
    accepted, valid_len = anchors(9, 5, 4)
    T, V = int(valid_len.sum()), 12
    g = torch.Generator().manual_seed(10)
    student = torch.randn(T, V, generator=g, dtype=F64)
    c, y = torch.randint(0, V, (T,), generator=g), torch.randint(0, V, (T,), generator=g)
    lp_c, lp_y = -torch.rand(T, generator=g, dtype=F64) * 3, -torch.rand(T, generator=g, dtype=F64) * 3
    lp_y[0], lp_c[1] = -30.0, -25.0  # teacher log-probs below -clamp
    sp = spec(estimator="token", logprob_clamp=10.0)
    terms = objective_terms(TokenInputs(student, c, y, lp_c, lp_y), accepted, valid_len, 4, sp)
    lq = torch.log_softmax(student, -1)
    fkl, rkl = [], []
    for t in range(T):  # direct formulas on log-probs clamped at -10
        p, q = math.exp(max(lp_c[t].item(), -10)), math.exp(max(lq[t, c[t]].item(), -10))
        fkl.append(p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q)))
        delta = max(lp_y[t].item(), -10) - max(lq[t, y[t]].item(), -10)
        rkl.append(math.exp(delta) - delta - 1)
    num, den = brute_objective(fkl, rkl, accepted, valid_len, sp)
    assert terms.numerator.item() == pytest.approx(num, rel=1e-12)
    assert terms.denominator == pytest.approx(den)
    # anchor 0 is a full accept: rows 0..3 carry forward KL only, so the clamp of row 0's drafted-token log-prob
    # is unused and only row 1's committed-token clamp counts
    assert accepted[0] == valid_len[0] == 4
    assert terms.metrics["n_logprob_clamped"] == 1


# ---------------------------------------------------------------------------------------------------------------
# Clamping, global normalisation, SFT ablation


def test_loss_cap_counts_and_gradients() -> None:
    accepted, valid_len = anchors(11, 6, 4)
    T = int(valid_len.sum())
    hidden, weight, teacher = tensors(12, T, 6, 17)
    teacher = teacher * 3  # sharper teacher: a spread of KL values around the cap
    fw, rv = exact_kls(hidden @ weight.T, teacher)
    cap = float(torch.cat([fw, rv]).median())
    sp = spec(logprob_clamp=cap)
    h = hidden.clone().requires_grad_()
    terms = objective_terms(FullInputs(h, weight, teacher), accepted, valid_len, 4, sp)
    num, _ = brute_objective(fw.tolist(), rv.tolist(), accepted, valid_len, sp)
    assert terms.numerator.item() == pytest.approx(num, rel=1e-12)
    sets = position_sets(accepted, valid_len, 4, "all")
    use_f, use_r = sets.forward_set[sets.valid], sets.rejected[sets.valid]
    expected = int(((fw > cap) & use_f).sum() + ((rv > cap) & use_r).sum())
    assert terms.metrics["n_clamped"] == expected > 0
    # capped terms pass a gradient scaled by cap / KL: compare with naive autograd of kl * min(1, cap / kl)
    terms.numerator.backward()
    h2 = hidden.clone().requires_grad_()
    lq, lp = torch.log_softmax(h2 @ weight.T, -1), torch.log_softmax(teacher, -1)
    nf, nr = (lp.exp() * (lp - lq)).sum(-1), (lq.exp() * (lq - lp)).sum(-1)
    w_rej = torch.tensor(
        [0.8 ** (k - 1) for a, kv in zip(accepted.tolist(), valid_len.tolist()) for k in range(1, kv + 1)],
        dtype=F64,
    )

    def cap_(x: torch.Tensor) -> torch.Tensor:
        return x * (cap / x.detach()).clamp(max=1.0)

    naive = (use_f * cap_(nf)).sum() + (use_r * w_rej * cap_(nr)).sum()
    naive.backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("estimator", ["full", "topk", "token"])
def test_confident_mistake_gets_a_gradient(estimator: str) -> None:
    """The draft puts q(y) = 0.95 on a token the teacher gives p(y) = 1e-7 (RKL ~ 15.3 > the cap of 10): the
    rejected position must still push q(y) down, under every estimator."""
    V, y = 8, 3
    lq = torch.full((V,), math.log(0.05 / (V - 1)), dtype=F64)
    lq[y] = math.log(0.95)
    lp = torch.full((V,), math.log((1 - 1e-7) / (V - 1)), dtype=F64)
    lp[y] = math.log(1e-7)
    rkl = float((lq.exp() * (lq - lp)).sum())
    assert rkl > 15.0  # above the cap
    accepted, valid_len = torch.tensor([0]), torch.tensor([1])  # one block of one token, rejected: k = a + 1
    sp = spec(estimator=estimator, logprob_clamp=10.0, directions="reverse")
    hidden = torch.eye(V, dtype=F64)[:1] * 0 + lq[None]  # (1, V): logits = hidden @ I
    hidden.requires_grad_()
    inputs: FullInputs | TopkInputs | TokenInputs
    if estimator == "full":
        inputs = FullInputs(hidden, torch.eye(V, dtype=F64), lp[None])
    elif estimator == "topk":
        ids = lp.topk(4).indices[None]  # the teacher's top 4 do not include y
        inputs = TopkInputs(hidden, ids, lp[None].gather(-1, ids))
    else:
        c = torch.tensor([int(lp.argmax())])
        inputs = TokenInputs(hidden, c, torch.tensor([y]), lp[c], lp[torch.tensor([y])])
    terms = objective_terms(inputs, accepted, valid_len, 1, sp)
    assert terms.metrics["loss"] <= 10.0 + 1e-9  # the value is capped
    terms.numerator.backward()
    assert hidden.grad is not None
    assert hidden.grad[0, y] > 1e-3  # descent lowers the drafted token's logit


@pytest.mark.parametrize("estimator", ["full", "topk", "token"])
def test_whole_batch_equals_micro_batches_and_ranks(estimator: str) -> None:
    accepted, valid_len = anchors(13, 7, 4)
    T, H, V = int(valid_len.sum()), 5, 14
    hidden, weight, teacher = tensors(14, T, H, V)
    lp = torch.log_softmax(teacher, -1)
    g = torch.Generator().manual_seed(15)
    c, y = torch.randint(0, V, (T,), generator=g), torch.randint(0, V, (T,), generator=g)
    t_ids = lp.topk(4, -1).indices
    sp = spec(estimator=estimator, gamma=0.6, lambda_rej=2.0)

    def terms_for(lo: int, hi: int, h: torch.Tensor, w: torch.Tensor):
        rows = slice(int(valid_len[:lo].sum()), int(valid_len[:hi].sum()))
        if estimator == "full":
            inputs: FullInputs | TopkInputs | TokenInputs = FullInputs(h, w, teacher[rows])
        elif estimator == "topk":
            ids = t_ids[rows]
            inputs = TopkInputs(h @ w.T, ids, lp[rows].gather(-1, ids))
        else:
            cr, yr = c[rows], y[rows]
            l_c, l_y = lp[rows].gather(-1, cr[:, None])[:, 0], lp[rows].gather(-1, yr[:, None])[:, 0]
            inputs = TokenInputs(h @ w.T, cr, yr, l_c, l_y)
        return objective_terms(inputs, accepted[lo:hi], valid_len[lo:hi], 4, sp), rows

    def run(splits: list[tuple[int, int]], separate_params: bool) -> tuple[float, torch.Tensor, torch.Tensor]:
        global_den = sum(denominator(accepted[lo:hi], valid_len[lo:hi], 4, sp) for lo, hi in splits)
        loss, grad_h, grad_w = 0.0, torch.zeros_like(hidden), torch.zeros_like(weight)
        shared_w = weight.clone().requires_grad_()
        for lo, hi in splits:
            w = weight.clone().requires_grad_() if separate_params else shared_w  # a rank's own replica
            rows = slice(int(valid_len[:lo].sum()), int(valid_len[:hi].sum()))
            h = hidden[rows].clone().requires_grad_()
            terms, _ = terms_for(lo, hi, h, w)
            part = terms.loss(global_den)
            part.backward()
            loss += part.item()
            grad_h[rows] = h.grad
            if separate_params:
                grad_w += w.grad  # all-reduce SUM over ranks
        return loss, grad_h, grad_w if separate_params else shared_w.grad

    whole = run([(0, 7)], False)
    micro = run([(0, 2), (2, 3), (3, 7)], False)
    ranks = run([(0, 4), (4, 7)], True)
    for other in (micro, ranks):
        assert other[0] == pytest.approx(whole[0], rel=1e-12)
        torch.testing.assert_close(other[1], whole[1], rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(other[2], whole[2], rtol=1e-10, atol=1e-13)


def test_sft_on_rollouts_is_mean_cross_entropy() -> None:
    g = torch.Generator().manual_seed(16)
    logits, ids = torch.randn(9, 11, generator=g, dtype=F64), torch.randint(0, 11, (9,), generator=g)
    terms = sft_terms(logits, ids)
    direct = -sum(math.log(torch.softmax(logits[t], -1)[ids[t]].item()) for t in range(9))
    assert terms.numerator.item() == pytest.approx(direct, rel=1e-12)
    assert terms.denominator == 9 and terms.loss().item() == pytest.approx(direct / 9, rel=1e-12)


def test_invalid_spec_and_mismatched_inputs_fail_clearly() -> None:
    with pytest.raises(ValueError, match="rejected_scope"):
        spec(rejected_scope="some")
    with pytest.raises(ValueError, match="gamma"):
        spec(gamma=0.0)
    with pytest.raises(ValueError, match="loss.token_chunk"):
        spec(token_chunk=0)
    hidden, weight, teacher = tensors(17, 4, 3, 5)
    with pytest.raises(TypeError, match="TokenInputs"):
        objective_terms(
            FullInputs(hidden, weight, teacher),
            torch.tensor([1]),
            torch.tensor([4]),
            4,
            spec(estimator="token"),
        )
    with pytest.raises(ValueError, match="rows"):
        objective_terms(FullInputs(hidden, weight, teacher), torch.tensor([1]), torch.tensor([3]), 4, spec())


def test_draft_topm_gives_a_confident_mistake_outside_the_teachers_top_k_its_own_term() -> None:
    """`loss.draft_topm`: the draft puts q(y) = 0.9 on y, outside the teacher's top-k (p(y) = 1e-6). With the
    teacher's top-k alone y is merged into the tail, where the teacher also keeps mass, and its reverse-KL term is
    the tail's; with the draft's own top-m in the support y is a bin of its own. Checked against the brute-force KL
    of both coarse-grainings, and by the gradient on y's logit (descent must lower it)."""
    V, y, k = 12, 5, 3
    lq = torch.full((V,), math.log(0.1 / (V - 1)), dtype=F64)
    lq[y] = math.log(0.9)
    p = torch.linspace(1.0, 2.0, V, dtype=F64)
    p[y] = 0.0
    p = p / p.sum() * (1 - 1e-6)
    p[y] = 1e-6
    lp = p.log()
    t_ids = lp.topk(k).indices[None]  # (1, k): y is not among them
    assert y not in t_ids[0].tolist()
    d_ids = lq.topk(2).indices[None]  # the draft's own top-2: y first
    assert int(d_ids[0, 0]) == y

    def brute(support: set[int]) -> float:
        q, pp = lq.exp(), lp.exp()
        tail = [v for v in range(V) if v not in support]
        qt, pt = float(q[tail].sum()), float(pp[tail].sum())
        return sum(float(q[v] * (lq[v] - lp[v])) for v in support) + qt * math.log(qt / pt)

    accepted, valid_len = torch.tensor([0]), torch.tensor([1])
    sp = spec(estimator="topk", logprob_clamp=1e9, directions="reverse")
    grads, values = {}, {}
    for name, extra in (("teacher top-k", None), ("with the draft's top-m", d_ids)):
        s = lq[None].clone().requires_grad_()
        inputs = TopkInputs(
            s,
            t_ids,
            lp[None].gather(-1, t_ids),
            extra,
            lp[None].gather(-1, extra) if extra is not None else None,
        )
        terms = objective_terms(inputs, accepted, valid_len, 1, sp)
        loss = terms.loss()  # the correction position's weight divided out: the position's reverse KL
        loss.backward()
        assert s.grad is not None
        grads[name], values[name] = float(s.grad[0, y]), float(loss.detach())
    support_k = set(t_ids[0].tolist())
    assert values["teacher top-k"] == pytest.approx(brute(support_k), rel=1e-9)
    assert values["with the draft's top-m"] == pytest.approx(
        brute(support_k | set(d_ids[0].tolist())), rel=1e-9
    )
    # y's own bin: the term grows from the tail's (the teacher's tail mass hides the mistake) to q(y) log q/p
    assert values["with the draft's top-m"] > values["teacher top-k"] + 5.0
    assert grads["with the draft's top-m"] > 1.0  # a non-zero gradient that lowers y's logit
    assert grads["with the draft's top-m"] > 2 * grads["teacher top-k"]

"""The refit proof's arithmetic (`sync/refit.py`) and the NCCL transport's plan and selection (`sync/nccl.py`):
fingerprints that survive vLLM's layout changes and catch any changed value, the name mapping, the ack check's
one-line errors. No vLLM, no Ray."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from draft_opd_ray.errors import ConfigError, RefitError
from draft_opd_ray.sync.nccl import nccl_plan, rank_offsets, require_cuda, weight_sync_kind
from draft_opd_ray.sync.refit import (
    RefitAck,
    add,
    check_ack,
    combine_ranks,
    compare,
    expected_served,
    fingerprints,
    kv_replicas,
    served_key,
    tensor_fingerprint,
)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.self_attn.q_proj.weight": torch.randn(8, 4, generator=g),
        "layers.0.self_attn.k_proj.weight": torch.randn(4, 4, generator=g),
        "layers.0.self_attn.v_proj.weight": torch.randn(4, 4, generator=g),
        "layers.0.mlp.gate_proj.weight": torch.randn(6, 4, generator=g),
        "layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g),
        "norm.weight": torch.randn(4, generator=g),
        "lm_head.weight": torch.randn(10, 4, generator=g),
        "d2t": torch.randint(0, 50, (10,), generator=g),
        "t2d": torch.rand(50, generator=g) > 0.5,
    }


def _served(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """What a vLLM engine holds for ``state``: stacked, prefixed, renamed, padded, t2d dropped, an extra shared
    embedding, linear weights transposed (read back through the kernel)."""
    p = "layers.0."
    return {
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat(
            [state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        )
        .to(dtype)
        .t(),
        "model.layers.0.mlp.gate_up_proj.weight": torch.cat(
            [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]
        ).to(dtype),
        "model.norm.weight": state["norm.weight"].to(dtype),
        "lm_head.weight": torch.cat([state["lm_head.weight"], torch.zeros(6, 4)]).to(dtype),  # vocab padding
        "draft_id_to_target_id": state["d2t"],
        "model.embed_tokens.weight": torch.randn(50, 4).to(dtype),  # the target's, shared
    }


def test_fingerprint_is_order_free_additive_and_exact() -> None:
    t = torch.randn(64, 16)
    assert tensor_fingerprint(t) == tensor_fingerprint(t.t()) == tensor_fingerprint(t.flip(0))
    assert tensor_fingerprint(torch.cat([t, torch.zeros(3, 16)])) == tensor_fingerprint(t)  # padding
    a, b = t[:20], t[20:]
    assert add(tensor_fingerprint(a), tensor_fingerprint(b)) == tensor_fingerprint(t)
    for i, j in [(0, 0), (63, 15), (10, 3)]:
        bumped = t.clone()
        bumped[i, j] = torch.nextafter(bumped[i, j], torch.tensor(float("inf")))  # one ulp
        assert tensor_fingerprint(bumped) != tensor_fingerprint(t)
    assert tensor_fingerprint(torch.tensor([-0.0, 1.0])) == tensor_fingerprint(torch.tensor([0.0, 1.0]))
    # in a served dtype: the sender's rounding equals the receiver's values exactly
    assert tensor_fingerprint(t, torch.bfloat16) == tensor_fingerprint(t.to(torch.bfloat16))
    assert tensor_fingerprint(t, torch.bfloat16) != tensor_fingerprint(t)
    ids = torch.tensor([3, 1 << 40, -7])
    assert tensor_fingerprint(ids, torch.bfloat16) == tensor_fingerprint(
        ids
    )  # integer tensors keep their dtype


def test_served_names() -> None:
    assert served_key("midlayer.self_attn.k_proj.weight") == "midlayer.self_attn.qkv_proj.weight"
    assert served_key("layers.3.mlp.up_proj.weight") == "layers.3.mlp.gate_up_proj.weight"
    assert served_key("d2t") == "draft_id_to_target_id"
    served = ["model.layers.1.x.weight", "model.layers.11.x.weight", "model.norm.weight"]
    e = expected_served({"layers.1.x.weight": (1, 2), "norm.weight": (3, 4)}, served)
    assert e.served == {"model.layers.1.x.weight": (1, 2), "model.norm.weight": (3, 4)} and not e.unplaced
    e = expected_served({"midlayer.x.weight": (1, 2)}, served, aliases={"midlayer.": "layers.1."})
    assert e.served == {"model.layers.1.x.weight": (1, 2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_ack_accepts_the_served_layout_and_names_what_differs(dtype: torch.dtype) -> None:
    state = _state()
    name = str(dtype).removeprefix("torch.")
    sent = {name: fingerprints(state.items(), dtype)}
    served = fingerprints(_served(state, dtype).items())
    check_ack(RefitAck("rollout worker 0", 3, name, served), 3, sent)  # the same weights: no error
    with pytest.raises(RefitError, match="version 3 on rollout worker 0: it serves version 2"):
        check_ack(RefitAck("rollout worker 0", 2, name, served), 3, sent)
    corrupt = dict(
        state, **{"layers.0.self_attn.v_proj.weight": state["layers.0.self_attn.v_proj.weight"] * 1.5}
    )
    bad = fingerprints(_served(corrupt, dtype).items())
    with pytest.raises(RefitError, match=r"rollout worker 1 \(.*\): served values differ .*qkv_proj"):
        check_ack(RefitAck("rollout worker 1", 3, name, bad), 3, sent)
    stale = fingerprints(_served(_state(seed=1), dtype).items())
    with pytest.raises(RefitError, match="differ from the sent ones in"):
        check_ack(RefitAck("replay actor", 3, name, stale), 3, sent)
    missing = {k: v for k, v in served.items() if k != "model.norm.weight"}
    with pytest.raises(RefitError, match="sent tensors the engine does not hold: norm.weight"):
        check_ack(RefitAck("rollout worker 0", 3, name, missing), 3, sent)
    with pytest.raises(RefitError, match="no checksum was taken in its dtype float16"):
        check_ack(RefitAck("rollout worker 0", 3, "float16", served), 3, sent)


def test_tensor_parallel_ranks_combine() -> None:
    w, norm = torch.randn(8, 4), torch.randn(4)
    ranks = [fingerprints([("w", w[:4]), ("norm", norm)]), fingerprints([("w", w[4:]), ("norm", norm)])]
    assert combine_ranks(ranks) == fingerprints([("w", w), ("norm", norm)])


def _vllm_tp_ranks(
    state: dict[str, torch.Tensor], tp: int, heads: int, kv_heads: int, dtype: torch.dtype
) -> list[dict[str, torch.Tensor]]:
    """What each tensor-parallel rank of a vLLM engine holds for ``state``, sharded as vLLM 0.32 shards it:
    `QKVParallelLinear` gives rank i query heads [i·h/tp, (i+1)·h/tp) and, when the ranks outnumber the KV heads,
    KV head i // (tp / kv_heads) (each KV head on several ranks), else KV heads [i·kv/tp, (i+1)·kv/tp);
    `RowParallelLinear` (o_proj) splits the input columns; the norm is replicated."""
    p = "layers.0.self_attn."
    q, k, v = (state[p + f"{x}_proj.weight"] for x in "qkv")
    d = q.shape[0] // heads  # head dim
    reps = max(1, tp // kv_heads)
    ranks = []
    for i in range(tp):
        nq = heads // tp
        if tp >= kv_heads:
            kv_rows = slice(
                (i // reps) * d, (i // reps + 1) * d
            )  # one KV head, shared with reps-1 other ranks
        else:
            nk = kv_heads // tp
            kv_rows = slice(i * nk * d, (i + 1) * nk * d)
        qkv = torch.cat([q[i * nq * d : (i + 1) * nq * d], k[kv_rows], v[kv_rows]])
        o = state[p + "o_proj.weight"]
        cols = o.shape[1] // tp
        ranks.append(
            {
                "model.layers.0.self_attn.qkv_proj.weight": qkv.to(dtype),
                "model.layers.0.self_attn.o_proj.weight": o[:, i * cols : (i + 1) * cols].to(dtype),
                "model.norm.weight": state["norm.weight"].to(dtype),
            }
        )
    return ranks


@pytest.mark.parametrize(("tp", "heads", "kv_heads"), [(4, 8, 2), (4, 4, 1), (8, 8, 2), (2, 8, 4), (2, 4, 2)])
def test_refit_check_counts_kv_heads_replicated_over_tensor_parallel_ranks(
    tp: int, heads: int, kv_heads: int
) -> None:
    """Brute force: the ranks' shards built the way vLLM replicates KV heads, combined like the engine's ack;
    the check passes with the engine's tensor-parallel size and KV heads, and a changed k value still fails."""
    d, hidden = 2, 8
    g = torch.Generator().manual_seed(tp * 100 + kv_heads)
    p = "layers.0.self_attn."
    state = {
        p + "q_proj.weight": torch.randn(heads * d, hidden, generator=g),
        p + "k_proj.weight": torch.randn(kv_heads * d, hidden, generator=g),
        p + "v_proj.weight": torch.randn(kv_heads * d, hidden, generator=g),
        p + "o_proj.weight": torch.randn(hidden, heads * d, generator=g),
        "norm.weight": torch.randn(hidden, generator=g),
    }
    dtype = torch.bfloat16
    sent = {"bfloat16": fingerprints(state.items(), dtype)}

    def ack(s: dict[str, torch.Tensor]) -> RefitAck:
        ranks = [fingerprints(r.items()) for r in _vllm_tp_ranks(s, tp, heads, kv_heads, dtype)]
        return RefitAck("rollout worker 0", 1, "bfloat16", combine_ranks(ranks), {}, tp, kv_heads)

    check_ack(ack(state), 1, sent)
    bumped = dict(state, **{p + "k_proj.weight": state[p + "k_proj.weight"].clone()})
    bumped[p + "k_proj.weight"][0, 0] += 1.0
    with pytest.raises(RefitError, match="qkv_proj"):
        check_ack(ack(bumped), 1, sent)
    if tp > kv_heads:  # without the engine's shape the replicated heads look like a wrong refit
        plain = dataclasses.replace(ack(state), tensor_parallel=1, kv_heads=0)
        with pytest.raises(RefitError, match="qkv_proj"):
            check_ack(plain, 1, sent)
    assert kv_replicas(tp, kv_heads) == max(1, tp // kv_heads)


def test_compare_none_when_equal() -> None:
    fp = fingerprints(_state().items())
    assert compare(expected_served(fp, fp), fp) is None


def test_nccl_selection_plan_and_cuda_check() -> None:
    assert weight_sync_kind("auto", 1, 0) == "shm_file"
    assert weight_sync_kind("auto", 2, 0) == "object_store"
    assert weight_sync_kind("auto", 1, 8) == "nccl"
    assert weight_sync_kind("shm_file", 1, 8) == "shm_file"
    with pytest.raises(ConfigError, match="rollout.weight_sync: nccl needs GPUs"):
        weight_sync_kind("nccl", 1, 0)
    with pytest.raises(ConfigError, match="must be one of"):
        weight_sync_kind("tcp", 1, 0)
    state = _state()
    plan = nccl_plan(state)
    assert plan["names"] == list(state)
    assert plan["dtype_names"][0] == "float32" and plan["dtype_names"][-2:] == ["int64", "bool"]
    assert plan["shapes"][0] == [8, 4] and plan["shapes"][5] == [4]
    assert rank_offsets([2, 2, 1]) == [1, 3, 5]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="nccl needs a CUDA device in the learner"):
            require_cuda("learner")

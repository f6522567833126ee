"""The SFT feature cache: sharded as it is written (bounded shards), read lazily (only the rows asked for), split
between data-parallel ranks (each writes its shards; together the same cache as one process), and the target
forward on the rank's device (`actor_device`, here the ``meta`` device: no GPU needed to see where tensors go)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

import draft_opd_ray.sft.features as features
from draft_opd_ray.sft.features import (
    INDEX,
    FeatureCache,
    FeatureSpec,
    PassShare,
    load_hf_target,
    plan_shards,
    row_bytes,
    target_features,
)

AUX, TOPK = (1, 2), 4
LENGTHS = (20, 13, 31, 9, 26, 17, 12)


class Stop(Exception):
    pass


def _seqs() -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in LENGTHS]
    return seqs, [5] * len(seqs)


def _build(target: Path, folder: Path, shard_bytes: int, share: PassShare | None = None) -> FeatureCache:
    seqs, plens = _seqs()
    spec = FeatureSpec(AUX, torch.arange(256), topk=TOPK, dtype=torch.float32, forward=torch.float32)
    return FeatureCache.build(
        target, seqs, plens, folder, spec, share or PassShare(), shard_bytes=shard_bytes
    )


def _shard_bytes() -> int:
    """About two sequences of 20 tokens a shard (the tiny target: hidden 64)."""
    return 40 * row_bytes(len(AUX) * 64, TOPK, torch.float32)


@pytest.mark.parametrize("seed", range(10))
def test_shards_cover_the_sequences_in_order_within_the_bound(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 50) for _ in range(rng.randint(0, 30))]
    plan = plan_shards(lengths, 3, 90)
    assert [i for lo, hi in plan for i in range(lo, hi)] == list(range(len(lengths)))
    for lo, hi in plan:
        assert hi - lo == 1 or 3 * sum(lengths[lo:hi]) <= 90  # a longer sequence alone
    for lo, hi in plan[:-1]:  # as full as the bound allows: the next sequence would not fit
        assert 3 * sum(lengths[lo : hi + 1]) > 90


def test_sharded_cache_holds_the_targets_features_and_reads_only_what_is_asked(
    tiny_target: Path, tmp_path: Path
) -> None:
    cache = _build(tiny_target, tmp_path / "c", _shard_bytes())
    shards = sorted((tmp_path / "c").glob("shard_*.safetensors"))
    assert len(shards) == len(cache.shards) >= 3 and (tmp_path / "c" / INDEX).is_file()
    from safetensors import safe_open

    per_token = row_bytes(len(AUX) * 64, TOPK, torch.float32)
    for path, (lo, hi) in zip(shards, cache.shards):  # every shard within the bound (or one sequence)
        with safe_open(str(path), framework="pt") as f:
            stored = f.get_slice("input_ids").get_shape()[0] * per_token
        assert hi - lo == 1 or stored <= _shard_bytes()
    assert cache.rows_read == 0 and not cache._open  # nothing read before it is asked for
    i = 4
    got = cache.get(i)
    assert cache.rows_read == LENGTHS[i] and len(cache._open) == 1  # its rows, from its shard only
    seqs, plens = _seqs()
    model = load_hf_target(tiny_target, torch.float32)
    want = target_features(model, [seqs[i]], AUX, torch.arange(256), TOPK, [plens[i]])[0]
    assert got.input_ids.tolist() == seqs[i] and got.prompt_len == plens[i]
    torch.testing.assert_close(got.features, want[0])
    assert torch.equal(got.topk_ids, want[1]) and torch.equal(got.top1, want[3])
    torch.testing.assert_close(got.topk_p, want[2], atol=1e-3, rtol=1e-3)  # stored in float16
    for j in range(len(cache)):
        assert cache.get(j).features.shape == (LENGTHS[j], len(AUX) * 64)


def test_ranks_share_the_feature_pass_into_the_same_cache(tiny_target: Path, tmp_path: Path) -> None:
    one = _build(tiny_target, tmp_path / "one", _shard_bytes())

    def stop() -> None:
        raise Stop

    # rank 1 of 2 writes the odd shards, then waits for rank 0 (stopped here)
    with pytest.raises(Stop):
        _build(tiny_target, tmp_path / "two", _shard_bytes(), PassShare(1, 2, stop))
    n = len(one.shards)
    names = {p.name for p in (tmp_path / "two").iterdir()}
    assert names == {f"shard_{j:05d}.safetensors" for j in range(1, n, 2)}
    # rank 0 writes the even ones and the index; the cache is the one process's
    two = _build(tiny_target, tmp_path / "two", _shard_bytes(), PassShare(0, 2))
    assert two.shards == one.shards and len(list((tmp_path / "two").glob("shard_*"))) == n
    for i in range(len(one)):
        a, b = one.get(i), two.get(i)
        assert torch.equal(a.features, b.features) and torch.equal(a.topk_ids, b.topk_ids)


def test_the_target_forward_runs_on_the_ranks_device(
    tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model moves to `actor_device()` and the inputs follow it (meta stands in for a rank's GPU: a forward
    with the inputs left on the CPU would fail, or be seen here)."""
    monkeypatch.setattr(features, "actor_device", lambda: torch.device("meta"))
    model = load_hf_target(tiny_target, torch.float32)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    seen: dict[str, torch.device] = {}

    def look(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.update({k: v.device for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        raise Stop

    model.get_decoder().register_forward_pre_hook(look, with_kwargs=True)
    with pytest.raises(Stop):
        target_features(model, [[5, 6, 7], [8, 9]], AUX, torch.arange(256), TOPK, [1, 1])
    assert seen == {"input_ids": torch.device("meta"), "attention_mask": torch.device("meta")}

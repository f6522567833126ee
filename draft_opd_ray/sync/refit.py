"""Refit proof: a receiver shows that the draft it serves after a weight swap is the one the learner sent.

The learner sends checkpoint names (`rollout_state`, as in the exported folder); an engine holds its own layout
(vLLM stacks q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, prefixes names, renames `d2t`, drops `t2d`,
pads the vocabulary, shards over tensor-parallel ranks, and shares the embedding or LM head with the target).
So the check compares *fingerprints* that survive those layout changes:

    fingerprint(t) = (Σ w mod M, Σ ((w mod P)² mod P) mod M) over the integer words w of t's bytes (exact ints)

It ignores the order of the values and adds over concatenation, so fp(qkv) = fp(q) + fp(k) + fp(v), the
fingerprint of a sharded tensor is the sum over its shards, and zero padding adds nothing; yet changing any value
changes it (a collision needs two changed words that cancel in both sums). Floating tensors are fingerprinted in
the dtype the receiver serves in (the sender rounds its float32 weights the same way, round-to-nearest-even, so
the comparison stays exact: zero tolerance at any precision), with -0.0 counted as +0.0.

`expected_served` maps the sent checkpoint names onto the served names with the rules above (`served_key`);
`compare` says what differs, or None. Imports only torch.

Tensor parallelism with fewer KV heads than ranks: vLLM's `QKVParallelLinear` then gives every rank one KV head,
each head on r = tp / kv_heads ranks (rank i loads head i // r), so the ranks' qkv shards add up to
fp(q) + r·fp(k) + r·fp(v). The ack carries the engine's draft tensor-parallel size and KV heads
(`kv_replicas`), and the expected fingerprint counts k and v r times.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

P = 2_147_483_629  # a prime below 2^31: (w mod P)^2 mod P < 2^31, so a chunk's int64 sum cannot overflow
# both sums are kept mod this prime: small ints that any serializer carries, still additive
M = (1 << 61) - 1
_CHUNK = 1 << 24  # words per int64 pass (128 MiB of temporaries)
_WORD = {8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

Fingerprint = tuple[int, int]

# checkpoint names -> vLLM's names: stacked projections, the draft-vocabulary map; names vLLM keeps nowhere
_STACKED = (
    (re.compile(r"\.(q|k|v)_proj\."), ".qkv_proj."),
    (re.compile(r"\.(gate|up)_proj\."), ".gate_up_proj."),
)
_RENAMED = {"d2t": "draft_id_to_target_id"}
NOT_SERVED = frozenset({"t2d"})  # EAGLE-3's target->draft mask: vLLM never loads it


def tensor_fingerprint(t: torch.Tensor, dtype: torch.dtype | None = None) -> Fingerprint:
    """The (order-free, additive) fingerprint of ``t``'s values; a floating ``t`` is first cast to ``dtype``."""
    t = t.detach()
    if t.is_floating_point():
        if dtype is not None and dtype.is_floating_point:
            t = t.to(dtype)
        t = t + 0.0  # -0.0 -> +0.0: a matmul read-back cannot tell them apart
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return (0, 0)
    size = flat.element_size()
    words = flat.view(_WORD[size]) if size in _WORD else flat.view(torch.uint8)
    s1 = s2 = 0
    for start in range(0, words.numel(), _CHUNK):
        w = words[start : start + _CHUNK].to(torch.int64)
        r = w.remainder(P)
        s1 += int(w.sum())
        s2 += int((r * r).remainder(P).sum())
    return (s1 % M, s2 % M)


def add(a: Fingerprint, b: Fingerprint) -> Fingerprint:
    return ((a[0] + b[0]) % M, (a[1] + b[1]) % M)


def times(a: Fingerprint, r: int) -> Fingerprint:
    """The fingerprint of ``r`` copies of a tensor (the sums are additive)."""
    return (a[0] * r % M, a[1] * r % M)


_KV = re.compile(r"(^|\.)(k|v)_proj\.")  # checkpoint names of the key and value projections


def kv_replicas(tensor_parallel: int, kv_heads: int) -> int:
    """On how many tensor-parallel ranks vLLM holds each KV head (`QKVParallelLinear`: tp / kv_heads when the
    ranks outnumber the heads, else 1). ``kv_heads`` 0: unknown, nothing replicated."""
    if kv_heads <= 0 or tensor_parallel <= kv_heads:
        return 1
    if tensor_parallel % kv_heads:
        raise ValueError(f"tensor-parallel size {tensor_parallel} is not a multiple of {kv_heads} KV heads")
    return tensor_parallel // kv_heads


def fingerprints(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> dict[str, Fingerprint]:
    return {name: tensor_fingerprint(t, dtype) for name, t in tensors}


def served_key(name: str) -> str:
    """The name a checkpoint tensor has among the served tensors, up to a prefix (see `expected_served`)."""
    for pattern, repl in _STACKED:
        name = pattern.sub(repl, "." + name)[1:]
    head, dot, tail = name.rpartition(".")
    if not dot:
        return _RENAMED.get(name, name)
    return f"{head}.{_RENAMED.get(tail, tail)}"


def _match(key: str, served: Iterable[str]) -> list[str]:
    """Served names equal to ``key`` or ending in ``.key`` (vLLM adds prefixes like ``model.``); the shortest
    ones only, so ``layers.0.x`` does not also match ``model.layers.10.x``."""
    hits = [s for s in served if s == key or s.endswith("." + key)]
    if len(hits) > 1:
        best = min(len(h) for h in hits)
        hits = [h for h in hits if len(h) == best]
    return hits


@dataclass
class Expectation:
    """What a receiver must serve: fingerprints by served name, and the sent names it could not place."""

    served: dict[str, Fingerprint] = field(default_factory=dict)
    unplaced: list[str] = field(default_factory=list)


def expected_served(
    sent: Mapping[str, Fingerprint],
    served_names: Iterable[str],
    aliases: Mapping[str, str] | None = None,
    kv_replicas: int = 1,
) -> Expectation:
    """The fingerprints the served tensors must have, from the sent ones: each checkpoint name is mapped
    (``aliases`` first: a kind's own renames, e.g. EAGLE-3's ``midlayer.`` -> ``layers.0.``; then `served_key`)
    onto exactly one served name, and stacked parts add up. Served tensors no sent name maps to (the target's
    shared embedding) are not checked. ``kv_replicas``: the ranks that each hold a KV head (`kv_replicas`), so
    a k or v projection stacked into a summed qkv counts that many times."""
    names = list(served_names)
    out = Expectation()
    for name, fp in sent.items():
        if name in NOT_SERVED:
            continue
        key = name
        for old, new in (aliases or {}).items():
            key = key.replace(old, new)
        hits = _match(key, names) or _match(served_key(key), names)  # same layout (a PyTorch copy) or vLLM's
        if len(hits) != 1:
            out.unplaced.append(name)
            continue
        if kv_replicas > 1 and _KV.search(key) and "qkv_proj." in hits[0]:  # stacked, summed over ranks
            fp = times(fp, kv_replicas)
        out.served[hits[0]] = add(out.served.get(hits[0], (0, 0)), fp)
    return out


def compare(expect: Expectation, served: Mapping[str, Fingerprint]) -> str | None:
    """None when every sent tensor is served with its values; else what differs, in a few words."""
    if expect.unplaced:
        return f"sent tensors the engine does not hold: {', '.join(sorted(expect.unplaced)[:4])}"
    bad = sorted(n for n, fp in expect.served.items() if served.get(n) != fp)
    if bad:
        more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
        return f"served values differ from the sent ones in {', '.join(bad[:3])}{more}"
    return None


def combine_ranks(ranks: list[dict[str, Fingerprint]]) -> dict[str, Fingerprint]:
    """One engine's fingerprints from its tensor-parallel ranks: a tensor every rank holds identically is
    replicated (counted once), any other is sharded (its shards add up)."""
    out: dict[str, Fingerprint] = {}
    for name in ranks[0]:
        fps = [r.get(name, (0, 0)) for r in ranks]
        if all(fp == fps[0] for fp in fps):
            out[name] = fps[0]
        else:
            total: Fingerprint = (0, 0)
            for fp in fps:
                total = add(total, fp)
            out[name] = total
    return out


@dataclass(frozen=True)
class RefitAck:
    """What a receiver reports after applying a version: who it is, the version it now serves, the dtype its
    floating tensors are served in, their fingerprints by served name (its ranks combined, `combine_ranks`), the
    kind's renames (`expected_served`), and the draft's tensor-parallel size and KV heads (`kv_replicas`; 0:
    not sharded, e.g. a PyTorch copy)."""

    receiver: str
    version: int
    dtype: str
    tensors: dict[str, Fingerprint]
    aliases: dict[str, str] = field(default_factory=dict)
    tensor_parallel: int = 1
    kv_heads: int = 0


def check_ack(ack: RefitAck, version: int, sent: Mapping[str, Mapping[str, Fingerprint]]) -> None:
    """Raise `RefitError` unless ``ack`` serves ``version`` with the values sent (``sent``: fingerprints of the
    published weights by dtype name, `fingerprints`)."""
    from draft_opd_ray.errors import RefitError

    where = f"weight refit of version {version} on {ack.receiver}"
    if ack.version != version:
        raise RefitError(f"{where}: it serves version {ack.version}")
    if ack.dtype not in sent:
        raise RefitError(f"{where}: no checksum was taken in its dtype {ack.dtype}")
    r = kv_replicas(ack.tensor_parallel, ack.kv_heads)
    what = compare(expected_served(sent[ack.dtype], ack.tensors, ack.aliases, r), ack.tensors)
    if what is not None:
        raise RefitError(f"{where} ({ack.dtype}): {what}")

"""Target trajectories for SFT: prompt -> greedy target response, generated offline with vLLM and cached.

The cache folder is keyed by (target weights, prompt token ids, generation settings): a later run with the
same inputs reuses it. Generation runs in chunks, each written as its own Parquet part (``prompt_ids``,
``response_ids``), so a killed run resumes where it stopped; ``trajectories.parquet`` is written last.
A data set's own answers can be mixed in (``answer_trajectories`` + ``mix_trajectories``): the target only
scores them (features and soft labels), which is ~4x cheaper per token here than generating its own.
Run inside a ``__main__``-guarded process (vLLM spawns its engine core).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

log = logging.getLogger(__name__)

FINAL = "trajectories.parquet"


@dataclass(frozen=True)
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]


def _target_fingerprint(target: Path) -> str:
    """Config plus weight-file sizes/mtimes: cheap and changes whenever the target does."""
    h = hashlib.sha256((target / "config.json").read_bytes())
    for f in sorted(target.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def cache_key(
    target: Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop: Sequence[int],
    dtype: str = "float32",
) -> str:
    h = hashlib.sha256()
    h.update(_target_fingerprint(target).encode())
    settings: dict[str, Any] = {"max_new_tokens": max_new_tokens, "stop": list(stop), "temperature": 0}
    if dtype != "float32":  # float32 keys stay what they were before the setting existed
        settings["dtype"] = dtype
    h.update(json.dumps(settings).encode())
    for p in prompts:
        h.update(json.dumps(list(p)).encode())
    return h.hexdigest()[:20]


def _write(path: Path, rows: Sequence[Trajectory]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "prompt_ids": pa.array([r.prompt_ids for r in rows], pa.list_(pa.int32())),
            "response_ids": pa.array([r.response_ids for r in rows], pa.list_(pa.int32())),
        }
    )
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def read_trajectories(path: str | os.PathLike[str]) -> list[Trajectory]:
    import pyarrow.parquet as pq

    t = pq.read_table(path).to_pydict()
    return [Trajectory(list(p), list(r)) for p, r in zip(t["prompt_ids"], t["response_ids"])]


def kv_cache_gb_for(
    target: Path, prompts: Sequence[Sequence[int]], chunk: int, max_new_tokens: int, dtype: str
) -> float:
    """KV cache (GB) that holds the ``chunk`` longest prompts with their full answers at once (vLLM CPU: so a
    chunk runs as one batch, never preempted), capped at 8 GB."""
    cfg = json.loads((target / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim
    per_token *= 4 if dtype == "float32" else 2
    longest = sorted((len(p) + max_new_tokens for p in prompts), reverse=True)[:chunk]
    return min(8.0, 1.1 * per_token * sum(longest) / 1e9)


def generate_trajectories(
    target: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    cache_dir: str | os.PathLike[str],
    *,
    stop_token_ids: Sequence[int],
    max_new_tokens: int = 256,
    max_model_len: int = 2048,
    chunk: int = 256,
    kvcache_gb: float = 2.0,
    dtype: str = "float32",
) -> Path:
    """Greedy target responses for ``prompts`` (token ids); returns the cached ``trajectories.parquet``.

    ``stop_token_ids``: every id that ends the target's answer (`models.target.stop_token_ids`); they are part of
    the cache key, so answers cut at other ids are never reused.

    ``dtype`` is the serving precision: bfloat16 is faster where the hardware has it (a CPU with AVX512-BF16,
    a GPU), and its greedy text is the target's own up to rounding (it drifts from the float32 text after some
    tokens). The trajectories are only the contexts: the soft labels come from the target's teacher-forced
    forward. The engine runs alone, so on CPU it binds every core (vLLM's default is one), and it decodes
    ``chunk`` requests at once with the KV cache to hold them (vLLM's CPU default caps a batch at 256 sequences;
    docs/design.md, "Why the defaults")."""
    target = Path(target)
    key = cache_key(target, prompts, max_new_tokens, stop_token_ids, dtype)
    folder = Path(cache_dir) / "sft_trajectories" / key
    final = folder / FINAL
    if final.is_file():
        log.info("reusing cached trajectories %s", final)
        return final
    folder.mkdir(parents=True, exist_ok=True)
    # a part is named by its prompt range, so a partial cache written with another chunk size is not misread
    parts = [
        folder / f"part_{i:05d}_{min(i + chunk, len(prompts)):05d}.parquet"
        for i in range(0, len(prompts), chunk)
    ]
    todo = [i for i, p in enumerate(parts) if not p.is_file()]
    if todo:
        from draft_opd_ray.config.schema import DraftConfig, RolloutConfig, TargetConfig
        from draft_opd_ray.rollout.engine import EngineRun, Sampling, SpecDecodeEngine, all_cores

        # vLLM's CPU KV cache is set in whole GiB (the engine takes the integer part)
        kv = int(max(kvcache_gb, kv_cache_gb_for(target, prompts, chunk, max_new_tokens, dtype)))
        engine = SpecDecodeEngine(
            EngineRun(target, "none", dtype=dtype, cpu_bind=all_cores()),  # alone: on CPU, every core
            DraftConfig(num_speculative_tokens=1),
            TargetConfig(max_model_len=max_model_len),
            RolloutConfig(kvcache_gb=kv),
        )
        sampling = Sampling(max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids))
        try:
            bar = tqdm(total=len(prompts), initial=(len(parts) - len(todo)) * chunk, desc="trajectories")
            for i in todo:
                batch = prompts[i * chunk : (i + 1) * chunk]
                recs = engine.generate(batch, sampling)
                _write(parts[i], [Trajectory(r.prompt_ids, r.response_ids) for r in recs if not r.error])
                bar.update(len(batch))
                bar.set_postfix(tokens=sum(len(r.response_ids) for r in recs))
            bar.close()
        finally:
            engine.shutdown()
    rows = [t for p in parts for t in read_trajectories(p)]
    _write(final, rows)
    return final


def answer_trajectories(
    prompts: Sequence[Sequence[int]],
    answers: Sequence[str],
    tokenizer: Any,
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
) -> list[Trajectory]:
    """A data set's own answers as trajectories (teacher forcing: the target scores them, it did not write them).

    Each answer is tokenized without special tokens and cut at ``max_new_tokens``; an uncut answer ends with
    ``eos_token_id`` as the target's own answers do."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    out: list[Trajectory] = []
    for p, text in zip(prompts, answers):
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            continue
        resp = ids[:max_new_tokens]
        if len(ids) < max_new_tokens and eos_token_id is not None:
            resp.append(int(eos_token_id))
        out.append(Trajectory(list(p), resp))
    return out


def mix_trajectories(
    path: str | os.PathLike[str], extra: Sequence[Trajectory], cache_dir: str | os.PathLike[str]
) -> Path:
    """``path``'s trajectories followed by ``extra``, written once to a cache file keyed by both."""
    path = Path(path)
    if not extra:
        return path
    h = hashlib.sha256(path.read_bytes())
    for t in extra:
        h.update(json.dumps([t.prompt_ids, t.response_ids]).encode())
    out = Path(cache_dir) / "sft_trajectories" / f"mixed-{h.hexdigest()[:20]}" / FINAL
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        _write(out, [*read_trajectories(path), *extra])
    return out

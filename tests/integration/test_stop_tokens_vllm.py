"""The SFT answers on the real vLLM CPU engine end at every eos id of the target, not at SmolLM2's 2: a tiny
target whose config.json names one id X and whose generation_config.json adds a second id Y (its tokenizer's eos
is X too), two tokens its greedy answers emit; `generate_trajectories` with the target's stop ids cuts one answer
after its first X and the other after its first Y. The expected answers are the HF model's own greedy decoding
(float32, as vLLM serves it here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.vllm]

NEW = 24


def _first(seq: list[int], tok: int) -> int:
    return seq.index(tok) if tok in seq else len(seq)


def _stops(free: list[list[int]]) -> tuple[int, int]:
    """X from the first answer, Y from the second, each reached before the other id in that answer."""
    a, b = free
    for x in a[3:]:
        for y in b[3:]:
            if 2 not in (x, y) and x != y and _first(a, x) < _first(a, y) and _first(b, y) < _first(b, x):
                return x, y
    raise AssertionError(f"no two stop ids to pick from {free}")


def test_sft_answers_stop_at_every_eos_id_of_the_target(tiny_target: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draft_opd_ray.models.target import target_stop_token_ids
    from draft_opd_ray.rollout.reference import target_generate
    from draft_opd_ray.sft.data import generate_trajectories, read_trajectories

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (8,), generator=g).tolist() for _ in range(2)]
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    free = target_generate(model, prompts, max_new_tokens=NEW)
    x, y = _stops(free)

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "eos_token_id": x}))
    gen = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [x, y]}))
    tok = json.loads((target / "tokenizer_config.json").read_text())
    name = AutoTokenizer.from_pretrained(tiny_target).convert_ids_to_tokens(x)
    (target / "tokenizer_config.json").write_text(json.dumps({**tok, "eos_token": name}))
    stops = target_stop_token_ids(target)
    assert stops == (x, y)

    path = generate_trajectories(
        target, prompts, tmp_path / "cache", stop_token_ids=stops, max_new_tokens=NEW, max_model_len=256
    )
    got = [t.response_ids for t in read_trajectories(path)]
    assert got == [free[0][: _first(free[0], x) + 1], free[1][: _first(free[1], y) + 1]], (free, x, y)
    assert got[0][-1] == x and got[1][-1] == y

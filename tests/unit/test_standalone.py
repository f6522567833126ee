"""Standalone drafts cut from the target (embedding, final norm, LM head, a few layers): logits equal the truncated
target, save/load round trip, vocabulary checks. (The target-folder helpers: test_target_model.py; serving the draft
with vLLM's ``draft_model`` method: tests/integration/test_serve_vllm.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_opd_ray.drafts.standalone.model import (
    build_standalone_from_target,
    check_standalone_against_target,
    load_standalone,
    save_standalone,
)
from draft_opd_ray.errors import ModelError


def _truncated_target(target_path: Path, layer_ids: list[int]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch.float32).eval()
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in layer_ids)
    model.config.num_hidden_layers = len(layer_ids)
    return model


@pytest.mark.parametrize("layer_ids", [None, (1, 3)])
def test_draft_equals_truncated_target(tiny_target: Path, tmp_path: Path, layer_ids) -> None:
    out = build_standalone_from_target(tiny_target, tmp_path / "d", num_layers=2, layer_ids=layer_ids)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 49152
    assert (out / "tokenizer.json").read_bytes() == (tiny_target / "tokenizer.json").read_bytes()
    draft = load_standalone(out, tiny_target).eval()
    ref = _truncated_target(tiny_target, list(layer_ids or (0, 1)))
    ids = torch.randint(0, 49152, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(draft(ids).logits, ref(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip_identical_logits(tiny_target: Path, tmp_path: Path) -> None:
    draft = load_standalone(build_standalone_from_target(tiny_target, tmp_path / "d", num_layers=1))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # "trained"
    save_standalone(draft, tmp_path / "trained", tiny_target)
    loaded = load_standalone(tmp_path / "trained", tiny_target)
    ids = torch.randint(0, 49152, (1, 7))
    with torch.no_grad():
        assert torch.equal(draft(ids).logits, loaded(ids).logits)


def test_mismatched_drafts_are_rejected(tiny_target: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"\[4\] out of range \[0, 4\)"):
        build_standalone_from_target(tiny_target, tmp_path / "a", layer_ids=(0, 4))
    with pytest.raises(ModelError, match="fewer layers than the target"):
        build_standalone_from_target(tiny_target, tmp_path / "b", num_layers=4)
    out = build_standalone_from_target(tiny_target, tmp_path / "c", num_layers=1)
    cfg = json.loads((out / "config.json").read_text())
    cfg["vocab_size"] = 32000
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="vocab_size 32000, the target has 49152"):
        check_standalone_against_target(out, tiny_target)

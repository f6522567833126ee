"""Sizing from the target's files (`draft_opd_ray/sizing.py`, `preflight.size`): a Qwen3-8B and a Llama-3.1-8B
folder holding only their public config.json and generation_config.json, with no preset, get the sequence length
the run needs, EAGLE-3's 32k draft vocabulary and layers (2, L/2, L-1), and every eos id; a key set in the config
wins; a run longer than the target allows is refused with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draft_opd_ray.config.store import compose
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.preflight import size
from draft_opd_ray.sizing import LEN_STEP, needed_len
from tests import helpers

# the public generation_config.json of each (huggingface.co/Qwen/Qwen3-8B, meta-llama/Llama-3.1-8B-Instruct)
GENERATION = {
    "qwen3_8b": {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643},
    "llama31_8b": {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
}


def _folder(tmp_path: Path, name: str) -> Path:
    """A model folder with the public config.json (bench/gpu_study.yaml keeps it) and generation_config.json."""
    study = yaml.safe_load((helpers.REPO / "bench" / "gpu_study.yaml").read_text())
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(study["targets"][name]["config"]))
    (d / "generation_config.json").write_text(json.dumps(GENERATION[name]))
    return d


def _rows(overrides: list[str]) -> tuple[dict[str, object], int]:
    cfg = compose(overrides)
    rows = size(cfg)
    return {r.key: r.value for r in rows}, cfg.target.model_len()


@pytest.mark.parametrize(
    ("name", "layers", "eos"),
    [("qwen3_8b", 36, [151645, 151643]), ("llama31_8b", 32, [128001, 128008, 128009])],
)
def test_an_8b_target_is_sized_from_its_files_with_no_preset(
    tmp_path: Path, name: str, layers: int, eos: list[int]
) -> None:
    folder = _folder(tmp_path, name)
    rows, length = _rows([f"target.path={folder}"])
    need, _ = needed_len(compose([]))
    assert length == rows["target.max_model_len"] == -(-need // LEN_STEP) * LEN_STEP == 1024
    assert rows["draft.draft_vocab_size"] == 32000  # a 128k/152k vocabulary: EAGLE-3's released size
    assert rows["draft.aux_layer_ids"] == [2, layers // 2, layers - 1]
    assert rows["stop ids"] == eos

    # longer prompts: the length follows them, within the target's max_position_embeddings
    rows, length = _rows([f"target.path={folder}", "data.train.max_prompt_tokens=7000"])
    assert length == 8192


def test_the_embedded_target_keeps_its_8k_draft_vocabulary() -> None:
    rows, length = _rows([])
    assert rows["draft.draft_vocab_size"] == 8192  # SmolLM2's 49,152-token vocabulary
    assert rows["draft.aux_layer_ids"] == [2, 15, 29] and length == 1024


def test_a_key_set_in_the_config_wins_and_the_row_says_so(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "qwen3_8b")
    cfg = compose([f"target.path={folder}", "target.max_model_len=4096", "draft.draft_vocab_size=16000"])
    rows = {r.key: r for r in size(cfg)}
    assert cfg.target.max_model_len == 4096 and rows["target.max_model_len"].derived is False
    assert (
        rows["draft.draft_vocab_size"].value == 16000
        and "set in the config" in rows["draft.draft_vocab_size"].render()
    )
    assert rows["draft.aux_layer_ids"].derived is True


def test_a_run_longer_than_the_target_allows_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "qwen3_8b")  # max_position_embeddings 40960
    with pytest.raises(
        ConfigError, match=r"^data.train.max_prompt_tokens: .* \(max_position_embeddings 40960\)"
    ):
        size(compose([f"target.path={folder}", "data.train.max_prompt_tokens=40900"]))


def test_the_qwen3_8b_preset_adds_budgets_only(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "qwen3_8b")
    bare = compose([f"target.path={folder}"])
    preset = compose(["target=qwen3_8b", f"target.path={folder}"])
    assert preset.target.max_model_len is None and preset.draft.draft_vocab_size is None
    assert (preset.target.dtype, preset.sft.train_tokens) == ("bfloat16", 1_250_000)
    assert {r.key: r.value for r in size(preset)} == {r.key: r.value for r in size(bare)}

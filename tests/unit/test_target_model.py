"""Target model folders: folder checks, config-only metadata, reading a few tensors without loading the model,
tiny models, the draft folders' tokenizer files. (The embedded target: test_embedded.py; both targets on vLLM:
tests/integration/test_target_vllm.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draft_opd_ray.errors import ModelError
from draft_opd_ray.models.draft_folder import TOKENIZER_FILES, copy_tokenizer_files
from draft_opd_ray.models.embedded import EMBEDDED_TARGET
from draft_opd_ray.models.target import (
    check_layer_ids,
    read_target_info,
    read_target_tensors,
    resolve_target_path,
    spread_layer_ids,
    tensor_files,
)
from draft_opd_ray.models.tiny import build_tiny_standalone_draft, build_tiny_target
from tests.helpers import REPO, write_fake_model

# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(
    tmp_path_factory: pytest.TempPathFactory, embedded_target: Path, tiny_target: Path
) -> dict[str, Path]:
    draft = build_tiny_standalone_draft(
        tmp_path_factory.mktemp("tiny") / "draft", tokenizer_from=embedded_target
    )
    return {"target": tiny_target, "draft": draft}


# --------------------------------------------------------------------------------------------------
# resolve_target_path errors
# --------------------------------------------------------------------------------------------------


def test_resolve_missing_folder_is_an_error_not_a_hub_id(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist") as info:
        resolve_target_path(str(tmp_path / "no-such-model"))
    assert "no-such-model" in str(info.value)
    # Something that looks like a hub id is never downloaded.
    with pytest.raises(ModelError, match="never downloaded"):
        resolve_target_path("HuggingFaceTB/SmolLM2-135M-Instruct-does-not-exist")


def test_resolve_folder_without_config(tmp_path: Path) -> None:
    folder = write_fake_model(tmp_path / "m", config=False)
    with pytest.raises(ModelError, match="has no config.json") as info:
        resolve_target_path(folder)
    assert str(folder) in str(info.value)


def test_resolve_folder_without_weights(tmp_path: Path) -> None:
    folder = write_fake_model(tmp_path / "m", weights=False)
    with pytest.raises(ModelError, match=r"incomplete: no weights \(\*\.safetensors"):
        resolve_target_path(folder)


def test_resolve_folder_with_missing_shard(tmp_path: Path) -> None:
    folder = write_fake_model(tmp_path / "m", weights=False)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"\0")
    with pytest.raises(ModelError, match="model-00002-of-00002.safetensors"):
        resolve_target_path(folder)


def test_resolve_folder_without_tokenizer(tmp_path: Path) -> None:
    folder = write_fake_model(tmp_path / "m", tokenizer=False)
    with pytest.raises(ModelError, match="has no tokenizer"):
        resolve_target_path(folder)


def test_resolve_bad_config_and_file_and_unknown_embedded(tmp_path: Path) -> None:
    folder = write_fake_model(tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        resolve_target_path(folder)
    with pytest.raises(ModelError, match="is not a folder"):
        resolve_target_path(folder / "tokenizer.json")
    with pytest.raises(ModelError, match="unknown embedded target 'embedded:nope'"):
        resolve_target_path("embedded:nope")


def test_resolve_complete_folder(tmp_path: Path) -> None:
    folder = write_fake_model(tmp_path / "m")
    assert resolve_target_path(str(folder)) == folder.resolve()


def test_read_target_info_imports_no_torch(embedded_target: Path) -> None:
    code = (
        "import sys\n"
        "from draft_opd_ray.models.target import read_target_info\n"
        f"info = read_target_info({str(embedded_target)!r})\n"
        "assert info.hidden_size == 576\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO, timeout=60)


def test_read_target_info_errors_and_nested_config(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        read_target_info(tmp_path / "nope")
    folder = tmp_path / "vl"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "x"}))
    with pytest.raises(ModelError, match="lacks hidden_size, num_hidden_layers, vocab_size"):
        read_target_info(folder)
    cfg = {
        "model_type": "qwen3_vl",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "text_config": {
            "hidden_size": 2560,
            "num_hidden_layers": 36,
            "vocab_size": 151936,
            "eos_token_id": 151645,
            "max_position_embeddings": 262144,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
        },
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    info = read_target_info(folder)
    assert (info.hidden_size, info.num_layers, info.vocab_size) == (2560, 36, 151936)
    assert info.eos_token_id == 151645 and info.eos_token_ids == (151645, 151643)
    assert info.max_position_embeddings == 262144 and info.head_dim == 128


# --------------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_tiny_model_loads_and_gives_finite_logits(tiny_models: dict[str, Path], kind: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_models[kind]
    assert resolve_target_path(folder) == folder.resolve()  # complete folder, tokenizer included
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) == 49152 and tok.eos_token_id == 2
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    ids = tok("The quick brown fox", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_tiny_model_configs(tiny_models: dict[str, Path]) -> None:
    t = read_target_info(tiny_models["target"])
    assert (t.hidden_size, t.num_layers, t.vocab_size, t.max_position_embeddings) == (64, 4, 49152, 2048)
    assert (t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (4, 2, 32)
    assert t.eos_token_id == 2 and t.tie_word_embeddings and t.dtype == "float32"
    d = read_target_info(tiny_models["draft"])
    assert (d.hidden_size, d.num_layers, d.vocab_size, d.max_position_embeddings) == (32, 1, 49152, 2048)
    assert (tiny_models["target"] / "chat_template.jinja").is_file()


def test_tiny_builders_are_deterministic(tmp_path: Path, embedded_target: Path) -> None:
    a = build_tiny_target(tmp_path / "a", tokenizer_from=embedded_target)
    b = build_tiny_target(tmp_path / "b", tokenizer_from=embedded_target)
    c = build_tiny_target(tmp_path / "c", tokenizer_from=embedded_target, seed=5)
    weights = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
    d1 = build_tiny_standalone_draft(tmp_path / "d1", tokenizer_from=embedded_target)
    d2 = build_tiny_standalone_draft(tmp_path / "d2", tokenizer_from=EMBEDDED_TARGET)
    assert (d1 / "model.safetensors").read_bytes() == (d2 / "model.safetensors").read_bytes()


def test_tiny_builder_rejects_folder_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no tokenizer files"):
        build_tiny_target(tmp_path / "t", tokenizer_from=write_fake_model(tmp_path / "src", tokenizer=False))


# --------------------------------------------------------------------------------------------------
# Reading a target folder without loading the model
# --------------------------------------------------------------------------------------------------


def test_target_tensors_unsharded_and_sharded(tiny_target: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    w = read_target_tensors(tiny_target, ["model.embed_tokens.weight", "lm_head.weight"])
    assert torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])  # tied target
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(tiny_target)).save_pretrained(str(sharded), max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert tensor_files(sharded).keys() == tensor_files(tiny_target).keys()
    assert len(set(tensor_files(sharded).values())) > 1
    got = read_target_tensors(sharded, ["model.layers.3.mlp.down_proj.weight", "model.norm.weight"])
    assert got["model.norm.weight"].shape == (64,)
    with pytest.raises(ModelError, match="no tensor 'model.layers.9.mlp.down_proj.weight'"):
        read_target_tensors(sharded, ["model.layers.9.mlp.down_proj.weight"])
    with pytest.raises(ModelError, match="has no safetensors weights"):
        tensor_files(tmp_path)


def test_layer_id_helpers() -> None:
    assert check_layer_ids([0, 2], 3, "x", "y") == (0, 2)
    with pytest.raises(ModelError, match="at least one"):
        check_layer_ids([], 3, "x", "y")
    with pytest.raises(ModelError, match="strictly increasing"):
        check_layer_ids([2, 1], 3, "x", "y")
    with pytest.raises(ModelError, match=r"x: \[3\] out of range \[0, 3\) \(y\)"):
        check_layer_ids([1, 3], 3, "x", "y")
    assert spread_layer_ids(1, 3, 3) == (1, 2, 3) and spread_layer_ids(0, 29, 4) == (0, 10, 19, 29)
    assert spread_layer_ids(1, 2, 3) == (1, 2) and spread_layer_ids(0, 8, 1) == (4,)


def test_copy_tokenizer_files(embedded_target: Path, tmp_path: Path) -> None:
    copy_tokenizer_files(embedded_target, tmp_path)
    want = {n for n in (*TOKENIZER_FILES, "generation_config.json") if (embedded_target / n).is_file()}
    assert {p.name for p in tmp_path.iterdir()} == want and "tokenizer.json" in want
    for name in want:
        assert (tmp_path / name).read_bytes() == (embedded_target / name).read_bytes()

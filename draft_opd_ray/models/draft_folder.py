"""Exported draft folders: ``config.json`` + ``model.safetensors`` as vLLM's draft loaders read them, with the
target's tokenizer files beside them. Every draft kind writes and reads its folder through these."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from draft_opd_ray.errors import ModelError
from draft_opd_ray.models.target import TargetInfo, rope_theta_of

DRAFT_WEIGHTS = "model.safetensors"

# Tokenizer-side files copied from ``tokenizer_from`` when present (a draft folder tokenizes like its target).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def copy_tokenizer_files(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Tokenizer files and generation_config.json, so the draft folder tokenizes and stops like the target."""
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)


def decoder_shape_json(c: Any, t: TargetInfo) -> dict[str, Any]:
    """The config.json fields every exported head shares: its decoder shape (``c``: a head config with
    hidden_size, heads, head_dim, intermediate_size, vocab_size, rms_norm_eps, rope_theta,
    max_position_embeddings) and the target's special tokens."""
    return {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": t.bos_token_id,
        "eos_token_id": t.eos_token_id,
        "pad_token_id": t.pad_token_id,
        "dtype": "float32",
    }


def decoder_shape_from_json(cfg: dict[str, Any], where: str, eps: float) -> dict[str, Any]:
    """The inverse of :func:`decoder_shape_json`: the keyword arguments of a head config (KeyError,
    TypeError or ValueError on a malformed file)."""
    heads = int(cfg["num_attention_heads"])
    return {
        "hidden_size": int(cfg["hidden_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads", heads)),
        "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        "intermediate_size": int(cfg["intermediate_size"]),
        "vocab_size": int(cfg["vocab_size"]),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", eps)),
        "rope_theta": rope_theta_of(cfg, where),
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 4096)),
    }


def write_draft_folder(
    out_dir: str | os.PathLike[str], tensors: dict[str, Any], config: dict[str, Any]
) -> Path:
    """``config.json`` + ``model.safetensors`` (contiguous CPU tensors) as vLLM's draft loaders expect."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(flat, str(out / DRAFT_WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_draft_folder(folder: Path, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, tensors) of an exported draft folder, or ModelError naming ``where``."""
    from safetensors.torch import load_file

    try:
        return json.loads((folder / "config.json").read_text()), load_file(str(folder / DRAFT_WEIGHTS))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{where}: cannot read config.json / {DRAFT_WEIGHTS}: {exc}") from exc

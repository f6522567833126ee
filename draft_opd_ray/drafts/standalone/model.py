"""Standalone draft LMs (vLLM method ``draft_model``): building one from the target, loading, saving.

A standalone draft is an ordinary causal LM folder with the target's tokenizer and vocabulary. The usual start
is a slice of the target itself: :func:`build_standalone_from_target` keeps the embedding, final norm, LM head
and a few decoder layers (the first ``num_layers`` by default, or ``layer_ids``), renumbered 0..n-1, and writes
an HF folder (config.json, model.safetensors, generation_config.json, tokenizer files) that transformers and
vLLM's ``draft_model`` load. Proposing is done elsewhere (it is a plain causal LM).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from draft_opd_ray.errors import ModelError
from draft_opd_ray.models.draft_folder import copy_tokenizer_files
from draft_opd_ray.models.target import check_layer_ids, read_target_info, tensor_files

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def build_standalone_from_target(
    target_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    layer_ids: Sequence[int] | None = None,
) -> Path:
    """Write a draft LM made of the target's embedding, final norm, LM head and ``layer_ids`` (default: the
    first ``num_layers`` layers), renumbered 0..n-1, as float32 safetensors with the target's config and tokenizer.
    Any decoder-only HF layout with ``model.layers.<i>.`` tensor names works (Llama, Qwen, ...)."""
    info = read_target_info(target_path)
    ids = tuple(layer_ids) if layer_ids is not None else tuple(range(num_layers))
    check_layer_ids(ids, info.num_layers, "standalone layer_ids", f"target has {info.num_layers} layers")
    if len(ids) >= info.num_layers:
        raise ModelError(
            f"a standalone draft needs fewer layers than the target ({info.num_layers}), got {ids}"
        )
    cfg = json.loads((Path(target_path) / "config.json").read_text())
    cfg["num_hidden_layers"] = len(ids)
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = [cfg["layer_types"][i] for i in ids]
    if isinstance(cfg.get("max_window_layers"), int):
        cfg["max_window_layers"] = min(cfg["max_window_layers"], len(ids))
    cfg["dtype"] = "float32"
    cfg.pop("torch_dtype", None)

    renumber = {src: dst for dst, src in enumerate(ids)}
    tensors: dict[str, torch.Tensor] = {}
    for key, file in tensor_files(Path(target_path)).items():
        m = _LAYER_KEY.match(key)
        if m and int(m.group(1)) not in renumber:
            continue
        new_key = f"model.layers.{renumber[int(m.group(1))]}.{m.group(2)}" if m else key
        with safe_open(str(file), framework="pt") as fh:
            tensors[new_key] = fh.get_tensor(key).float().contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    copy_tokenizer_files(target_path, out)
    return out


def check_standalone_against_target(
    draft_path: str | os.PathLike[str], target_path: str | os.PathLike[str]
) -> None:
    """vLLM's ``draft_model`` needs the target's vocabulary (same size, same tokenizer)."""
    d, t = read_target_info(draft_path), read_target_info(target_path)
    if d.vocab_size != t.vocab_size:
        raise ModelError(
            f"standalone draft '{draft_path}' has vocab_size {d.vocab_size}, the target has {t.vocab_size}"
        )
    tok_d, tok_t = Path(draft_path) / "tokenizer.json", Path(target_path) / "tokenizer.json"
    if tok_d.is_file() and tok_t.is_file() and tok_d.read_bytes() != tok_t.read_bytes():
        raise ModelError(f"standalone draft '{draft_path}' has a different tokenizer.json than the target")


def load_standalone(
    path: str | os.PathLike[str], target_path: str | os.PathLike[str] | None = None
) -> nn.Module:
    """The draft as a float32 transformers causal LM (checked against ``target_path`` when given)."""
    from transformers import AutoModelForCausalLM

    if target_path is not None:
        check_standalone_against_target(path, target_path)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)


def save_standalone(
    model: nn.Module, out_dir: str | os.PathLike[str], target_path: str | os.PathLike[str]
) -> Path:
    """``save_pretrained`` (safetensors) plus the target's tokenizer files, then check the vocabulary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))  # type: ignore[operator]
    copy_tokenizer_files(target_path, out)
    check_standalone_against_target(out, target_path)
    return out


# the kind's interface (`drafts/kind.py`, `Pieces.of`)
load, save = load_standalone, save_standalone

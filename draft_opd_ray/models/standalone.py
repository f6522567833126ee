"""Standalone draft LMs (vLLM method ``draft_model``) and the target-folder helpers all draft kinds use.

A standalone draft is an ordinary causal LM folder with the target's tokenizer and vocabulary. The usual start
is a slice of the target itself: :func:`build_standalone_from_target` keeps the embedding, final norm, LM head
and a few decoder layers (the first ``num_layers`` by default, or ``layer_ids``), renumbered 0..n-1, and writes
an HF folder (config.json, model.safetensors, generation_config.json, tokenizer files) that transformers and
vLLM's ``draft_model`` load. Proposing is done elsewhere (it is a plain causal LM).

The helpers at the top read a target folder without loading the model (config dict, rope theta, a few
tensors, layer-id checks); eagle3.py and dflash.py build their heads with them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from draft_opd_ray.errors import ModelError
from draft_opd_ray.models.target import read_target_info
from draft_opd_ray.models.tiny import TOKENIZER_FILES

# --------------------------------------------------------------------------------------------------
# Target folder helpers (shared by all draft kinds)
# --------------------------------------------------------------------------------------------------


def target_config(target_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The target's config.json as a dict (text_config merged in for multimodal wrappers)."""
    path = Path(target_path) / "config.json"
    try:
        outer = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"target config '{path}' is unreadable: {exc}") from exc
    text = outer.get("text_config")
    return {**outer, **text} if isinstance(text, dict) else outer


def rope_theta_of(cfg: dict[str, Any], where: str) -> float:
    """rope theta of a config dict; the EAGLE-3 and DFlash heads implement the default rope type only."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind != "default":
        raise ModelError(f"{where}: rope type '{kind}' is not supported by the drafts (only 'default')")
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    return float(theta if theta is not None else cfg.get("rope_theta", 10000.0))


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the shard index or by opening every file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"model folder '{folder}' has no safetensors weights")
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            where.update(dict.fromkeys(fh.keys(), file))
    return where


def read_target_tensors(target_path: str | os.PathLike[str], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Read a few tensors (as float32) from the target's safetensors without loading the model.

    ``lm_head.weight`` falls back to ``model.embed_tokens.weight`` for targets with tied embeddings.
    """
    folder = Path(target_path)
    where = _tensor_files(folder)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        key = "model.embed_tokens.weight" if name == "lm_head.weight" and name not in where else name
        if key not in where:
            raise ModelError(f"target folder '{folder}' has no tensor '{name}'")
        with safe_open(str(where[key]), framework="pt") as fh:
            out[name] = fh.get_tensor(key).float()
    return out


def check_layer_ids(ids: Sequence[int], upper: int, what: str, why: str) -> tuple[int, ...]:
    """Strictly increasing ids in [0, upper) (vLLM concatenates aux features in ascending layer order)."""
    ids = tuple(int(i) for i in ids)
    if not ids:
        raise ModelError(f"{what}: at least one target layer is needed")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ModelError(
            f"{what}: {list(ids)} must be strictly increasing (vLLM concatenates in layer order)"
        )
    bad = [i for i in ids if not 0 <= i < upper]
    if bad:
        raise ModelError(f"{what}: {bad} out of range [0, {upper}) ({why})")
    return ids


def spread_layer_ids(lo: int, hi: int, n: int) -> tuple[int, ...]:
    """Up to n distinct ids spread evenly over [lo, hi]."""
    if n == 1:
        return ((lo + hi) // 2,)
    return tuple(sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)}))


def copy_tokenizer_files(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Tokenizer files and generation_config.json, so the draft folder tokenizes and stops like the target."""
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)


# --------------------------------------------------------------------------------------------------
# Standalone drafts
# --------------------------------------------------------------------------------------------------

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
    for key, file in _tensor_files(Path(target_path)).items():
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

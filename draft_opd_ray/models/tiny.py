"""Tiny randomly initialised models for tests and first runs on a new model family.

* ``build_tiny_target`` / ``build_tiny_standalone_draft``: Llama models sharing the embedded SmolLM2 target's
  tokenizer (files copied from ``tokenizer_from``).
* ``build_tiny_qwen3_target``: a Qwen3 model (per-head q/k norms, untied LM head) with its own small byte-level
  BPE tokenizer and a ChatML template, whose special ids sit at the top of the vocabulary as in Qwen3
  (``<|im_end|>`` ends a turn, ``<|endoftext|>`` pads; both are end-of-sequence ids and there is no BOS). It
  exercises every place where SmolLM2's ids (BOS 1, EOS 2) or its Llama layout could have been assumed.

Each builder writes a folder that transformers and vLLM load like any other model folder (``config.json``,
``generation_config.json``, ``model.safetensors``, tokenizer files). Weights are seeded, so the same arguments
give the same bytes, and a build takes a second or two on CPU.

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
from draft_opd_ray.models.draft_folder import TOKENIZER_FILES
from draft_opd_ray.models.embedded import EMBEDDED_PREFIX
from draft_opd_ray.models.target import resolve_target_path


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


def _shape(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
    """The config keys both tiny targets share: their size, 2048 positions, float32."""
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "dtype": "float32",
    }


def _save_seeded(model_class: Any, config: Any, generation: Any, seed: int, out: Path) -> None:
    """A random model of ``config`` from a private generator state (the caller's global RNG is restored), saved."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).float()
    model.generation_config = generation
    model.save_pretrained(str(out))


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
        intermediate_size=4 * hidden,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        **_shape(hidden, layers, heads, kv_heads, head_dim),
    )
    config.architectures = ["LlamaForCausalLM"]
    generation = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    _save_seeded(LlamaForCausalLM, config, generation, seed, out)

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


# Qwen3's special tokens, appended after the trained vocabulary in this order (so <|im_end|> is the last id).
QWEN3_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen's ChatML turns without the thinking block: "<|im_start|>role\ncontent<|im_end|>\n" per message.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORD_TEXT = (
    "the a an of to in and or is are was be can will should how what why when where which who write explain "
    "describe list give compare summarize translate python code function data model time people world city "
    "water energy music history science story poem email letter plan idea problem answer question number "
    "list small large fast slow good bad new old first last best simple short long example steps reasons "
    "please me you we they it this that these those with for about from into over under between"
)
_WORDS = _WORD_TEXT.split()


def tokenizer_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """``n`` short English-like sentences (seeded) to train the tiny tokenizer on; also usable as prompts."""
    import random

    rng = random.Random(seed)
    lines = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        lines.append(f"{' '.join(words).capitalize()} {i}?")
    return lines


def build_qwen3_tokenizer(out_dir: str | os.PathLike[str], *, vocab_size: int = 512) -> Any:
    """Train a byte-level BPE (``vocab_size`` tokens before the specials) on `tokenizer_corpus` and save it
    with Qwen3's special tokens and chat template to ``out_dir``; returns the PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    tok.add_special_tokens(list(QWEN3_SPECIAL_TOKENS))  # ids len(vocab), +1, +2
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        model_max_length=2048,
    )
    fast.chat_template = QWEN3_CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_qwen3_target(
    out_dir: str | os.PathLike[str],
    *,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    tokenizer_vocab: int = 512,
    seed: int = 0,
) -> Path:
    """Write a tiny random Qwen3 target (fp32, safetensors, untied LM head, 2048 positions, rope theta 1e6) with
    its own tokenizer (`build_qwen3_tokenizer`) to ``out_dir``.

    Like Qwen3's: config.json's eos is ``<|im_end|>`` and its bos/pad ``<|endoftext|>``; generation_config.json
    lists both as end-of-sequence ids, ``<|im_end|>`` first."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tok = build_qwen3_tokenizer(out, vocab_size=tokenizer_vocab)
    endoftext, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = Qwen3Config(
        vocab_size=len(tok),
        intermediate_size=3 * hidden,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        **_shape(hidden, layers, heads, kv_heads, head_dim),
    )
    config.architectures = ["Qwen3ForCausalLM"]
    generation = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext
    )
    _save_seeded(Qwen3ForCausalLM, config, generation, seed, out)
    return out

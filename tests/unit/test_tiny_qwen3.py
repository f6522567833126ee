"""The tiny Qwen3 target builder: a Qwen3 folder with its own tokenizer whose special ids are Qwen3's kind (EOS
``<|im_end|>`` at the top of the vocabulary, a separate ``<|endoftext|>``, no BOS), seeded bytes, and a chat
template that renders prompts. The slow e2e (tests/e2e/test_qwen3_e2e.py) runs it through every stage."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from draft_opd_ray.config.schema import PromptSetConfig
from draft_opd_ray.data.prompts import load_prompt_set
from draft_opd_ray.models.target import read_target_info
from draft_opd_ray.models.tiny import build_tiny_qwen3_target


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_target(tmp_path_factory.mktemp("q3") / "target")


def test_special_ids_are_qwen3s_not_smollm2s(qwen3: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3))
    info = read_target_info(qwen3)
    n = len(tok)
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert (endoftext, im_end) == (n - 3, n - 1) and info.vocab_size == n
    assert tok.eos_token_id == im_end and tok.pad_token_id == endoftext and tok.bos_token is None
    assert info.model_type == "qwen3" and info.architectures == ("Qwen3ForCausalLM",)
    assert info.eos_token_id == im_end and info.eos_token_ids == (im_end, endoftext)
    assert 2 not in info.eos_token_ids and info.head_dim == 32 and not info.tie_word_embeddings


def test_chat_template_renders_and_the_model_loads(qwen3: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3))
    ps = load_prompt_set(PromptSetConfig(source="mtbench", max_prompts=2), tok)
    p = ps.prompts[0]
    assert p.text.startswith("<|im_start|>user\n") and p.text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(list(p.token_ids)) == p.text  # byte-level BPE: any text round-trips
    assert list(p.token_ids).count(tok.convert_tokens_to_ids("<|im_start|>")) == 2

    model = AutoModelForCausalLM.from_pretrained(str(qwen3), dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM" and hasattr(model.model.layers[0].self_attn, "q_norm")
    with torch.no_grad():
        out = model(torch.tensor([list(p.token_ids)]), output_hidden_states=True)
    assert out.logits.shape == (1, len(p.token_ids), len(tok)) and len(out.hidden_states) == 5


def test_same_seed_same_bytes(tmp_path: Path, qwen3: Path) -> None:
    def digest(folder: Path) -> dict[str, str]:
        return {
            f: hashlib.sha256((folder / f).read_bytes()).hexdigest()
            for f in ("model.safetensors", "tokenizer.json", "config.json")
        }

    assert digest(build_tiny_qwen3_target(tmp_path / "again")) == digest(qwen3)
    assert (
        digest(build_tiny_qwen3_target(tmp_path / "other", seed=3))["model.safetensors"]
        != digest(qwen3)["model.safetensors"]
    )

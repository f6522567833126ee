"""The tensors of a standalone draft, an ordinary causal-LM folder (`model.build_standalone_from_target`,
`model.save_standalone`), as its config.json implies them for the decoder families whose names are known here
(Llama, Mistral, Qwen2, Qwen3: ``model.embed_tokens``, ``model.layers.<i>.*``, ``model.norm``, ``lm_head``). vLLM
serves it with the architecture's own model class; another family is only checked to have whole files.
Reads config.json only."""

from __future__ import annotations

from typing import Any

from draft_opd_ray.models.safetensors_check import Layout, Spec, decoder_layer

KIND = "standalone"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def layout(d: dict[str, Any], _: dict[str, Any]) -> Layout | None:
    """The family's names and shapes (biases where its config asks for them, Qwen3's q/k norms); ``lm_head``
    optional when the embeddings are tied (vLLM and transformers then use the embedding). None for a family not
    listed. KeyError etc. on a config it lacks."""
    family = d.get("model_type")
    if family not in FAMILIES:
        return None
    h, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    kv = int(d.get("num_key_value_heads") or heads)
    hd = int(d.get("head_dim") or h // heads)
    v, inter = int(d["vocab_size"]), int(d["intermediate_size"])
    attn_bias = family == "qwen2" or (family != "mistral" and bool(d.get("attention_bias")))
    o_bias = family in ("llama", "qwen3") and bool(d.get("attention_bias"))
    mlp_bias = family == "llama" and bool(d.get("mlp_bias"))
    head: dict[str, Spec] = {"lm_head.weight": ((v, h), None)}
    required: dict[str, Spec] = {
        "model.embed_tokens.weight": ((v, h), None),
        "model.norm.weight": ((h,), None),
    }
    for i in range(int(d["num_hidden_layers"])):
        p = f"model.layers.{i}."
        required |= decoder_layer(p, h, heads, kv, hd, inter, qk_norm=family == "qwen3")
        if attn_bias:
            required |= {
                f"{p}self_attn.{x}_proj.bias": ((n * hd,), None)
                for x, n in (("q", heads), ("k", kv), ("v", kv))
            }
        if o_bias:
            required[f"{p}self_attn.o_proj.bias"] = ((h,), None)
        if mlp_bias:
            required |= {
                f"{p}mlp.{x}_proj.bias": ((n,), None)
                for x, n in (("gate", inter), ("up", inter), ("down", h))
            }
    if d.get("tie_word_embeddings"):  # transformers' default for these families: untied
        return Layout(KIND, required, optional=head)
    return Layout(KIND, {**required, **head})

"""The tensors of an exported DFlash drafter (`model.save_dflash`) as its config.json implies them, which are the
names vLLM's ``DFlashQwen3ForCausalLM`` (``model_executor/models/qwen3_dflash.py``) loads. Reads config.json only."""

from __future__ import annotations

from typing import Any

from draft_opd_ray.models.safetensors_check import Layout, Spec, decoder_layer

KIND = "dflash"
_SHARED = (
    "a dflash draft shares the target's embedding and LM head: vLLM would serve this one while the trainer "
    "uses the target's; drop it"
)


def layout(d: dict[str, Any], _: dict[str, Any]) -> Layout:
    """``fc`` (H, F*Ht) over the F target layers' outputs, ``hidden_norm``, ``norm`` and ``num_hidden_layers``
    Qwen3-shaped layers ``layers.<i>.*`` (per-head q/k norms); never an embedding or LM head of its own. KeyError
    etc. on a config it lacks."""
    h, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    kv = int(d.get("num_key_value_heads") or heads)
    hd = int(d.get("head_dim") or h // heads)
    inter = int(d["intermediate_size"])
    features = len(d["dflash_config"]["target_layer_ids"])
    required: dict[str, Spec] = {
        "fc.weight": ((h, features * int(d.get("target_hidden_size") or h)), None),
        "hidden_norm.weight": ((h,), None),
        "norm.weight": ((h,), None),
    }
    for i in range(int(d["num_hidden_layers"])):
        required |= decoder_layer(f"layers.{i}.", h, heads, kv, hd, inter, qk_norm=True)
    refused = {"embed_tokens.weight": _SHARED, "lm_head.weight": _SHARED}
    return Layout(KIND, required, refused=refused, one_file=True)

"""The tensors of an exported EAGLE-3 head (`model.save_eagle3`) as its config.json implies them, which are the
names vLLM's ``Eagle3LlamaForCausalLM`` (``model_executor/models/llama_eagle3.py``) loads; and the EAGLE-3 layouts
of other trainers that vLLM serves but this trainer does not read. Reads config.json and tensor names only.

* SpecForge exports the same tensor names (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), but
  its config.json may name no ``eagle_config.eagle_aux_hidden_state_layer_ids``: vLLM then reads the target's
  default layers (2, L/2, L-3), and `model.load_eagle3` refuses a head that does not name its layers.
* The speculators library (``speculators_model_type: "eagle3"``, ``Eagle3Speculator``) names the decoder layer
  ``layers.0.*`` and keeps the layer's shape under ``transformer_layer_config``; vLLM maps it, `model.load_eagle3`
  reads ``midlayer.*`` from a ``LlamaForCausalLMEagle3`` config.json. There is no converter in this repository.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from draft_opd_ray.models.safetensors_check import Layout, Spec, decoder_layer

KIND = "eagle3"


def _aux_layer_ids(d: dict[str, Any]) -> Any:
    return (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or d.get(
        "eagle_aux_hidden_state_layer_ids"
    )


def layout(d: dict[str, Any], _: dict[str, Any]) -> Layout:
    """``fc`` (H, A*Ht) over the A aux layers' features, one decoder layer ``midlayer.*`` whose attention reads
    [embedding; feature] (2H), ``norm``, ``lm_head`` (Vd, H); ``d2t`` (Vd, int64) and ``t2d`` (V, bool) when the
    draft vocabulary is smaller than the target's (with Vd = V vLLM builds no id map and fails on a ``d2t``);
    ``embed_tokens`` (V, H) optional (absent: vLLM shares the target's). KeyError etc. on a config it lacks."""
    h, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    kv = int(d.get("num_key_value_heads") or heads)
    hd = int(d.get("head_dim") or h // heads)
    v = int(d["vocab_size"])
    vd = int(d.get("draft_vocab_size") or v)
    ht = int(d.get("target_hidden_size") or h)
    aux = len(_aux_layer_ids(d))
    required: dict[str, Spec] = {
        "fc.weight": ((h, aux * ht), None),
        **decoder_layer("midlayer.", h, heads, kv, hd, int(d["intermediate_size"]), in_dim=2 * h),
        "midlayer.hidden_norm.weight": ((h,), None),
        "norm.weight": ((h,), None),
        "lm_head.weight": ((vd, h), None),
    }
    optional: dict[str, Spec] = {"embed_tokens.weight": ((v, h), None)}
    refused: dict[str, str] = {}
    if vd < v:
        required |= {"d2t": ((vd,), "I64"), "t2d": ((v,), "BOOL")}
    else:
        optional["t2d"] = ((v,), "BOOL")
        refused["d2t"] = (
            f"draft_vocab_size {vd} is the whole vocabulary, so vLLM builds no draft-to-target map and fails on a "
            "d2t; drop it (or set draft_vocab_size to its length)"
        )
    return Layout(KIND, required, optional, refused, one_file=True)


def foreign(d: dict[str, Any], names: Collection[str]) -> str | None:
    """What a folder in another trainer's EAGLE-3 layout is and what to do with it; None for this trainer's."""
    archs = d.get("architectures") or []
    if (
        d.get("speculators_model_type")
        or "Eagle3Speculator" in archs
        or any(n.startswith("layers.") for n in names)
    ):
        return (
            "an EAGLE-3 head in the speculators library's layout (decoder tensors layers.0.*, config under "
            "transformer_layer_config): vLLM serves it, but this trainer reads midlayer.* and a "
            "LlamaForCausalLMEagle3 config.json with eagle_config.eagle_aux_hidden_state_layer_ids; rename "
            "layers.0.* to midlayer.* and write that config.json (there is no converter here)"
        )
    if "LlamaForCausalLMEagle3" in archs and "draft_opd" not in d and not _aux_layer_ids(d):
        return (
            "an EAGLE-3 head as SpecForge exports it, whose config.json names no "
            "eagle_config.eagle_aux_hidden_state_layer_ids (vLLM would read the target's default layers 2, L/2, "
            'L-3); add "eagle_config": {"eagle_aux_hidden_state_layer_ids": [the target layers it was trained on]} '
            "to its config.json"
        )
    return None

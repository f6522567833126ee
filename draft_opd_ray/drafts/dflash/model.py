"""DFlash block drafter: model, many-anchor block attention, SFT loss, proposing, vLLM checkpoint.

The contract is vLLM 0.32 ``model_executor/models/qwen3_dflash.py`` (``DFlashDraftModel`` ->
``DFlashQwen3ForCausalLM``) and its proposer ``v1/spec_decode/dflash.py``; z-lab/dflash and SpecForge's
``dflash_mask.py`` train the same thing.

* Features. ``target_layer_ids`` name the *output* of target layer i (HF ``hidden_states[i + 1]``; vLLM adds 1
  and captures the input of layer i + 1), concatenated in ascending order: (B, L, F*H). Ids must be < L - 1 so
  that no id reads HF's last entry (after the final norm; vLLM's is before it).
  context = hidden_norm(fc(features)) (B, L, H).
* Block. For an anchor n (the last committed token, e.g. vLLM's bonus token) the block is
  [x_n, MASK x (bs - 1)] at positions n..n+bs-1; block offset o >= 1 predicts x_{n+o}. MASK is
  ``mask_token_id``: an ordinary (non-special) target token whose frozen embedding marks "to be drafted".
* Layers (Qwen3-shaped, pre-norm): queries are block tokens after input_layernorm with per-head q_norm; keys and
  values are [context; block]: context rows use each layer's k_proj/v_proj on the context directly (no
  input_layernorm, like vLLM's ``precompute_and_store_context_kv``), both get k_norm and RoPE at their own
  positions. A block query sees context positions t < n (strictly before the anchor: the anchor's target
  feature does not exist yet when drafting) and every token of its own block (non-causal); blocks of
  different anchors never see each other, so all anchors of a sequence run in one forward.
* Embedding and LM head are the target's, frozen, and never written to the checkpoint (vLLM shares the
  target's when they are absent).

Checkpoint: config.json ``architectures: ["DFlashDraftModel"]``, ``model_type: "qwen3"``, ``block_size``,
``dflash_config: {mask_token_id, target_layer_ids}``, ``layer_types`` (all ``full_attention`` = non-causal in
vLLM); safetensors ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``, ``layers.<i>.{input_layernorm,
post_attention_layernorm}.weight``, ``layers.<i>.self_attn.{q,k,v,o}_proj.weight``,
``layers.<i>.self_attn.{q,k}_norm.weight``, ``layers.<i>.mlp.{gate,up,down}_proj.weight``.
Served with ``speculative_config={"method": "dflash", "model": dir, "num_speculative_tokens": bs - 1}``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draft_opd_ray.errors import ModelError
from draft_opd_ray.models.draft_folder import (
    decoder_shape_from_json,
    decoder_shape_json,
    read_draft_folder,
    write_draft_folder,
)
from draft_opd_ray.models.layers import RMSNorm, SwiGLU, apply_rope, init_weights
from draft_opd_ray.models.target import (
    TargetInfo,
    check_layer_ids,
    read_target_info,
    read_target_tensors,
    rope_theta_of,
    spread_layer_ids,
    target_config,
)

ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096


def dflash_attention_mask(
    anchor_pos: torch.Tensor, context_len: int, block_size: int, context_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Visibility for all blocks of a batch at once. anchor_pos (B, N); context_valid (B, L) or None.

    Queries are the N*bs block tokens (block-major); keys are [L context positions; N*bs block tokens].
    Returns (B, N*bs, L + N*bs) bool, True = visible: context t < anchor of the query's block (and valid),
    and every token of the query's own block.
    """
    B, N = anchor_pos.shape
    dev = anchor_pos.device
    block = torch.arange(N * block_size, device=dev) // block_size  # (Q,) block of each query
    anchor_q = anchor_pos[:, block]  # (B, Q)
    ctx = torch.arange(context_len, device=dev)[None, None, :] < anchor_q[..., None]  # (B, Q, L)
    if context_valid is not None:
        ctx = ctx & context_valid.bool()[:, None, :]
    same = (block[:, None] == block[None, :]).expand(B, -1, -1)  # (B, Q, Q)
    return torch.cat([ctx, same], dim=-1)


class _Attention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.config = c

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, q_pos: torch.Tensor, c_pos: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """x (B, Q, H) normed block tokens; ctx (B, L, H) context; q_pos (B, Q), c_pos (B, L); mask (B, Q, L+Q)."""
        B, Q, _ = x.shape
        d = self.config.head_dim
        q = self.q_norm(self.q_proj(x).view(B, Q, -1, d)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)  # (B, L+Q, H)
        k = self.k_norm(self.k_proj(kv_in).view(B, kv_in.shape[1], -1, d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, kv_in.shape[1], -1, d).transpose(1, 2)
        q = apply_rope(q, q_pos, self.config.rope_theta)
        k = apply_rope(k, torch.cat([c_pos, q_pos], dim=1), self.config.rope_theta)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(a.transpose(1, 2).reshape(B, Q, -1))


class _Layer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, q_pos: torch.Tensor, c_pos: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Pre-norm residual block over the block tokens x (B, Q, H); other arguments as in _Attention."""
        x = x + self.self_attn(self.input_layernorm(x), ctx, q_pos, c_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """DFlash drafter. Trainable: ``fc``, ``hidden_norm``, ``layers``, ``norm``; frozen target
    ``embed_tokens`` and ``lm_head``."""

    def __init__(
        self, config: DFlashConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor
    ) -> None:
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        init_weights(self)
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.float(), freeze=True)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.lm_head.weight = nn.Parameter(lm_head_weight.float().clone(), requires_grad=False)

    @property
    def hidden_state_indices(self) -> tuple[int, ...]:
        """Indices into HF ``output_hidden_states`` whose concatenation is the feature tensor."""
        return tuple(i + 1 for i in self.config.target_layer_ids)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the target's embedding and LM head: what the checkpoint holds."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        anchor_pos: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids (B, L), features (B, L, F*H) target features of the same positions, anchor_pos (B, N) in
        [0, L). Returns the normed hidden states of every block token (B, N, bs, H); offset o >= 1 predicts
        x_{n+o}. Positions at or after the anchor never influence its block; attention_mask (B, L) hides padding.
        Attention memory is O(N*bs * (L + N*bs)) per head: blocks are independent, so callers with many anchors
        may run slices of ``anchor_pos`` and concatenate (identical results).
        """
        B, L = input_ids.shape
        N, bs = anchor_pos.shape[1], self.config.block_size
        ctx = self.hidden_norm(self.fc(features))  # (B, L, H)
        block = torch.full((B, N, bs), self.config.mask_token_id, dtype=torch.long, device=input_ids.device)
        block[..., 0] = torch.gather(input_ids, 1, anchor_pos)
        x = self.embed_tokens(block).view(B, N * bs, -1)
        q_pos = (anchor_pos[..., None] + torch.arange(bs, device=x.device)).view(B, N * bs)
        c_pos = torch.arange(L, device=x.device).expand(B, L)
        mask = dflash_attention_mask(anchor_pos, L, bs, attention_mask)
        for layer in self.layers:
            x = layer(x, ctx, q_pos, c_pos, mask)
        return self.norm(x).view(B, N, bs, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def propose(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        lengths: torch.Tensor,
        num_speculative_tokens: int | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft K = ``num_speculative_tokens`` <= bs - 1 tokens after each verified prefix x_0..x_n
        (n = lengths - 1) in one forward, as vLLM's DFlash proposer. input_ids (B, T) right-padded, features
        (B, T, F*H) (rows < n are read). Returns drafted ids (B, K) and q (B, K, V) (one-hot under greedy;
        each offset sampled independently).
        """
        num_speculative_tokens = (
            self.config.block_size - 1 if num_speculative_tokens is None else num_speculative_tokens
        )
        valid = torch.arange(input_ids.shape[1], device=input_ids.device)[None] < lengths[:, None]
        h = self(input_ids, features, (lengths - 1)[:, None], attention_mask=valid)[
            :, 0, 1 : num_speculative_tokens + 1
        ]
        logits = self.logits(h).float()  # (B, K, V)
        if temperature == 0:
            ids = logits.argmax(-1)
            return ids, F.one_hot(ids, logits.shape[-1]).to(logits.dtype)
        q = torch.softmax(logits / temperature, dim=-1)
        ids = torch.multinomial(q.flatten(0, 1), 1, generator=generator).view(q.shape[:2])
        return ids, q


# --------------------------------------------------------------------------------------------------
# Building from a target, checking, saving and loading
# --------------------------------------------------------------------------------------------------


def special_token_ids(target_path: str | os.PathLike[str]) -> set[int]:
    """Ids a mask token must not take: tokenizer special/added tokens and the config's bos/eos/pad/unk ids."""
    info = read_target_info(target_path)
    ids = {i for i in (info.bos_token_id, info.pad_token_id, *info.eos_token_ids) if i is not None}
    cfg = target_config(target_path)
    if isinstance(cfg.get("unk_token_id"), int):
        ids.add(cfg["unk_token_id"])
    tok = Path(target_path) / "tokenizer.json"
    if tok.is_file():
        ids |= {int(t["id"]) for t in json.loads(tok.read_text()).get("added_tokens", []) if t.get("special")}
    return ids


def default_mask_token_id(target_path: str | os.PathLike[str]) -> int:
    """The highest ordinary token id of the tokenizer's vocabulary (rare, and not special)."""
    special = special_token_ids(target_path)
    vocab = read_target_info(target_path).vocab_size
    tok = Path(target_path) / "tokenizer.json"
    ids = set(range(vocab))
    if tok.is_file():
        model_vocab = json.loads(tok.read_text()).get("model", {}).get("vocab")
        if isinstance(model_vocab, dict):
            ids = {int(i) for i in model_vocab.values() if int(i) < vocab}
    ordinary = sorted(ids - special)
    if not ordinary:
        raise ModelError(f"target '{target_path}': no ordinary token id to use as the DFlash mask token")
    return ordinary[-1]


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """z-lab's spread from layer 1 to L-3, clipped to the valid range [0, L-2]."""
    ids = spread_layer_ids(1, num_target_layers - 3, n) if num_target_layers >= 5 else ()
    if len(ids) == n:
        return ids
    return spread_layer_ids(0, num_target_layers - 2, n)


def check_dflash_against_target(
    c: DFlashConfig, t: TargetInfo, special: set[int] | None = None, where: str = "DFlash draft"
) -> None:
    """Raise ModelError when the drafter cannot run on this target."""
    if c.hidden_size != t.hidden_size:
        raise ModelError(
            f"{where}: hidden_size {c.hidden_size} != target hidden_size {t.hidden_size} "
            "(DFlash uses the target's embedding and LM head)"
        )
    if c.vocab_size != t.vocab_size:
        raise ModelError(f"{where}: vocab_size {c.vocab_size} != target vocab_size {t.vocab_size}")
    if c.block_size < 2:
        raise ModelError(f"{where}: block_size must be >= 2, got {c.block_size}")
    if not 0 <= c.mask_token_id < t.vocab_size:
        raise ModelError(
            f"{where}: mask_token_id {c.mask_token_id} outside the vocabulary [0, {t.vocab_size})"
        )
    if special is not None and c.mask_token_id in special:
        raise ModelError(
            f"{where}: mask_token_id {c.mask_token_id} is a special token of the target (eos/bos/pad or an "
            "added special token); vLLM would treat drafted masks as control tokens. Use an ordinary token"
        )
    check_layer_ids(
        c.target_layer_ids,
        t.num_layers - 1,
        f"{where}: dflash_config.target_layer_ids",
        f"target has {t.num_layers} layers; id i is the output of layer i and the last layer's output is "
        "normalised differently by HF and vLLM",
    )


def init_dflash(
    target_path: str | os.PathLike[str],
    *,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    intermediate_size: int | None = None,
    seed: int = 0,
) -> DFlashDraft:
    """A fresh drafter for ``target_path``: target attention shape, random layers, frozen target embedding and
    LM head. ``target_layer_ids`` defaults to ``num_layers`` ids spread over the target (z-lab's rule)."""
    info = read_target_info(target_path)
    cfg_t = target_config(target_path)
    heads = info.num_attention_heads or 1
    c = DFlashConfig(
        hidden_size=info.hidden_size,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=info.num_key_value_heads or heads,
        head_dim=info.head_dim or info.hidden_size // heads,
        intermediate_size=intermediate_size or info.intermediate_size or 4 * info.hidden_size,
        vocab_size=info.vocab_size,
        block_size=block_size,
        mask_token_id=default_mask_token_id(target_path) if mask_token_id is None else mask_token_id,
        target_layer_ids=tuple(target_layer_ids or default_target_layer_ids(info.num_layers, num_layers)),
        rms_norm_eps=float(cfg_t.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(cfg_t, f"target '{target_path}'"),
        max_position_embeddings=info.max_position_embeddings or 4096,
    )
    check_dflash_against_target(c, info, special_token_ids(target_path))
    w = read_target_tensors(target_path, ["model.embed_tokens.weight", "lm_head.weight"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DFlashDraft(c, w["model.embed_tokens.weight"], w["lm_head.weight"])


def dflash_hf_config(c: DFlashConfig, t: TargetInfo) -> dict[str, Any]:
    """config.json for vLLM's ``DFlashDraftModel`` (Qwen3-shaped; non-causal full-attention layers)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        **decoder_shape_json(c, t),
        "num_hidden_layers": c.num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": c.num_layers,
        "layer_types": ["full_attention"] * c.num_layers,
        "block_size": c.block_size,
        "num_target_layers": t.num_layers,
        "target_hidden_size": t.hidden_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "draft_opd": {"kind": "dflash"},
    }


def save_dflash(
    model: DFlashDraft, out_dir: str | os.PathLike[str], target_path: str | os.PathLike[str]
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (float32, no embedding / LM head) for vLLM's dflash."""
    info = read_target_info(target_path)
    check_dflash_against_target(model.config, info, special_token_ids(target_path))
    return write_draft_folder(out_dir, model.trainable_state_dict(), dflash_hf_config(model.config, info))


def _config_from_json(cfg: dict[str, Any], where: str) -> DFlashConfig:
    if not any(str(a).startswith("DFlash") for a in cfg.get("architectures") or []):
        raise ModelError(f"{where}: architectures {cfg.get('architectures')} are not a DFlash drafter")
    dcfg = cfg.get("dflash_config") or {}
    try:
        return DFlashConfig(
            **decoder_shape_from_json(cfg, where, eps=1e-6),
            num_layers=int(cfg["num_hidden_layers"]),
            block_size=int(cfg.get("block_size") or dcfg["block_size"]),
            mask_token_id=int(dcfg["mask_token_id"] if "mask_token_id" in dcfg else cfg["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in dcfg["target_layer_ids"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{where}: incomplete DFlash config.json ({exc!r})") from exc


def load_dflash(path: str | os.PathLike[str], target_path: str | os.PathLike[str]) -> DFlashDraft:
    """Load a drafter written by :func:`save_dflash`; the target supplies the embedding and LM head."""
    folder = Path(path)
    where = f"DFlash draft '{folder}'"
    cfg, tensors = read_draft_folder(folder, where)
    c = _config_from_json(cfg, where)
    check_dflash_against_target(c, read_target_info(target_path), special_token_ids(target_path), where)
    w = read_target_tensors(target_path, ["model.embed_tokens.weight", "lm_head.weight"])
    model = DFlashDraft(c, w["model.embed_tokens.weight"], w["lm_head.weight"])
    tensors = {k: v for k, v in tensors.items() if not k.startswith(("embed_tokens.", "lm_head."))}
    expected = set(model.trainable_state_dict())
    if set(tensors) != expected:
        raise ModelError(
            f"{where}: weights do not match the config "
            f"(missing {sorted(expected - set(tensors))}, unexpected {sorted(set(tensors) - expected)})"
        )
    try:
        model.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:
        raise ModelError(f"{where}: weights do not match the config ({exc})") from exc
    return model


# the kind's interface (`drafts/kind.py`, `Pieces.of`)
load, save = load_dflash, save_dflash

"""Sizing from the target's own files: what a run derives from the target's config.json and generation_config.json
where the config leaves a key unset (null), with the reason the dry run prints.

- `target.max_model_len`: what the run's longest sequence needs (longest prompt + most new tokens + K + 1),
  rounded up to a multiple of `LEN_STEP`, never beyond the target's ``max_position_embeddings``. vLLM reserves KV
  cache by memory, not by this length, so a longer one buys nothing: prompts longer than
  ``data.*.max_prompt_tokens`` are skipped, which is the key to raise for long-context traffic.
- the draft's vocabulary and the kind's dimensions: the kind says (`DraftKind.sizing`), e.g. EAGLE-3's draft
  vocabulary (32,000 for a 100k+ vocabulary, as EAGLE-3's released heads; 8,192 below) and auxiliary layers.
- the ids that end an answer: config.json's and generation_config.json's ``eos_token_id``.

A preset such as ``target=qwen3_8b`` adds budgets (precision, training tokens) and no sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from draft_opd_ray.errors import ConfigError

if TYPE_CHECKING:
    from draft_opd_ray.config.schema import Config
    from draft_opd_ray.models.target import TargetInfo

LEN_STEP = 1024


@dataclass(frozen=True)
class Derived:
    """One sized value: the config key, its value, why it is what it is, and whether the config set it."""

    key: str
    value: object
    why: str
    derived: bool = True

    def render(self) -> str:
        return f"  {self.key} {self.value}: {self.why if self.derived else 'set in the config'}"


def needed_len(cfg: Config) -> tuple[int, str]:
    """The longest sequence the run makes: its length and the sum that gives it."""
    prompt = max(cfg.data.train.max_prompt_tokens, cfg.data.eval.max_prompt_tokens)
    gen = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens, cfg.sft.max_new_tokens)
    k = cfg.draft.num_speculative_tokens
    n = prompt + gen + k + 1
    return n, f"longest prompt {prompt} + new tokens {gen} + K {k} + 1 = {n}"


def max_model_len(cfg: Config, info: TargetInfo) -> Derived:
    """`target.max_model_len` as set, or what the run needs rounded up to `LEN_STEP` within the target's limit."""
    if cfg.target.max_model_len is not None:
        return Derived("target.max_model_len", cfg.target.max_model_len, "", derived=False)
    top = info.max_position_embeddings
    need, why = needed_len(cfg)
    if top is not None and need > top:
        raise ConfigError(
            f"data.train.max_prompt_tokens: the run's longest sequence ({why}) is beyond what the target supports "
            f"(max_position_embeddings {top}); lower data.*.max_prompt_tokens or *.max_new_tokens"
        )
    n = -(-need // LEN_STEP) * LEN_STEP
    if top is not None:
        n = min(n, top)
    limit = f"the target allows {top}" if top is not None else "config.json gives no max_position_embeddings"
    return Derived("target.max_model_len", n, f"{why}, rounded up to a multiple of {LEN_STEP} ({limit})")


def size_from_target(cfg: Config, info: TargetInfo, kind_rows: list[Derived]) -> list[Derived]:
    """Derive what the config leaves unset and write it into ``cfg`` (a derived `target.max_model_len` becomes
    the config's, so every actor and engine reads one number). ``kind_rows``: the draft kind's own
    (`DraftKind.sizing`). Returns every sized row, set or derived, in the order the dry run prints them."""
    length = max_model_len(cfg, info)
    cfg.target.max_model_len = cast(int, length.value)
    src = "config.json and generation_config.json" if info.eos_token_ids else "none found in config.json"
    return [length, *kind_rows, Derived("stop ids", list(info.eos_token_ids), f"eos_token_id of {src}")]


def render(rows: list[Derived]) -> str:
    return "\n".join(
        ["sizing (from the target's config.json; a key set in the config wins):", *(r.render() for r in rows)]
    )

"""The table of draft kinds: one line per kind, each a folder `drafts/<kind>/` with its `KIND` (`drafts/kind.py`).

    kind        vLLM method   conditions on target features   can start without SFT or draft.path
    eagle3      eagle3        yes (aux layer inputs)          yes (a fresh head)
    standalone  draft_model   no (a causal LM of its own)     no
    dflash      dflash        yes (target layer outputs)      no

Everything that depends on the kind reads this table (`draft_kind(cfg.draft.kind)`). Adding a kind is one folder
and one entry here (docs/design.md, "Draft kinds"). Importing it loads no torch.
"""

from __future__ import annotations

from draft_opd_ray.drafts import dflash, eagle3, standalone
from draft_opd_ray.drafts.kind import DraftKind
from draft_opd_ray.errors import ConfigError

KINDS: dict[str, DraftKind] = {k.name: k for k in (eagle3.KIND, standalone.KIND, dflash.KIND)}


def draft_kind(name: str) -> DraftKind:
    """The kind called ``name``, or a ConfigError naming `draft.kind` and the kinds there are."""
    if name not in KINDS:
        raise ConfigError(f"draft.kind: must be one of {list(KINDS)}, got {name!r}")
    return KINDS[name]

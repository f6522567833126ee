"""A draft folder's weights are checked before any engine starts (`DraftKind.check_folder`,
`models/safetensors_check.py`): real folders of each kind, written by the kind's own writers for the tiny target,
then damaged one way each. Every damage is one `ModelError` line that starts with the config key and names the file
and the first bad tensor; the untouched folders, a bfloat16 copy, a sharded one and a config-only stand-in pass."""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_opd_ray.config.store import compose
from draft_opd_ray.drafts.registry import draft_kind
from draft_opd_ray.errors import ModelError
from draft_opd_ray.models.safetensors_check import INDEX
from draft_opd_ray.models.target import read_target_info
from tests.helpers import edit_config

WEIGHTS = "model.safetensors"
VD = 256  # the EAGLE-3 head's draft vocabulary: smaller than the target's, so it has d2t and t2d


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, tiny_target: Path) -> dict[str, Path]:
    """One folder of each kind for the tiny target, by the kinds' own writers."""
    from draft_opd_ray.drafts.dflash.model import init_dflash, save_dflash
    from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3
    from draft_opd_ray.drafts.standalone.model import build_standalone_from_target

    root = tmp_path_factory.mktemp("drafts")
    counts = torch.arange(read_target_info(tiny_target).vocab_size).flip(0).float()
    head = init_eagle3(tiny_target, aux_layer_ids=[0, 1, 2], draft_vocab_size=VD, token_counts=counts)
    return {
        "eagle3": save_eagle3(head, root / "eagle3", tiny_target),
        "dflash": save_dflash(init_dflash(tiny_target, block_size=4), root / "dflash", tiny_target),
        "standalone": build_standalone_from_target(tiny_target, root / "standalone", num_layers=2),
    }


def _copy(folders: dict[str, Path], kind: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folders[kind], tmp_path / kind))


def _tensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite ``folder``'s model.safetensors, a whole file again, after ``edit`` changed its tensors."""
    tensors = load_file(str(folder / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})


def _header(file: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite ``file``'s header after ``edit`` changed it, its data as it was."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _shard(folder: Path) -> None:
    """Split model.safetensors into two shards and an index, as `save_pretrained` writes a large model."""
    tensors = load_file(str(folder / WEIGHTS))
    names = list(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in parts.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in parts.items() for n in part}
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / WEIGHTS).unlink()


def _refused(kind: str, target: Path, folder: Path, pattern: str, key: str = "draft.path") -> str:
    with pytest.raises(ModelError) as e:
        draft_kind(kind).check_folder(target, folder, key)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{key}: "), line
    assert re.search(pattern, line), line
    return line


# --------------------------------------------------------------------------------------------------
# What passes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "standalone"])
def test_an_untouched_folder_passes(folders: dict[str, Path], tiny_target: Path, kind: str) -> None:
    draft_kind(kind).check_folder(tiny_target, folders[kind])


def test_bfloat16_weights_a_sharded_folder_and_a_config_only_stand_in_pass(
    folders: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    """vLLM casts floating weights to the dtype it serves in; a sharded causal LM loads as any HF folder; a folder
    of config.json alone (a dry run's stand-in for weights this machine has no copy of) has nothing to read."""
    head = _copy(folders, "eagle3", tmp_path)
    _tensors(head, lambda t: t.update({k: v.bfloat16() for k, v in t.items() if v.is_floating_point()}))
    draft_kind("eagle3").check_folder(tiny_target, head)
    lm = _copy(folders, "standalone", tmp_path)
    _shard(lm)
    draft_kind("standalone").check_folder(tiny_target, lm)
    stand_in = tmp_path / "stand_in"
    stand_in.mkdir()
    shutil.copyfile(folders["dflash"] / "config.json", stand_in / "config.json")
    draft_kind("dflash").check_folder(tiny_target, stand_in)


# --------------------------------------------------------------------------------------------------
# Damaged files
# --------------------------------------------------------------------------------------------------


def test_a_truncated_file_names_the_first_tensor_past_its_end(
    folders: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    d = _copy(folders, "eagle3", tmp_path)
    with (d / WEIGHTS).open("r+b") as fh:
        fh.truncate((d / WEIGHTS).stat().st_size - 100)
    _refused(
        "eagle3",
        tiny_target,
        d,
        rf"^draft\.path: {re.escape(str(d / WEIGHTS))} is damaged: truncated: tensor 't2d' ends at data byte "
        r"\d+, the file holds \d+ bytes of data$",
    )
    with (d / WEIGHTS).open("r+b") as fh:
        fh.truncate(100)  # inside the header
    _refused(
        "eagle3",
        tiny_target,
        d,
        r"is damaged: its header length \d+ runs past the end of the file \(100 bytes; truncated",
    )


def test_a_corrupted_header_is_damaged(folders: dict[str, Path], tiny_target: Path, tmp_path: Path) -> None:
    d = _copy(folders, "eagle3", tmp_path)
    raw = bytearray((d / WEIGHTS).read_bytes())
    raw[8] = ord("x")  # the header's opening brace
    (d / WEIGHTS).write_bytes(bytes(raw))
    _refused("eagle3", tiny_target, d, r"model\.safetensors is damaged: its header is not valid JSON")


def test_a_header_that_disagrees_with_the_data_is_damaged(
    folders: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    """A shape the data cannot hold, and bytes after the last tensor."""
    d = _copy(folders, "eagle3", tmp_path)
    _header(d / WEIGHTS, lambda h: h["norm.weight"].update(shape=[65]))
    _refused(
        "eagle3",
        tiny_target,
        d,
        r"damaged: tensor 'norm\.weight' spans 256 bytes, its shape \[65\] of F32 needs 260",
    )
    d = _copy(folders, "dflash", tmp_path)
    with (d / WEIGHTS).open("ab") as fh:
        fh.write(b"\0" * 12)
    _refused("dflash", tiny_target, d, r"damaged: 12 bytes after the end of the last tensor")


def test_a_missing_or_misplaced_shard(folders: dict[str, Path], tiny_target: Path, tmp_path: Path) -> None:
    d = _copy(folders, "standalone", tmp_path)
    _shard(d)
    index = json.loads((d / INDEX).read_text())
    wm = index["weight_map"]
    first = next(n for n, f in wm.items() if f == "model-00001-of-00002.safetensors")
    second = next(n for n, f in wm.items() if f == "model-00002-of-00002.safetensors")
    index["weight_map"][first] = "model-00002-of-00002.safetensors"
    (d / INDEX).write_text(json.dumps(index))
    _refused(
        "standalone",
        tiny_target,
        d,
        rf"model-00002-of-00002\.safetensors lacks tensor '{re.escape(first)}', which {INDEX} places there$",
    )
    index["weight_map"][first] = "model-00001-of-00002.safetensors"
    (d / INDEX).write_text(json.dumps(index))
    (d / "model-00002-of-00002.safetensors").unlink()
    _refused(
        "standalone",
        tiny_target,
        d,
        rf"model-00002-of-00002\.safetensors is missing; {INDEX} places tensor '{re.escape(second)}' there$",
    )


# --------------------------------------------------------------------------------------------------
# Names, shapes and dtypes against config.json
# --------------------------------------------------------------------------------------------------


def test_a_renamed_tensor_is_unexpected_and_names_what_is_missing(
    folders: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    d = _copy(folders, "eagle3", tmp_path)
    _tensors(d, lambda t: t.update({"final_norm.weight": t.pop("norm.weight")}))
    _refused(
        "eagle3",
        tiny_target,
        d,
        r"model\.safetensors holds tensor 'final_norm\.weight', which no eagle3 draft of this config\.json has "
        r"\(vLLM would not load it as it is\); missing: 'norm\.weight'$",
    )


def test_a_reshaped_tensor_names_both_shapes(
    folders: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    d = _copy(folders, "eagle3", tmp_path)
    _tensors(d, lambda t: t.update({"fc.weight": t["fc.weight"].t().contiguous()}))
    _refused(
        "eagle3",
        tiny_target,
        d,
        r"model\.safetensors: tensor 'fc\.weight' has shape \[192, 64\], its config\.json implies \[64, 192\]$",
    )
    d = _copy(folders, "dflash", tmp_path / "x")
    _tensors(d, lambda t: t.update({"layers.0.self_attn.q_norm.weight": torch.ones(64)}))
    _refused(
        "dflash",
        tiny_target,
        d,
        r"tensor 'layers\.0\.self_attn\.q_norm\.weight' has shape \[64\], its config\.json implies \[32\]",
    )


def test_a_pinned_dtype(folders: dict[str, Path], tiny_target: Path, tmp_path: Path) -> None:
    """EAGLE-3's vocabulary map: d2t int64, t2d bool; a weight is any floating-point type."""
    d = _copy(folders, "eagle3", tmp_path)
    _tensors(d, lambda t: t.update({"d2t": t["d2t"].int()}))
    _refused(
        "eagle3", tiny_target, d, r"model\.safetensors: tensor 'd2t' is I32; eagle3 drafts store it as I64$"
    )
    d = _copy(folders, "standalone", tmp_path / "x")
    _tensors(d, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].long()}))
    _refused(
        "standalone",
        tiny_target,
        d,
        r"tensor 'model\.norm\.weight' is I64; standalone drafts store it as a floating",
    )


def test_a_missing_tensor(folders: dict[str, Path], tiny_target: Path, tmp_path: Path) -> None:
    d = _copy(folders, "standalone", tmp_path)
    _tensors(d, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    _refused(
        "standalone",
        tiny_target,
        d,
        rf"^draft\.path: {re.escape(str(d / WEIGHTS))} has no tensor 'model\.layers\.1\.mlp\.down_proj\.weight', which every "
        r"standalone draft of this config\.json needs \(vLLM would leave it uninitialised\)$",
    )


def test_an_extra_tensor(folders: dict[str, Path], tiny_target: Path, tmp_path: Path) -> None:
    """A tensor no draft of the kind has, one the trainer would ignore while vLLM serves it, and a d2t where the
    draft vocabulary is the whole vocabulary (vLLM builds no map to load it into)."""
    d = _copy(folders, "eagle3", tmp_path)
    _tensors(d, lambda t: t.update({"midlayer.self_attn.q_proj.bias": torch.zeros(64)}))
    _refused(
        "eagle3", tiny_target, d, r"holds tensor 'midlayer\.self_attn\.q_proj\.bias', which no eagle3 draft"
    )
    d = _copy(folders, "dflash", tmp_path / "x")
    _tensors(d, lambda t: t.update({"lm_head.weight": torch.zeros(8, 64)}))
    _refused(
        "dflash",
        tiny_target,
        d,
        r"holds tensor 'lm_head\.weight': a dflash draft shares the target's embedding",
    )
    d = _copy(folders, "eagle3", tmp_path / "y")
    edit_config(d, lambda c: c.update(draft_vocab_size=c["vocab_size"]))
    _refused("eagle3", tiny_target, d, r"holds tensor 'd2t': draft_vocab_size \d+ is the whole vocabulary")


def test_an_eagle3_or_dflash_draft_is_one_file(
    folders: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    """The trainer reads model.safetensors alone (`read_draft_folder`); vLLM would read every shard."""
    d = _copy(folders, "eagle3", tmp_path)
    _shard(d)
    _refused("eagle3", tiny_target, d, r"model-00001-of-00002\.safetensors is not read by the trainer")


def test_a_config_without_the_sizes_is_one_line(
    folders: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    d = _copy(folders, "dflash", tmp_path)
    edit_config(d, lambda c: c.pop("intermediate_size"))
    _refused("dflash", tiny_target, d, r"config\.json lacks a size the dflash weights check reads \(KeyError")


# --------------------------------------------------------------------------------------------------
# Other trainers' EAGLE-3 layouts
# --------------------------------------------------------------------------------------------------


def test_a_specforge_export_is_recognised(
    folders: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    """SpecForge's tensor names are this trainer's; its config.json names no aux layers (vLLM would take the
    target's defaults, the trainer refuses)."""
    d = _copy(folders, "eagle3", tmp_path)
    edit_config(d, lambda c: [c.pop(k) for k in ("eagle_config", "draft_opd", "target_hidden_size")])
    _refused(
        "eagle3",
        tiny_target,
        d,
        rf"^draft\.path: {re.escape(str(d))} is an EAGLE-3 head as SpecForge exports it, whose config\.json names "
        r"no eagle_config\.eagle_aux_hidden_state_layer_ids .*add \"eagle_config\"",
    )


def test_a_speculators_head_is_recognised(
    folders: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    d = _copy(folders, "eagle3", tmp_path)
    _tensors(d, lambda t: t.update({k.replace("midlayer.", "layers.0."): t.pop(k) for k in list(t)}))
    shape = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Eagle3Speculator"],
                "speculators_model_type": "eagle3",
                "draft_vocab_size": VD,
                "transformer_layer_config": {
                    k: shape[k] for k in ("hidden_size", "vocab_size", "model_type")
                },
            }
        )
    )
    _refused(
        "eagle3",
        tiny_target,
        d,
        r"is an EAGLE-3 head in the speculators library's layout \(decoder tensors layers\.0\.\*.*rename "
        r"layers\.0\.\* to midlayer\.\*",
    )


# --------------------------------------------------------------------------------------------------
# Every folder a run loads, by its key
# --------------------------------------------------------------------------------------------------


def test_the_line_starts_with_the_key_that_names_the_folder(
    folders: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    d = _copy(folders, "eagle3", tmp_path)
    with (d / WEIGHTS).open("r+b") as fh:
        fh.truncate(1000)
    for key in ("sft.study.start_from", "resume"):
        _refused("eagle3", tiny_target, d, r"is damaged", key=key)


def test_preflight_checks_every_draft_the_run_loads(tmp_path: Path) -> None:
    """`draft.path`, the sft stage's `sft.study.start_from` and, under `resume=`, the opd checkpoint's draft."""
    from draft_opd_ray.checkpoint import write_checkpoint
    from draft_opd_ray.preflight import _drafts_loaded

    run = tmp_path / "run"
    for step in (1, 2):
        write_checkpoint(
            run / "checkpoints" / "opd",
            f"step_{step}",
            lambda tmp: [(tmp / "draft").mkdir(), (tmp / "training_state.pt").write_bytes(b"")],
        )
    over = ["stages=[sft,opd,eval]", "draft.path=/a", "sft.study.start_from=/b", f"resume={run}"]
    assert _drafts_loaded(compose(over)) == [
        ("draft.path", "/a"),
        ("sft.study.start_from", "/b"),
        ("resume", str(run / "checkpoints" / "opd" / "step_2" / "draft")),
    ]
    assert _drafts_loaded(compose(["stages=[eval]", "draft.path=/a", "sft.study.start_from=/b"])) == [
        ("draft.path", "/a")
    ]

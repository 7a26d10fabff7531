"""The prompt sets: built-in mix, files, reference specs, errors and encoding."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import dflash_quant.prompts as prompts_mod
from dflash_quant.errors import UsageError
from dflash_quant.prompts import Prompt, encode_prompt, load_prompts

WORDS = ["<unk>", "<s>", "<|user|>", "<|assistant|>", "<|end|>", "hello", "world", "two", "plus", "is", "four"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def tiny_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def ids_of(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


# --------------------------------------------------------------------------- builtin set


def test_builtin_is_balanced_and_split():
    allp = load_prompts("builtin")
    assert len(allp) >= 48
    assert len({p.id for p in allp}) == len(allp)
    cats = Counter(p.category for p in allp)
    assert set(cats) == {"code", "math", "chat", "reproduce"}
    assert max(cats.values()) - min(cats.values()) <= 2
    calib, held = load_prompts("builtin:calib"), load_prompts("builtin:heldout")
    assert len(calib) + len(held) == len(allp)
    assert abs(len(calib) - len(held)) <= len(allp) // 8
    for split in (calib, held):
        assert set(Counter(p.category for p in split)) == {"code", "math", "chat", "reproduce"}
    # held-out never repeats calibration content
    calib_texts = {p.text for p in calib}
    assert not calib_texts & {p.text for p in held}
    calib_bodies = {p.text.split("\n\n", 1)[-1] for p in calib if p.category == "reproduce"}
    assert not calib_bodies & {p.text.split("\n\n", 1)[-1] for p in held if p.category == "reproduce"}
    assert all(p.text and p.text.strip() for p in allp)


def test_builtin_file_lines_have_the_schema():
    for line in prompts_mod.BUILTIN.read_text().splitlines():
        row = json.loads(line)
        assert set(row) == {"id", "category", "split", "prompt"}
        assert row["category"] in prompts_mod.CATEGORIES and row["split"] in prompts_mod.SPLITS


def test_unknown_builtin_split():
    with pytest.raises(UsageError, match="unknown split"):
        load_prompts("builtin:train")


# --------------------------------------------------------------------------- files


def test_txt_file_skips_blank_lines(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\n   \nsecond prompt\n")
    ps = load_prompts(str(f))
    assert [p.text for p in ps] == ["first prompt", "second prompt"]
    assert ps[0].messages is None and ps[0].id == "p-1" and ps[1].id == "p-4"


def test_jsonl_prompt_and_messages(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [
        {"id": "a", "prompt": "hello world", "category": "chat"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two plus two"}]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ps = load_prompts(f)
    assert ps[0] == Prompt(id="a", category="chat", split=None, text="hello world")
    assert ps[1].text is None and ps[1].id == "p-2"
    assert ps[1].as_messages()[1] == {"role": "user", "content": "two plus two"}


def test_missing_file(tmp_path):
    with pytest.raises(UsageError, match="neither builtin"):
        load_prompts(str(tmp_path / "nope.jsonl"))


def test_unknown_extension(tmp_path):
    f = tmp_path / "p.csv"
    f.write_text("a,b\n")
    with pytest.raises(UsageError, match="unknown prompt file type '.csv'"):
        load_prompts(str(f))


@pytest.mark.parametrize("name,content", [("e.txt", "\n  \n"), ("e.jsonl", "\n")])
def test_empty_set(tmp_path, name, content):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(UsageError, match="is empty"):
        load_prompts(str(f))


@pytest.mark.parametrize(
    "bad,match",
    [
        ("{not json", "line 3: not valid JSON"),
        ("[1, 2]", "line 3: expected a JSON object"),
        ('{"id": "x"}', "line 3: give exactly one of"),
        ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "line 3: give exactly one of"),
        ('{"prompt": 5}', "line 3: `prompt` must be a non-empty string"),
        ('{"messages": []}', "line 3: `messages` must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', r"line 3: messages\[0\]"),
    ],
)
def test_bad_jsonl_line_names_the_line(tmp_path, bad, match):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n\n' + bad + "\n")
    with pytest.raises(UsageError, match=match):
        load_prompts(str(f))


# --------------------------------------------------------------------------- reference specs


def test_reference_spec_reads_pair_files(tmp_path, monkeypatch):
    pair = tmp_path / "pair"
    pair.mkdir()
    (pair / "heldout_prompts.jsonl").write_text(
        json.dumps({"id": "h-000", "prompt": "def f(x):", "source": "a.py"}) + "\n"
    )
    monkeypatch.setattr(prompts_mod, "REFERENCE_PAIR_DIR", pair)
    ps = load_prompts("reference:heldout")
    assert ps == [Prompt(id="h-000", category=None, split="heldout", text="def f(x):")]
    with pytest.raises(UsageError, match="calibration_prompts.jsonl is missing"):
        load_prompts("reference:calib")
    with pytest.raises(UsageError, match="reference:calib or reference:heldout"):
        load_prompts("reference")


# --------------------------------------------------------------------------- encoding


def test_encode_plain_without_template():
    tok = tiny_tokenizer()
    p = Prompt(id="x", text="hello world")
    assert encode_prompt(tok, p) == ids_of("hello", "world")
    assert encode_prompt(tok, p, chat_template=False) == ids_of("hello", "world")
    assert encode_prompt(tok, "two plus two") == ids_of("two", "plus", "two")
    msgs = Prompt(id="m", messages=({"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}))
    assert encode_prompt(tok, msgs) == ids_of("hello", "world")  # contents joined when there is no template


def test_encode_with_chat_template():
    tok = tiny_tokenizer(TEMPLATE)
    p = Prompt(id="x", text="two plus two is")
    assert encode_prompt(tok, p) == ids_of("<|user|>", "two", "plus", "two", "is", "<|end|>", "<|assistant|>")
    # chat_template=False falls back to the plain encoding even when a template exists
    assert encode_prompt(tok, p, chat_template=False) == ids_of("two", "plus", "two", "is")
    msgs = Prompt(id="m", messages=({"role": "user", "content": "hello"},))
    assert encode_prompt(tok, msgs) == ids_of("<|user|>", "hello", "<|end|>", "<|assistant|>")


def test_prompt_needs_exactly_one_body():
    with pytest.raises(ValueError):
        Prompt(id="x")
    with pytest.raises(ValueError):
        Prompt(id="x", text="a", messages=({"role": "user", "content": "b"},))

"""Prompts: the embedded set, user files in every format, chat templates, and bad input."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
from tokenizers import processors

from specpolicy.data import PromptSource, encode_prompts, fitting
from specpolicy.data.prompts import EMBEDDED
from specpolicy.errors import SpecPolicyError
from specpolicy.models.tiny import byte_tokenizer


def test_embedded_set_is_large_diverse_and_split() -> None:
    rows = [json.loads(line) for line in EMBEDDED.read_text().splitlines()]
    assert len(rows) >= 500 and len({r["prompt"] for r in rows}) == len(rows)
    categories = Counter(r["category"] for r in rows)
    assert set(categories) == {"writing", "open_qa", "reasoning_math", "coding", "summarisation", "extraction",
                               "translation", "roleplay"}
    assert min(categories.values()) >= 50
    splits = {split: {c[0]["content"] for c in PromptSource(split=split).load()}
              for split in ("train", "validation", "test")}
    assert sum(map(len, splits.values())) == len(rows) and min(len(splits["validation"]), len(splits["test"])) >= 48
    assert not splits["train"] & splits["validation"] and not splits["test"] & (splits["train"] | splits["validation"])
    assert PromptSource().split == "test"  # evaluation never decodes what distillation was tuned on


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet", ".txt"])
def test_user_files_in_every_format(tmp_path: Path, suffix: str) -> None:
    df = pd.DataFrame({"prompt": ["Say hi.", "Count to three."]})
    path = tmp_path / f"p{suffix}"
    {".jsonl": lambda: df.to_json(path, orient="records", lines=True), ".csv": lambda: df.to_csv(path, index=False),
     ".parquet": lambda: df.to_parquet(path),
     ".txt": lambda: path.write_text("Say hi.\n\n  \nCount to three.\n")}[suffix]()  # blank lines are skipped
    conversations = PromptSource(prompts_file=str(path)).load()
    assert conversations == [[{"role": "user", "content": "Say hi."}], [{"role": "user", "content": "Count to three."}]]


def test_the_prompt_column_is_a_setting(tmp_path: Path) -> None:
    """Data sets name it `instruction`, `question`, ...: that was an error without a way around it."""
    path = tmp_path / "alpaca.jsonl"
    path.write_text('{"instruction": "Say hi.", "output": "Hi."}\n')
    with pytest.raises(SpecPolicyError, match=r"row 0 of .* \(its columns: instruction, output\); name the prompt's "
                                              r"column with data.prompt_field=COLUMN$"):
        PromptSource(prompts_file=str(path)).load()
    assert PromptSource(prompts_file=str(path), prompt_field="instruction").load() == [[{"role": "user",
                                                                                          "content": "Say hi."}]]


def test_prompts_that_read_as_numbers_stay_text(tmp_path: Path) -> None:
    """pandas made a CSV column of `12` and `007` floats, and the error said the prompt column was missing; a JSON
    number is named as what it is."""
    path = tmp_path / "numbers.csv"
    path.write_text("id,question\n1,12\n2,007\n3,NA\n4,None\n")
    assert PromptSource(prompts_file=str(path), prompt_field="question").load() == [
        [{"role": "user", "content": text}] for text in ("12", "007", "NA", "None")]
    path = tmp_path / "numbers.jsonl"
    path.write_text('{"prompt": 42}\n')
    with pytest.raises(SpecPolicyError, match=r"row 0 of .*; its 'prompt' is 42, not text; write prompts as strings$"):
        PromptSource(prompts_file=str(path)).load()


def test_chat_data_sets_decode_up_to_the_reply(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """ShareGPT's from/value turns read as role/content ones, and a reference reply at the end is dropped: with it,
    the chat template opened a second assistant turn after it, and the model answered its own answer. Gemma-style
    data names the assistant "model": its reply stayed in the prompt, under a role other templates do not know."""
    path = tmp_path / "chats.jsonl"
    sharegpt = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello"}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    gemma = [{"role": "user", "content": "Hi"}, {"role": "model", "content": "Hello"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in
                            ({"conversations": sharegpt}, {"messages": messages}, {"messages": gemma})))
    assert PromptSource(prompts_file=str(path)).load() == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], messages,
        [{"role": "user", "content": "Hi"}]]
    assert "2 of 3 conversations in" in caplog.text and "trailing assistant turns are dropped" in caplog.text
    assert "repeat an earlier one" not in caplog.text


def test_repeated_prompts_are_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file with copies weighed them twice in every mean without a word; a copy up to the reply counts too."""
    path = tmp_path / "copies.jsonl"
    reply = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in
                            ({"prompt": "Hi"}, {"prompt": "Bye"}, {"messages": reply}, {"prompt": "Bye"})))
    for split in ("train", "validation", "test"):  # a file without splits serves each: one warning, no split named
        assert len(PromptSource(prompts_file=str(path), split=split).load()) == 4
    assert caplog.text.count(f"2 of 4 prompts in {path} repeat an earlier one; the copies are kept") == 1
    PromptSource(split="all").load()
    assert caplog.text.count("repeat an earlier one") == 1


def test_chat_messages_and_template(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path.write_text(json.dumps({"messages": messages}) + "\n")
    conversations = PromptSource(prompts_file=str(path), limit=1).load()
    assert conversations == [messages]
    tok = byte_tokenizer()
    [ids] = encode_prompts(tok, conversations, context_length=512)
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                               "<|im_start|>assistant\n")



def test_a_tokenizer_without_a_template_reads_the_turns_with_its_own_special_tokens() -> None:
    """A base Llama's tokenizer has no chat template and starts every text with BOS, which a template writes into
    the text it renders: without one, the prompts went to the model without the BOS it was trained with."""
    tok = byte_tokenizer()
    tok.chat_template = None
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                                  special_tokens=[("<|im_start|>", tok.bos_token_id)])
    [ids] = encode_prompts(tok, [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]], 64)
    assert tok.decode(ids) == "<|im_start|>Be brief.\n\nHi"

@pytest.mark.parametrize(
    "content,message",
    [
        (None, "does not exist"),
        ("", "is empty"),
        ("\n \n\n", "is empty"),  # was datasets' 'Instruction "train" corresponds to no data!'
        ('{"prompt": "caf\udce9"}\n', r"is not UTF-8 text \(byte 0xe9 at offset 15\); save it as UTF-8"),  # pyarrow
        ('{"text": "no prompt"}\n', "neither a non-empty 'prompt'"),
        ('{"prompt": "ok"}\n{"prompt": oops}\n', "JSON parse error"),
        ('{"messages": [{"content": "no role"}]}\n', "'messages' must be a list of"),
        ('{"messages": "not a list"}\n', "'messages' must be a list of"),
        ('{"conversations": [{"from": "human"}]}\n', r"or 'conversations' of \{'from': str, 'value': str\}"),
        ('{"messages": [{"role": "assistant", "content": "Hi"}]}\n', "no turn before the assistant's; add the user's"),
    ],
)
def test_bad_prompt_files_name_the_problem(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    if content is not None:
        path.write_bytes(content.encode("utf-8", "surrogateescape"))  # \udce9: the byte 0xe9, Latin-1's é
    with pytest.raises(SpecPolicyError, match=message):
        PromptSource(prompts_file=str(path)).load()


def test_file_quirks_read_as_their_prompts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A text file's byte-order mark stayed in its first prompt; `prompt_field=text` for a text file stopped in
    "New column name text already in the dataset"; a `split` column of mixed types in a TypeError from sorted();
    a JSON object instead of a list of them was told to name its prompt column, which could not help."""
    text = tmp_path / "p.txt"
    text.write_bytes("\ufeffSay hi.\nSay bye.\n".encode())
    expected = [[{"role": "user", "content": "Say hi."}], [{"role": "user", "content": "Say bye."}]]
    assert PromptSource(prompts_file=str(text)).load() == expected
    assert PromptSource(prompts_file=str(text), prompt_field="text").load() == expected
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"prompt": "a", "split": 1}\n{"prompt": "b", "split": "test"}\n{"prompt": "c", "split": ""}\n')
    assert PromptSource(prompts_file=str(mixed)).load() == [[{"role": "user", "content": "b"}]]
    assert PromptSource(prompts_file=str(mixed), split="1").load() == [[{"role": "user", "content": "a"}]]
    assert PromptSource(prompts_file=str(mixed)).splits == ["1", "test"]  # an empty split is none (it was '')
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"prompts": ["a", "b"]}))
    with pytest.raises(SpecPolicyError, match="a .json prompts file must hold a list of objects, one per prompt"):
        PromptSource(prompts_file=str(wrapped)).load()


def test_a_folder_or_an_unknown_split_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A folder was "does not exist"; a split typo (`tset`) was "no prompts", without the splits there are."""
    with pytest.raises(SpecPolicyError, match="is a folder; point data.prompts_file at a file in it"):
        PromptSource(prompts_file=str(tmp_path)).load()
    mixed = tmp_path / "mixed.jsonl"  # rows without a split (None in the column), or in one no stage reads
    rows = [{"prompt": "a", "split": "test"}, {"prompt": "b"}, {"prompt": "c", "split": "TEST"},
            {"prompt": "d", "split": "dev"}, {"prompt": "e", "split": "train"}]
    mixed.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with caplog.at_level("WARNING", logger="specpolicy"):  # dropped without a word
        assert PromptSource(prompts_file=str(mixed)).load() == [[{"role": "user", "content": "a"}]]
    assert ("3 of the 5 rows of" in caplog.text and "are in no split the pipeline reads (1 with no `split`, 1 in "
            "split 'TEST', 1 in split 'dev')" in caplog.text)
    PromptSource(prompts_file=str(mixed)).load()  # distil reads three splits of one file: said once
    assert caplog.text.count("in no split the pipeline reads") == 1
    caplog.clear()
    PromptSource(prompts_file=str(mixed), split="dev").load()  # read by this run: not among the unread
    assert "2 of the 5 rows" in caplog.text and "'dev'" not in caplog.text
    with pytest.raises(SpecPolicyError, match=r"data.split='tset' is not a split of .*; choose one of "
                                              r"\['test', 'train', 'validation', 'all'\]"):
        PromptSource(split="tset").load()


def test_a_limit_of_no_prompts_is_refused() -> None:
    with pytest.raises(SpecPolicyError, match=r"data.limit \(or null for every prompt\) must be an integer >= 1"):
        PromptSource(limit=0)


def test_prompt_longer_than_context_is_refused() -> None:
    with pytest.raises(SpecPolicyError, match="exceeds the model's context of 64; .* lower engine.max_new_tokens$"):
        encode_prompts(byte_tokenizer(), [[{"role": "user", "content": "x" * 100}]], context_length=64)
    several = [[{"role": "user", "content": "x" * n}] for n in (100, 10, 90, 80, 70, 60, 50)]
    with pytest.raises(SpecPolicyError, match=r"^6 of 7 prompts, with 8 tokens of generation each, exceed the model's "
                                              r"context of 64: prompts 0 \(119 tokens\), 2 \(109 tokens\), .*, 5 "
                                              r"\(\d+ tokens\), \.\.\., numbered from 0; shorten them"):
        encode_prompts(byte_tokenizer(), several, context_length=64, reserve=8)
    with pytest.raises(SpecPolicyError, match=r"^5 of 6 prompts, .*, 5 \(\d+ tokens\), numbered from 0;"):
        encode_prompts(byte_tokenizer(), several[:6], context_length=64, reserve=8)
    # from a notebook: strings, or a LoadedModel, ended in transformers' "Chat messages should be dicts ... 'h'"
    with pytest.raises(SpecPolicyError, match="prompt 0 is not a conversation: encode_prompts takes a list of them"):
        encode_prompts(byte_tokenizer(), ["hello"], context_length=64)
    with pytest.raises(SpecPolicyError, match="encode_prompts needs a tokenizer .*, got str"):
        encode_prompts("gpt2", [[{"role": "user", "content": "x"}]], context_length=64)


def test_a_conversation_the_chat_template_refuses_is_named() -> None:
    """Templates raise on what their model never saw (Gemma's: a system turn); that was a jinja2 traceback."""
    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('no system turns') }}{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(SpecPolicyError, match=r"^prompt 1: the target's chat template refuses it \(no system turns\)"):
        encode_prompts(tok, [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "be brief"}]], 512)


def test_training_stages_skip_prompts_too_long_and_name_the_limit(caplog: pytest.LogCaptureFixture) -> None:
    """distil named distill.max_length where the target's context was the limit; collect stopped on one prompt."""
    chats = [[{"role": "user", "content": "x" * n}] for n in (5, 80, 10)]
    with caplog.at_level("WARNING", logger="specpolicy"):
        kept = fitting(byte_tokenizer(), chats, 60, "collect", "the target's context of 64 less 4")
    assert kept == [chats[0], chats[2]]
    assert "collect: 1 of 3 prompts are longer than 60 tokens (the target's context" in caplog.text
    with pytest.raises(SpecPolicyError, match=r"^distil \(train\): every prompt is longer than 8 tokens"):
        fitting(byte_tokenizer(), chats, 8, "distil (train)", "distill.max_length=9")


def test_a_hub_dataset_without_the_split_says_so(tmp_path: Path) -> None:
    """Most hub datasets have only `train`; `data.split=test` (the default) was "cannot load hub dataset ...
    (ValueError); check the name and network", which sent the user to the network."""
    (tmp_path / "train.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(SpecPolicyError, match=r"\(ValueError: Unknown split \"test\".*\); set data.split to one "
                                              r"of its splits"):
        PromptSource(hub_dataset=str(tmp_path)).load()
    assert PromptSource(hub_dataset=str(tmp_path), split="train").load() == [[{"role": "user", "content": "a"}]]

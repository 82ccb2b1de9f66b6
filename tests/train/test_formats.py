"""Record data: every file format, the field map, labels checked token by token against
hand-built examples (completion-only, assistant-only), truncation, and bad records named by
file and line."""

from __future__ import annotations

import json

import pytest

from tightfit.train.data import ByteTokenizer, HFTokenizer, load_train_data
from tightfit.train.run_options import DataOptions

from .helpers import chat_model, write_jsonl

IGN = -100
QA = [{"prompt": "Q: 2+2?", "completion": " 4"},
      {"prompt": "Q: capital of France?", "completion": " Paris"},
      {"prompt": "Say hi", "completion": " hi!"}]  # fmt: skip
WORDS = ["be", "brief", "hi", "there", "hello", "bye", "see", "you"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"}]  # fmt: skip


def _load(path, tok=None, seq_len: int = 64, **kw):
    return load_train_data(DataOptions(path=str(path), **kw), tok or ByteTokenizer(),
                           seq_len=seq_len, batch_size=1, grad_accum=1, seed=0)


def _rows(data) -> list[tuple[list[int], list[int]]]:
    ex = data.train.examples
    return ex.get(range(len(ex)))


def test_prompt_completion_labels_token_by_token(tmp_path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", QA)
    data = _load(path)
    expected = []
    for r in QA:
        p, c = list(r["prompt"].encode()), list(r["completion"].encode())
        expected.append((p + c, [IGN] * len(p) + c))  # bytes: no BOS or EOS to add
    assert _rows(data) == expected
    assert data.summary["format"] == "prompt-completion"
    assert data.summary["targets"] == sum(len(r["completion"]) for r in QA)
    everything = _load(path, completion_only=False)
    assert all(ids == labels for ids, labels in _rows(everything))
    for d in (data, everything):
        d.close()


def test_chat_trains_assistant_turns_only_token_by_token(tmp_path) -> None:
    folder = chat_model(tmp_path / "m", WORDS)
    tok = HFTokenizer(folder)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    rendered = ["<|system|>", "be", "brief", "<|end|>", "<|user|>", "hi", "there", "<|end|>", "<|assistant|>", "hello", "<|end|>", "<|user|>", "bye", "<|end|>", "<|assistant|>", "see", "you", "<|end|>"]
    trained = {9, 10, 15, 16, 17}  # hello <|end|>, see you <|end|>
    ids = tok.hf.convert_tokens_to_ids(rendered)
    labels = [i if k in trained else IGN for k, i in enumerate(ids)]
    data = _load(path, tok)
    assert _rows(data) == [(ids, labels)] and data.summary["format"] == "chat"
    # a template with transformers' {% generation %} markers: the same labels, its own way
    tok.hf.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}"
        "{{ m['content'] }} <|end|>{% endgeneration %} {% else %}<|{{ m['role'] }}|> "
        "{{ m['content'] }} <|end|> {% endif %}{% endfor %}")
    marked = _load(path, tok)
    assert _rows(marked) == [(ids, labels)]
    for d in (data, marked):
        d.close()


def test_every_file_format_reads_the_same_examples(tmp_path) -> None:
    from datasets import Dataset

    ds = Dataset.from_list(QA)
    ds.to_json(tmp_path / "qa.jsonl")
    (tmp_path / "qa.json").write_text(json.dumps(QA))  # a JSON array
    ds.to_csv(tmp_path / "qa.csv", index=False)
    ds.to_parquet(tmp_path / "qa.parquet")
    ds.save_to_disk(tmp_path / "saved")
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "00.jsonl", QA[:2])
    write_jsonl(shards / "01.jsonl", QA[2:])
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [
        {"question": r["prompt"], "answer": r["completion"], "id": i} for i, r in enumerate(QA)])
    loaded = [_load(tmp_path / n) for n in ("qa.jsonl", "qa.json", "qa.csv", "qa.parquet",
                                            "saved", "shards")]
    loaded.append(_load(renamed, fields="prompt=question,completion=answer"))
    assert len({d.fingerprint for d in loaded}) == 1
    assert all(d.summary["examples"] == 3 for d in loaded)
    assert not list(tmp_path.glob("saved/cache-*"))  # nothing written into the data folder
    for d in loaded:
        d.close()


def test_text_records_train_every_token_with_the_tokenizers_specials(tmp_path) -> None:
    folder = chat_model(tmp_path / "m", WORDS)
    tok = HFTokenizer(folder)
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hi there"}, {"text": "see you"}])
    data = _load(path, tok)
    end = tok.eos_id
    assert _rows(data) == [(tok.encode("hi there") + [end],) * 2,
                           (tok.encode("see you") + [end],) * 2]
    assert data.summary["format"] == "text"
    data.close()


def test_long_records_are_truncated_and_counted_or_refused(tmp_path) -> None:
    long = {"prompt": "p" * 10, "completion": "c" * 30}
    only_prompt = {"prompt": "p" * 40, "completion": "c"}
    path = write_jsonl(tmp_path / "long.jsonl", [QA[0], long, only_prompt])
    data = _load(path, seq_len=16)
    assert data.summary["truncated"] == 1 and data.summary["dropped"] == 1  # nothing to learn
    assert "1 truncated to --seq-len, 1 dropped" in data.describe()
    rows = _rows(data)
    assert len(rows) == 2 and rows[1] == (list(b"p" * 10 + b"c" * 6), [IGN] * 10 + list(b"c" * 6))
    data.close()
    with pytest.raises(ValueError, match=r"long.jsonl', line 2: the record has 40 tokens, more "
                                         r"than --seq-len 16; .* --too-long truncate"):
        _load(path, seq_len=16, too_long="refuse")


def test_bad_records_are_named_by_file_and_line(tmp_path) -> None:
    def refused(records, match, tok=None, name="bad.jsonl", **kw):
        path = write_jsonl(tmp_path / name, records)
        with pytest.raises(ValueError, match=match):
            _load(path, tok, **kw)

    good = QA[0]
    # a blank line does not count as a record: the bad one is on line 4
    path = tmp_path / "gap.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n" + '{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"gap.jsonl', line 4: the record has no 'completion'"):
        _load(path)
    refused([good, {"prompt": " ", "completion": "y"}], r"line 2: the record has an empty 'prompt'")
    refused([good, {"prompt": "x", "completion": ""}], r"line 2: .* empty 'completion'")
    refused([{"question": "x", "completion": "y"}], r"bad.jsonl' has no column \['prompt'\] for "
            r"--format prompt-completion; its columns are \['question', 'completion'\]; map "
            r"yours with --fields prompt=COLUMN", format="prompt-completion")
    refused([{"question": "x"}], r"none of a record format.*--fields prompt=question")
    chat_tok = HFTokenizer(chat_model(tmp_path / "m", WORDS))
    refused([{"messages": CHAT}, {"messages": CHAT[:2]}],
            r"line 2: the record has no assistant turn", chat_tok)
    refused([{"messages": [{"role": "robot", "content": "hi"}]}], r"line 1: .* a turn that is not",
            chat_tok)
    refused([{"messages": CHAT}], r"has no chat template; pass --model with a chat model's "
            r"folder \(its chat_template.jinja, or chat_template in tokenizer_config.json\)")
    no_template = HFTokenizer(chat_model(tmp_path / "plain", WORDS, template=None))
    refused([{"messages": CHAT}], r"the tokenizer of .*plain' has no chat template", no_template)
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "a.jsonl", [good, good])
    write_jsonl(shards / "b.jsonl", [good, {"prompt": "x"}])
    with pytest.raises(ValueError, match=r"b.jsonl', line 2: the record has no 'completion'"):
        _load(shards)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "x", "completion": "y"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl' is not valid JSON / JSON Lines: line 2, "
                                         r"column 12: Expecting value; fix the file.$"):
        _load(tmp_path / "broken.jsonl")
    _bad_json_is_named_by_its_line(tmp_path)
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", [good])
    (tmp_path / "mixed" / "b.txt").write_text("text")
    with pytest.raises(ValueError, match="mixes file types"):
        _load(tmp_path / "mixed")


def _bad_json_is_named_by_its_line(tmp_path) -> None:
    """Issue 28 item 6: the 1-based line of the file, not datasets' 0-based row of a block
    (its row restarts every ~10 MB), no --format raw hint (it would train on the JSON
    syntax), and datasets' own error lines not printed beside ours."""
    import logging

    good = json.dumps({"text": "x" * 1000})
    for bad, line in ((249, 250), (24_999, 25_000)):  # 25 MB: datasets reads it in blocks
        lines = [good] * (bad + 2)
        lines[bad] = '{"text": "a",}'
        path = tmp_path / f"bad-at-{bad}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda r, seen=seen: seen.append(r.getMessage())  # type: ignore[method-assign]
        logging.getLogger("datasets").addHandler(handler)
        try:
            with pytest.raises(ValueError) as refused:
                _load(path)
        finally:
            logging.getLogger("datasets").removeHandler(handler)
        said = str(refused.value)
        assert f"is not valid JSON / JSON Lines: line {line}, column 14: Expecting property " \
               "name enclosed in double quotes; fix the file." in said, said
        assert " row " not in said and "--format raw" not in said
        assert not [m for m in seen if "Failed to load JSON" in m], seen
    document = tmp_path / "array.json"  # one JSON document over several lines
    document.write_text('[\n  {"text": "a"},\n  {"text": \n]\n')
    with pytest.raises(ValueError, match=r"array.json' is not valid JSON / JSON Lines: line 4, "
                                         r"column 1: Expecting value"):
        _load(document)


def test_instruction_tuning_end_to_end_and_refused_starts_write_nothing(tmp_path, capsys) -> None:
    from tightfit.cli import main

    words = [f"w{i}" for i in range(30)]
    folder = chat_model(tmp_path / "m", words)
    convs = [{"messages": [{"role": "user", "content": " ".join(words[i : i + 3])},
                           {"role": "assistant", "content": " ".join(words[i + 3 : i + 3 + i % 4 + 1])}]}
             for i in range(24)]  # fmt: skip
    data = write_jsonl(tmp_path / "chat.jsonl", convs)
    out = tmp_path / "run"
    args = ["train", "--model", str(folder), "--data", str(data), "--steps", "3",
            "--batch-size", "2", "--seq-len", "32", "--eval-fraction", "0.25", "--eval-every",
            "2", "--batching", "pack", "--checkpoint", "none", "--track-every", "0"]
    assert main([*args, "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # notes wrap at 100 columns
    assert "as chat: 18 examples" in printed and "eval loss" in printed
    meta = json.loads((out / "report.json").read_text())["meta"]
    assert meta["data"]["format"] == "chat" and meta["data"]["eval_examples"] == 6
    assert [e["step"] for e in meta["eval"]] == [2, 3] and meta["eval_loss"] > 0
    assert meta["eval_perplexity"] == pytest.approx(2.718281828 ** meta["eval_loss"])
    assert 0 < meta["trained_tokens"] < meta["batch_efficiency"]["tokens"]
    assert 0 < meta["batch_efficiency"]["efficiency"] <= 1
    assert (out / "loss_curve.png").is_file()

    bad = write_jsonl(tmp_path / "bad.jsonl", [*convs[:3], {"messages": convs[0]["messages"][:1]}])
    # (--seq-len 32: the model's 64 positions are checked before the data is read)
    for extra in (["--data", str(bad), "--seq-len", "32"], ["--data", str(data), "--seq-len", "4096"],
                  ["--data", str(data), "--fields", "oops", "--seq-len", "32"]):
        never = tmp_path / "never"
        assert main([*args[:3], *extra, "--out", str(never)]) == 2
        assert not never.exists()
    err = capsys.readouterr().err
    assert "bad.jsonl', line 4: the record has no assistant turn" in err
    assert "--fields 'oops'" in err

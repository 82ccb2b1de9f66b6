"""Issue 28 item 7: Alpaca records (instruction / input / output) are a format of their own:
detected from the columns, the prompt the instruction (and the input, when it has text) in the
Alpaca layout, the loss on the output only; a --fields mapping that leaves a column with text
unused (Alpaca's input under prompt=instruction,completion=output) says so."""

from __future__ import annotations

import json
import logging

import pytest

from tightfit.cli import main
from tightfit.train.data import ByteTokenizer, load_train_data
from tightfit.train.data.records import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT
from tightfit.train.run_options import DataOptions

from .helpers import tiny_llama, write_jsonl

IGN = -100
ALPACA = [
    {"instruction": "Give the capital of the country.", "input": "France", "output": "Paris"},
    {"instruction": "Say hello.", "input": "", "output": "Hello!"},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
]


def _load(path, **kw):
    return load_train_data(DataOptions(path=str(path), **kw), ByteTokenizer(), seq_len=512,
                           batch_size=1, grad_accum=1, seed=0)


def _rows(data) -> list[tuple[list[int], list[int]]]:
    ex = data.train.examples
    return ex.get(range(len(ex)))


def test_alpaca_records_are_detected_and_trained_on_the_output_only(tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA)
    data = _load(path)
    assert data.summary["format"] == "alpaca"
    prompts = [
        "Below is an instruction that describes a task, paired with an input that provides "
        "further context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nGive the capital of the country.\n\n### Input:\nFrance\n\n"
        "### Response:\n",
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nSay hello.\n\n### Response:\n",
        ALPACA_PROMPT.format(instruction="Add the numbers.", input="2 and 3"),
    ]
    expected = []
    for prompt, r in zip(prompts, ALPACA):
        p, c = list(prompt.encode()), list(r["output"].encode())
        expected.append((p + c, [IGN] * len(p) + c))  # bytes: no BOS or EOS to add
    assert _rows(data) == expected
    assert data.summary["targets"] == sum(len(r["output"]) for r in ALPACA)
    everything = _load(path, completion_only=False)
    assert all(ids == labels for ids, labels in _rows(everything))
    # without an input column at all (instruction / output only): the no-input layout
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"instruction": "Say hi.", "output": "hi"}])
    only = _load(bare)
    assert only.summary["format"] == "alpaca"
    prompt = ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi.")
    assert _rows(only) == [(list((prompt + "hi").encode()), [IGN] * len(prompt) + list(b"hi"))]
    for d in (data, everything, only):
        d.close()


def test_alpaca_fields_map_and_bad_records_are_named(tmp_path) -> None:
    dolly = write_jsonl(tmp_path / "dolly.jsonl", [
        {"instruction": "Name the river.", "context": "It flows through Paris.",
         "response": "The Seine."}])
    data = _load(dolly, fields="input=context,output=response")
    assert data.summary["format"] == "alpaca"
    ids, labels = _rows(data)[0]
    text = ByteTokenizer().decode(ids)
    assert "### Input:\nIt flows through Paris.\n\n### Response:\nThe Seine." in text
    data.close()
    with pytest.raises(ValueError, match=r"no column \['ctx'\] for --format alpaca.*"
                                         r"--fields input=COLUMN"):
        _load(dolly, format="alpaca", fields="input=ctx,output=response")
    bad = [*ALPACA, {"instruction": "Empty.", "input": "", "output": " "}]
    with pytest.raises(ValueError, match=r"bad.jsonl', line 4: the record has an empty 'output'"):
        _load(write_jsonl(tmp_path / "bad.jsonl", bad))
    odd = [*ALPACA[:1], {"instruction": "Count.", "input": 3, "output": "3"}]
    (tmp_path / "odd.jsonl").write_text("".join(json.dumps(r) + "\n" for r in odd))
    with pytest.raises(ValueError, match=r"odd.jsonl', line 2: the record has a int in 'input', "
                                         r"not text"):
        _load(tmp_path / "odd.jsonl")


def test_a_fields_mapping_that_drops_alpacas_input_says_so(tmp_path, caplog) -> None:
    path = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA)
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        data = _load(path, fields="prompt=instruction,completion=output")
    assert data.summary["format"] == "prompt-completion"  # what --fields asked for
    data.close()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == [
        f"column 'input' of {str(path)!r} holds text in 2 of 3 records but is not trained on: "
        "--fields prompt=instruction,completion=output reads 'instruction' and 'output' as "
        "prompt-completion; for Alpaca records (instruction and input as the prompt) drop "
        "--fields or pass --format alpaca."]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tightfit"):  # input mapped too: nothing to say
        _load(path, fields="instruction=instruction,input=input").close()
        no_input = write_jsonl(tmp_path / "empty-input.jsonl",
                               [{**r, "input": ""} for r in ALPACA])
        _load(no_input, fields="prompt=instruction,completion=output").close()  # all empty
    assert [r for r in caplog.records if r.levelno == logging.WARNING] == []


def test_tightfit_train_trains_on_alpaca_data(tmp_path, capsys) -> None:
    model = tiny_llama(tmp_path / "model", positions=256, tokenizer=True)  # the layout's ~150
    records = [{"instruction": f"Repeat word {i}.", "input": "" if i % 2 else f"w{i}",
                "output": f"w{i} w{i}"} for i in range(8)]
    data = write_jsonl(tmp_path / "alpaca.jsonl", records)
    out = tmp_path / "run"
    assert main(["train", "--model", str(model), "--data", str(data), "--out", str(out),
                 "--steps", "2", "--batch-size", "2", "--seq-len", "256", "--lora-r", "2",
                 "--track-every", "0", "--checkpoint", "none", "--device-budget", "none"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert f"data: {str(data)!r} as alpaca: 8 examples" in printed
    meta = json.loads((out / "report.json").read_text())["meta"]
    assert meta["data"]["format"] == "alpaca"
    assert 0 < meta["trained_tokens"] < meta["batch_efficiency"]["tokens"] / 4  # outputs only

"""Text that fits 100 columns (``tightfit.report.text``) and the report's terminal form."""

from __future__ import annotations

import json
import logging

from tightfit.report.document import MemoryReport, Piece
from tightfit.report.text import WIDTH, WrappingFormatter, text_table, wrap

MiB = 1 << 20


def test_wrap_indents_continuations_past_the_lines_own_indent() -> None:
    assert wrap("short\n  also short") == "short\n  also short"
    long = "note: " + " ".join(f"word{i}" for i in range(40))
    lines = wrap(f"  {long}").split("\n")
    assert len(lines) > 1 and all(len(x) <= WIDTH for x in lines)
    assert lines[0].startswith("  note: word0") and all(x.startswith("    w") for x in lines[1:])
    assert " ".join(x.strip() for x in lines) == long  # nothing lost, nothing added


def test_a_word_longer_than_a_line_stays_whole() -> None:
    path = "/data/" + "x" * 120 + "/train.jsonl"
    lines = wrap(f"data: 1 file from {path}, 10 examples").split("\n")
    assert lines == ["data: 1 file from", f"  {path},", "  10 examples"]


def test_a_table_wraps_its_widest_text_column_to_fit() -> None:
    rows = [["a", "short", "1.00"], ["b", "a label far too long " * 5, "2.00"]]
    lines = text_table(["name", "label", "MiB"], rows, width=60, wrap_columns=(1,), right=(2,))
    assert max(map(len, lines)) <= 60 and len(lines) > 4
    assert lines[0].split() == ["name", "label", "MiB"] and set(lines[1]) == {"-", " "}
    assert lines[3].startswith("b ") and lines[3].endswith("2.00")  # the number on the first line
    assert lines[4].startswith("   ") and "2.00" not in lines[4]  # a continuation: label only
    wide = text_table(["name", "label"], rows, width=60)  # nothing may wrap: as wide as it is
    assert max(map(len, wide)) > 60


def test_the_log_formatter_wraps_each_message() -> None:
    record = logging.LogRecord("tightfit", logging.INFO, __file__, 1, "note: %s", ("x " * 80,),
                               None)
    text = WrappingFormatter().format(record)
    assert text.startswith("note: x x") and max(len(x) for x in text.split("\n")) <= WIDTH


def _report() -> MemoryReport:
    """A report with every section and labels longer than any run makes today."""
    long = "selective checkpoint plan with the inputs offloaded + chunked loss (64 chunks)"
    pieces = [
        Piece("base weights", "base weight storage", "bf16", 15_000 * MiB, "NF4", 3_900 * MiB,
              {"params": 7_000_000_000, "bits_per_param": 4}),
        Piece("activations", "activation memory", "no checkpointing, unchunked loss (predicted, "
              "not run: it would not fit the memory left)", 90_000 * MiB, long, 2_000 * MiB,
              {"policy": "selective", "plan_predicted_peak_bytes": 2_100 * MiB}),
        Piece("optimizer state", "optimizer-state spikes (OOM mid-run)", "full AdamW (fp32)",
              50_000 * MiB, "PagedAdamW8bit (LoRA)", 300 * MiB,
              {"device": 64 * MiB, "host": 200 * MiB, "disk": 36 * MiB, "paged_in": 12 * MiB,
               "page_faults": 3}),
    ]
    return MemoryReport(
        pieces,
        step={"device": {"peak_bytes": 70_000 * MiB, "end_of_step_bytes": 6_000 * MiB,
                         "counted_bytes": 6_200 * MiB},
              "host": {"rss_bytes": 9_000 * MiB, "rss_peak_bytes": 9_500 * MiB},
              "how": "CUDA allocator: max_memory_allocated ... " * 4},
        run={"first_step": 1, "last_step": 12_000, "resumed_at": [4_000, 8_000],
             "total_bytes": 6_100 * MiB, "peak_bytes": 71_000 * MiB,
             "measured_as": "CUDA allocator: memory_allocated at the end of a step, "
                            "max_memory_allocated"},
        paging={"target_bytes": 72_000 * MiB, "target_option": "--target auto", "evictions": 12,
                "restores": 11, "evicted_bytes": 40 * MiB, "restored_bytes": 38 * MiB,
                "bytes_paged_in": 90_000 * MiB, "bytes_paged_out": 90_000 * MiB,
                "pressure_seconds": 12.5, "pressure_share": 0.012, "oom_recoveries": 1,
                "oom_retries": 1, "since_step": 8_000},
        predicted=[{"piece": "activation peak (layers + head/loss)", "measured": 2_000 * MiB,
                    "predicted": 2_100 * MiB}],
    )


def test_the_report_table_fits_100_columns_and_report_json_keeps_the_rest() -> None:
    report = _report()
    table = report.table()
    assert max(len(x) for x in table.split("\n")) <= WIDTH, table
    assert "optimizer-state spikes" not in table  # the pains: in report.json and report.md
    assert "optimizer-state spikes" in report.to_markdown() and "max_memory_allocated ..." \
        in report.to_markdown()
    assert "resumed at steps 4000, 8000" in table and "peak 71000.00 MiB" in table
    assert "since the resume at step 8000" in table and "12 evictions" in table
    assert "11 restores" in table and "1 steps retried" in table
    assert "device=64.00 MiB" in table  # detail bytes in MiB, as every figure printed
    assert "with the inputs offloaded +" in table and "chunked loss (64 chunks)" in table
    saved = json.loads(report.to_json())
    assert saved["run"]["peak_bytes"] == 71_000 * MiB and saved["paging"]["evictions"] == 12
    assert saved["pieces"][2]["detail"]["device"] == 64 * MiB  # bytes, not text

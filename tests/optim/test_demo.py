"""`tightfit demo`: runs, pages to disk, prints the traffic, agrees with torch AdamW."""

from __future__ import annotations

import argparse
import re

import pytest

from tightfit.optim import demo


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_demo_pages_and_reports(capsys) -> None:
    assert demo.run(_args("--hidden", "256", "--steps", "3", "--page-mib", "0.0625")) == 0
    out = capsys.readouterr().out
    assert "spill file" in out and "page faults" in out
    steps = re.findall(r"paged in\s+([\d.]+) MiB, out\s+([\d.]+) MiB", out)
    assert len(steps) == 3 and all(float(a) == float(b) > 0 for a, b in steps)
    assert "spill folder removed = True" in out


def test_demo_bad_option_is_an_error() -> None:
    with pytest.raises(ValueError, match="--resident"):
        demo.run(_args("--resident", "0"))

"""InterruptHold: SIGINT (and SIGTERM raised as an interrupt) recorded inside, delivered at safe
points and at exit, nested, and left alone where Python does not handle it or off the main
thread; the command line's exit codes for both."""

from __future__ import annotations

import signal
import threading

import pytest

from tightfit.integrity.interrupts import (
    Terminated,
    hold_interrupts,
    interrupt_signal,
    terminate_as_interrupt,
)


def test_a_signal_inside_waits_for_the_safe_point() -> None:
    reached = []
    with pytest.raises(KeyboardInterrupt), hold_interrupts() as hold:
        signal.raise_signal(signal.SIGINT)
        reached.append("after the signal")  # not interrupted here ...
        hold.deliver()  # ... but here
        reached.append("after the safe point")
    assert reached == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_signal_with_no_safe_point_comes_at_the_end_and_the_handler_is_restored() -> None:
    reached = []
    with pytest.raises(KeyboardInterrupt), hold_interrupts():
        signal.raise_signal(signal.SIGINT)
        reached.append("rest of the block")
    assert reached == ["rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with hold_interrupts() as hold:  # nothing pending: safe points and exit do nothing
        hold.deliver()


def test_holds_nest_and_the_outer_one_delivers() -> None:
    reached = []
    with pytest.raises(KeyboardInterrupt), hold_interrupts() as outer:
        with hold_interrupts():
            signal.raise_signal(signal.SIGINT)
        reached.append("inner block ended")  # handed to the outer hold, not raised
        outer.deliver()
        reached.append("after the outer safe point")
    assert reached == ["inner block ended"]


def test_a_custom_handler_is_called_at_the_safe_point_and_the_hold_goes_on() -> None:
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with hold_interrupts() as hold:
            signal.raise_signal(signal.SIGINT)
            assert calls == []
            hold.deliver()
            assert calls == [signal.SIGINT]
            signal.raise_signal(signal.SIGINT)  # still held after a handler that returned
            assert calls == [signal.SIGINT]
        assert calls == [signal.SIGINT, signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ignored_sigint_and_other_threads_are_left_alone() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with hold_interrupts():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    seen = []

    def worker() -> None:
        with hold_interrupts() as hold:  # signal.signal would raise off the main thread
            hold.deliver()
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler]


def test_sigterm_raises_as_an_interrupt_and_is_held_like_ctrl_c() -> None:
    """Issue 28 item 3: under terminate_as_interrupt SIGTERM takes Ctrl-C's path."""
    before = signal.getsignal(signal.SIGTERM)
    reached = []
    with terminate_as_interrupt():
        with pytest.raises(Terminated) as stopped, hold_interrupts() as hold:
            signal.raise_signal(signal.SIGTERM)
            reached.append("after the signal")  # held ...
            hold.deliver()  # ... to the safe point
            reached.append("after the safe point")
        assert reached == ["after the signal"]
        assert isinstance(stopped.value, KeyboardInterrupt)
        assert interrupt_signal(stopped.value) == signal.SIGTERM
        assert str(stopped.value) == "terminated (SIGTERM)"
        with pytest.raises(KeyboardInterrupt) as ctrl_c, hold_interrupts():  # both held, in order
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)
        assert interrupt_signal(ctrl_c.value) == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) == before  # restored
    with hold_interrupts():  # SIGTERM's default action (no Python handler): not touched
        assert signal.getsignal(signal.SIGTERM) == before


def test_the_command_line_exits_143_on_sigterm_and_130_on_ctrl_c(monkeypatch, capsys) -> None:
    import tightfit.cli as cli

    def stopped_by(sig: int):  # noqa: ANN202
        def run(args) -> int:  # noqa: ANN001
            signal.raise_signal(sig)
            return 0
        return run

    for sig, code, said in ((signal.SIGTERM, 143, "terminated (SIGTERM)"),
                            (signal.SIGINT, 130, "interrupted")):
        monkeypatch.setattr(cli, "build_parser", lambda command, sig=sig: _parser(stopped_by(sig)))
        assert cli.main(["export", "x"]) == code
        assert capsys.readouterr().err.strip() == f"tightfit export: {said}"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _parser(run):  # noqa: ANN001, ANN202
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("rest", nargs="*")
    parser.set_defaults(_run=run, verbose=0, quiet=False)
    return parser

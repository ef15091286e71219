"""wait_until, the poll loop the driver's waits share: what it returns, and what a timeout and a cancel do."""

import threading

import pytest

from verlflow.core.wait import wait_until

pytestmark = pytest.mark.unit


def test_returns_the_first_truthy_answer():
    answers = iter([None, [], "ready", "later"])
    assert wait_until(lambda: next(answers), interval_s=0.001) == "ready"
    assert next(answers) == "later"  # not asked again once ready


def test_timeout_asks_once_more_then_calls_on_timeout():
    calls = []

    def not_yet():
        calls.append(1)
        return False

    def too_long():
        raise TimeoutError("gave up")

    with pytest.raises(TimeoutError, match="gave up"):
        wait_until(not_yet, interval_s=0.001, timeout_s=0.0, on_timeout=too_long)
    assert calls == [1]
    assert wait_until(not_yet, interval_s=0.001, timeout_s=0.0) is None  # no on_timeout: None


def test_cancel_ends_the_wait_with_on_cancel():
    cancel = threading.Event()
    cancel.set()
    assert wait_until(lambda: False, interval_s=60, cancel=cancel, on_cancel=lambda: "stopped") == "stopped"
    assert wait_until(lambda: "done", interval_s=60, cancel=cancel) == "done"  # ready wins over a cancel


def test_a_cancel_during_the_pause_ends_it():
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    assert wait_until(lambda: False, interval_s=600, cancel=cancel, on_cancel=lambda: "stopped") == "stopped"

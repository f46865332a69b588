"""`run_warm`'s drain: a SIGINT while the engine drains its saves is recorded, not raised."""

from __future__ import annotations

import os
import signal
import threading

from hf3fsctl.offline.warm import _sigint_deferred


def test_a_sigint_during_the_drain_is_recorded_and_the_handler_restored() -> None:
    before = signal.getsignal(signal.SIGINT)
    with _sigint_deferred() as late:
        assert not late.received
        os.kill(os.getpid(), signal.SIGINT)  # delivered to this (the main) thread at once
        drained = True  # reached: no KeyboardInterrupt cut the block short
    assert drained and late.received
    assert signal.getsignal(signal.SIGINT) is before


def test_without_a_signal_nothing_is_recorded() -> None:
    with _sigint_deferred() as late:
        pass
    assert not late.received


def test_off_the_main_thread_signals_are_left_alone() -> None:
    seen: list[bool] = []

    def drain() -> None:
        with _sigint_deferred() as late:  # signal.signal would raise off the main thread
            seen.append(late.received)

    thread = threading.Thread(target=drain)
    thread.start()
    thread.join()
    assert seen == [False]

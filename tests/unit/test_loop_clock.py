"""loaderd/loop_clock.py: how busy the server loop was over the last window, and on what."""

from __future__ import annotations

import threading
import time

import pytest

from loaderd.loop_clock import WINDOW_S, LoopClock


def turn(clock: LoopClock, t: float, wait: float, requests: float, answers: float) -> float:
    """One loop turn from ``t``: a wait in the poll, then the phases; returns when it ends."""
    clock.polling(t)
    t += wait
    clock.polled(t)
    t += requests
    clock.mark("requests", t)
    t += answers
    clock.mark("assembled", t)
    return t


def test_busy_share_and_phases_over_a_window() -> None:
    clock = LoopClock(now=0.0)
    t = 0.0
    for _ in range(10):  # 25% waiting, then 50% requests, 25% answers
        t = turn(clock, t, wait=0.25, requests=0.5, answers=0.25)
    s = clock.stats(t)
    assert s["turns"] == 10 and s["window_s"] == 10.0
    assert s["busy_share"] == 0.75 and s["waited_s"] == 2.5 and s["busy_s"] == 7.5
    assert s["shares"] == {
        "requests": pytest.approx(2 / 3, abs=1e-3),
        "assembled": pytest.approx(1 / 3, abs=1e-3),
        "other": 0.0,
    }


def test_the_window_forgets_what_is_older_than_it() -> None:
    """A loop saturated for a long while, then idle: the window shows the idle part only."""
    clock = LoopClock(now=0.0)
    t = 0.0
    for _ in range(100):
        t = turn(clock, t, wait=0.0, requests=0.5, answers=0.5)  # busy
        clock.sample(t)
    assert clock.stats(t)["busy_share"] == 1.0
    for _ in range(30):
        t = turn(clock, t, wait=0.5, requests=0.0, answers=0.0)  # idle
        clock.sample(t)
    s = clock.stats(t)
    assert s["busy_share"] == 0.0 and WINDOW_S <= s["window_s"] <= WINDOW_S + 0.5
    assert s["busy_s"] == 100.0  # totals since the start stay, for a monitor's rates


def test_time_after_the_phases_is_other() -> None:
    """The tick, the cluster's turn and the autotuner run after the answers: ``other``."""
    clock = LoopClock(now=0.0)
    t = turn(clock, 0.0, wait=1.0, requests=0.0, answers=0.0)
    clock.polling(t + 1.0)  # a second of tick work before the next poll
    assert clock.stats(t + 1.0)["shares"]["other"] == 1.0


def test_no_time_yet() -> None:
    s = LoopClock(now=5.0).stats(5.0)
    assert s["busy_share"] is None and s["turns"] == 0


def test_the_share_of_the_window_the_loop_ran_on_a_core() -> None:
    """Busy but off a core: the loop's thread waited (for the GIL, or for a core)."""
    cpu = [0.0]
    clock = LoopClock(now=0.0, cpu=lambda: cpu[0])
    t = 0.0
    for _ in range(10):  # busy 75 % of each second, on a core 50 %
        t = turn(clock, t, wait=0.25, requests=0.5, answers=0.25)
        cpu[0] += 0.5
    s = clock.stats(t)
    assert s["busy_share"] == 0.75 and s["on_core_share"] == 0.5 and s["cpu_s"] == 5.0
    for _ in range(30):  # then idle: the window forgets the CPU too
        t = turn(clock, t, wait=0.5, requests=0.0, answers=0.0)
        clock.sample(t)
    assert clock.stats(t)["on_core_share"] == 0.0 and clock.stats(t)["cpu_s"] == 5.0


def test_the_loops_cpu_is_its_own_thread_read_from_any_thread() -> None:
    """By default the clock reads the CPU of the thread that made it, from any thread."""
    made: list[LoopClock] = []
    spun, done = threading.Event(), threading.Event()

    def loop() -> None:
        made.append(LoopClock())
        end = time.thread_time() + 0.2
        while time.thread_time() < end:  # 0.2 s of this thread's CPU
            pass
        spun.set()
        done.wait(10)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        assert spun.wait(10)
        end = time.thread_time() + 0.3
        while time.thread_time() < end:  # 0.3 s of this thread's: none of it the loop's
            pass
        assert 0.19 <= made[0].stats()["cpu_s"] < 0.28
    finally:
        done.set()
        thread.join()
    assert 0.19 <= made[0].stats()["cpu_s"] < 0.28  # the thread is gone: its last figure

"""batch_reindex forward: the measured choice between one thread and the split
(readerlib/kernels/_reindex.pyx, "the thread count, measured on the running machine")."""
import numpy as np
import pytest

from readerlib import _parallel
from readerlib.kernels import _reindex, batch_reindex

WINDOW = 8          # TUNE_WINDOW
EXPLORE = 8         # TUNE_EXPLORE
CACHED, STREAM = 0, 1


@pytest.fixture
def chooser():
    """A chooser with no history, every call of any size taking part; restored after."""
    _reindex._tune_reset()
    old_min = _reindex._set_tune_min_bytes(0)
    old_on = _reindex._set_tune(True)
    try:
        yield
    finally:
        _reindex._set_tune(old_on)
        _reindex._set_tune_min_bytes(old_min)
        _reindex._tune_reset()


def decisions(kind, n):
    return [_reindex._tune_choose_py(kind) for _ in range(n)]


def split_against_steady_one_thread(split_ns_per_mib, one_thread=150_000):
    """The streaming chooser's windows: the split's recent times as given, one
    thread steady (ns per MiB)."""
    for v in split_ns_per_mib:
        _reindex._tune_record_py(STREAM, 1, v)
    for _ in range(WINDOW):
        _reindex._tune_record_py(STREAM, 0, one_thread)


@pytest.mark.parametrize("kind", [CACHED, STREAM])
@pytest.mark.parametrize("faster", [0, 1])
def test_the_faster_mode_runs_and_the_other_is_explored(chooser, kind, faster):
    for _ in range(WINDOW):
        _reindex._tune_record_py(kind, faster, 100_000)
        _reindex._tune_record_py(kind, 1 - faster, 300_000)
    calls0 = _reindex._tune_state()[kind][0]
    got = decisions(kind, 4 * EXPLORE)
    explored = [i for i, m in enumerate(got) if m != faster]
    assert len(explored) == 4, got                       # one call in EXPLORE
    assert all((calls0 + i + 1) % EXPLORE == 0 for i in explored)


def test_a_split_that_loses_most_calls_does_not_run(chooser):
    # the split is faster undisturbed (best 50 us/MiB) but loses most calls to
    # scheduling (most calls 400): its lower quartile is 400; one thread is
    # steady at 150: one thread runs
    split_against_steady_one_thread((50_000, 400_000, 400_000, 420_000, 60_000, 450_000, 400_000, 410_000))
    assert decisions(STREAM, EXPLORE - 1).count(0) >= EXPLORE - 2


def test_a_change_of_load_is_followed(chooser):
    # the split was losing; then the machine calms down and every split
    # measured (the explored calls) is fast again: the chooser switches
    for _ in range(WINDOW):
        _reindex._tune_record_py(STREAM, 0, 200_000)
        _reindex._tune_record_py(STREAM, 1, 900_000)
    for _ in range(WINDOW * EXPLORE):
        mode = _reindex._tune_choose_py(STREAM)
        _reindex._tune_record_py(STREAM, mode, 100_000 if mode == 1 else 200_000)
    assert decisions(STREAM, EXPLORE - 1).count(1) >= EXPLORE - 2


def test_kinds_are_measured_apart(chooser):
    for _ in range(WINDOW):
        _reindex._tune_record_py(CACHED, 0, 100_000)
        _reindex._tune_record_py(CACHED, 1, 300_000)
        _reindex._tune_record_py(STREAM, 0, 300_000)
        _reindex._tune_record_py(STREAM, 1, 100_000)
    assert decisions(CACHED, EXPLORE - 1).count(0) >= EXPLORE - 2
    assert decisions(STREAM, EXPLORE - 1).count(1) >= EXPLORE - 2


def test_calls_feed_both_windows_and_results_do_not_depend_on_the_mode(chooser):
    rng = np.random.default_rng(7)
    for row_bytes, rows in [(256, 4000), (48, 3000), (8, 5000), (8192, 40)]:
        x = rng.integers(0, 256, (997, row_bytes), dtype=np.uint8)
        for i in range(2 * WINDOW):
            idx = rng.integers(0, 997, rows).astype(np.int32 if i % 2 else np.int64)
            # a split that lost (a loaded machine) makes the pool's next loops serial, and
            # a split-mode call run serially is no split sample: forget the losses first
            _parallel._reset_backoff()
            np.testing.assert_array_equal(batch_reindex(x, idx, num_threads=2), x[idx])
            out = np.full((rows, row_bytes), 7, np.uint8)
            _parallel._reset_backoff()
            batch_reindex(x, idx, out=out, num_threads=2)
            np.testing.assert_array_equal(out, x[idx])
    calls, one, split = _reindex._tune_state()[CACHED]
    assert calls == 4 * 2 * WINDOW * 2
    assert len(one) == WINDOW and len(split) == WINDOW
    assert all(v > 0 for v in one + split)


def samples():
    return sum(len(one) + len(split) for _, one, split in _reindex._tune_state().values())


def test_one_thread_small_and_failing_calls_do_not_take_part(chooser):
    _reindex._set_tune_min_bytes(1 << 20)
    big = np.zeros((5000, 256), np.uint8)                        # 1.2 MiB out
    batch_reindex(big, np.arange(5000), num_threads=1)
    batch_reindex(big[:100], np.arange(100), num_threads=2)      # 25 KiB: below the size
    with pytest.raises(IndexError):
        batch_reindex(big, np.r_[np.arange(4999), 5000], num_threads=2)
    assert samples() == 0
    batch_reindex(big, np.arange(5000), num_threads=2)
    assert samples() == 1


def test_switched_off_the_split_always_runs(chooser):
    _reindex._set_tune(False)
    x = np.zeros((5000, 256), np.uint8)
    for _ in range(4):
        batch_reindex(x, np.arange(5000), num_threads=2)
    assert all(calls == 0 for calls, _, _ in _reindex._tune_state().values())


def test_a_tie_goes_to_one_thread(chooser):
    # the split takes the second core only when it is faster (no margin)
    for _ in range(WINDOW):
        _reindex._tune_record_py(STREAM, 0, 100_000)
        _reindex._tune_record_py(STREAM, 1, 100_000)
    assert decisions(STREAM, EXPLORE - 1).count(0) >= EXPLORE - 2
    for _ in range(WINDOW):
        _reindex._tune_record_py(STREAM, 1, 95_000)
    assert decisions(STREAM, EXPLORE - 1).count(1) >= EXPLORE - 2


def test_the_lower_quartile_decides(chooser):
    # bimodal, as on a shared machine: one thread steady at 150 us/MiB.  A
    # split fast in 6 of 8 calls (lower quartile 60) runs; one fast in only
    # 2 of 8 (lower quartile 400) does not.
    split_against_steady_one_thread((60_000, 400_000, 60_000, 60_000, 400_000, 60_000, 60_000, 60_000))
    assert decisions(STREAM, EXPLORE - 1).count(1) >= EXPLORE - 2
    _reindex._tune_reset()
    split_against_steady_one_thread((60_000, 400_000, 400_000, 400_000, 400_000, 60_000, 400_000, 400_000))
    assert decisions(STREAM, EXPLORE - 1).count(0) >= EXPLORE - 2


def test_tune_rule_setting_is_clamped_and_restored():
    old = _reindex._set_tune_rule(150, -5)
    try:
        assert _reindex._set_tune_rule(50, 10) == (100, 0)
        assert _reindex._set_tune_rule(*old) == (50, 10)
    finally:
        _reindex._set_tune_rule(*old)
    assert old == (25, 0)

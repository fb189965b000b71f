"""Advice skipped while the page cache holds the store, and taken up again once it does not."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from loaderd.storage.residency import ResidencyProbe
from loaderd.storage.store import SampleStore
from tests.helpers import evict
from tests.unit.test_readahead import make_store


def cached_everywhere(path: Path) -> bool:
    """Whether dropping the file from the page cache works here (else the test cannot tell)."""
    evict(path)
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            base = np.frombuffer(m, np.uint8).ctypes.data
            probe = ResidencyProbe(base, every=1, trust=1)
            left = probe.resident(np.array([0]), np.array([size]))
            del base
        return not left
    finally:
        os.close(fd)


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    path = make_store(tmp_path / "s.db")
    if not cached_everywhere(path):
        pytest.skip("the page cache cannot be emptied here")
    return path


def read_all(path: Path) -> None:
    """The whole file into the page cache, without mapping it (an eviction can drop it)."""
    assert (path / "data.mdb").read_bytes()


def test_a_cached_store_is_probed_then_not_advised_and_an_evicted_one_is_again(
    store: Path,
) -> None:
    with SampleStore(store) as s:
        assert s.value_index is not None and s.prefaulting is not None
        read_all(store)  # every page in the page cache
        probe = s._residency
        assert probe is not None
        calls = [s.advise(np.arange(i, i + 4))[1] for i in range(8, 8 + 4 * 40, 4)]
        # Probes find everything resident: after `trust` of them, only one batch in `every`
        # is probed and none is advised.
        assert probe.probes <= 1 + 40 // probe.every + probe.trust
        assert s.advice_skipped >= 40 - probe.probes
        assert sum(calls) == 0
        evict(store)
        calls = [s.advise(np.arange(i, i + 4))[1] for i in range(8, 8 + 4 * 40, 4)]
        # The first probe after the eviction sees it: from then on every batch is advised.
        assert sum(c > 0 for c in calls) >= 40 - probe.every
        assert all(c > 0 for c in calls[probe.every :])


def test_a_cold_store_is_always_advised(store: Path) -> None:
    with SampleStore(store) as s:
        assert s.value_index is not None
        evict(store)
        calls = [s.advise(np.arange(i, i + 4))[1] for i in range(8, 8 + 4 * 20, 4)]
        assert all(c > 0 for c in calls)
        assert s.advice_skipped == 0


def test_probe_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="every"):
        ResidencyProbe(0, every=0)


def test_one_evicted_range_among_cached_ones_is_seen(tmp_path: Path) -> None:
    # The probe asks for every range of a batch into one vector: a range missing from the
    # page cache between cached ones must be found, whatever the lengths before it.
    path = tmp_path / "f"
    page = mmap.PAGESIZE
    path.write_bytes(os.urandom(64 * page))
    starts = np.array([0, 10 * page, 30 * page, 50 * page])
    lengths = np.array([3 * page + 5, 2 * page, 7 * page, 1])
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written just now: dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # a read takes its pages, no more
        for i in (0, 1, 3):  # the third range stays out
            assert os.preadv(fd, [bytearray(int(lengths[i]))], int(starts[i])) == lengths[i]
        with mmap.mmap(fd, 64 * page, prot=mmap.PROT_READ) as m:
            base = np.frombuffer(m, np.uint8).ctypes.data
            probe = ResidencyProbe(base, every=1, trust=1)
            if probe.resident(starts[2:3], lengths[2:3]):
                pytest.skip("the page cache cannot be emptied here")
            assert probe.resident(starts[[0, 1, 3]], lengths[[0, 1, 3]])
            assert not probe.resident(starts, lengths)
            assert not probe.resident(starts[2:], lengths[2:])
            del base
    finally:
        os.close(fd)

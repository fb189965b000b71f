"""The whole store brought into a locked map at start, in file order (``map_loader.py``)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from loaderd.storage.map_loader import MapLoader
from loaderd.storage.store import SampleStore
from loaderd.storage.tiers import TierStack
from tests.helpers import evict, wait_until
from tests.unit.test_cache_dram import big_store


def _rss_and_locked_kib(path: Path) -> tuple[int, int]:
    """KiB of ``path`` this process maps (``Rss``) and locks (``Locked``)."""
    rss = locked = 0
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split(" ", 1)[0]:  # a mapping's first line
            inside = line.endswith(str(path.resolve()))
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1])
        elif inside and line.startswith("Locked:"):
            locked += int(line.split()[1])
    return rss, locked


def _loaded(stack: TierStack) -> bool:
    load = stack.stats()["tiers"][0]["map_load"]
    return bool(load["loaded_bytes"] == load["total_bytes"])


def test_a_store_dram_can_hold_is_mapped_and_locked_whole_from_the_disk(tmp_path: Path) -> None:
    path, truth = big_store(tmp_path, 60, 40)
    evict(path)  # cold: the loader reads it, nobody else does
    store = SampleStore(path)
    with TierStack(store, store.file_bytes) as stack:
        if not store.map_locked:
            pytest.skip("this process may not lock the store's map (RLIMIT_MEMLOCK)")
        wait_until(lambda: _loaded(stack), what="the whole store mapped")
        wait_until(lambda: not stack.loading, what="the loader's end")
        assert stack.in_ram_whole  # loaded: nothing left for a read-ahead
        rss, locked = _rss_and_locked_kib(path / "data.mdb")
        size = store.file_bytes
        assert rss * 1024 >= size and locked * 1024 >= size  # every page, held by the lock
        load = stack.stats()["tiers"][0]["map_load"]
        assert load["error"] is None and load["total_bytes"] >= size
        assert stack.get_many(np.arange(60)) == truth  # the store's bytes


@pytest.mark.parametrize("why", ["too small", "off"])
def test_nothing_is_brought_in_where_dram_cannot_hold_the_store_or_it_is_off(
    tmp_path: Path, why: str
) -> None:
    path, truth = big_store(tmp_path, 60, 40)
    store = SampleStore(path)
    dram = store.file_bytes // 2 if why == "too small" else store.file_bytes
    with TierStack(store, dram, load_map=why != "off") as stack:
        assert "map_load" not in stack.stats()["tiers"][0]
        assert stack.get_many(np.arange(5)) == truth[:5]
        rss, _ = _rss_and_locked_kib(path / "data.mdb")
        assert rss * 1024 < store.file_bytes // 2  # what the reads mapped, not the whole file


def test_a_range_the_kernel_refuses_ends_the_loader_with_its_reason(tmp_path: Path) -> None:
    page = mmap.PAGESIZE
    f = tmp_path / "f"
    f.write_bytes(b"x" * page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(f, os.O_RDONLY)
    # Two pages of a one-page file: the second lies past its end, which no read can map.
    base = libc.mmap(None, 2 * page, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    try:
        assert base not in (None, ctypes.c_void_p(-1).value)
        loader = MapLoader(base, 2 * page, label="test", chunk_bytes=page)
        wait_until(lambda: loader.error is not None or loader.done)
        loader.close()
        loader.close()  # twice is safe
        assert loader.error is not None and not loader.done
        assert loader.stats()["loaded_bytes"] == page
    finally:
        libc.munmap(base, 2 * page)
        os.close(fd)


def test_a_chunk_must_be_whole_pages() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        MapLoader(0, 1, label="test", chunk_bytes=mmap.PAGESIZE + 1)


def test_records_of_a_map_mapped_whole_are_held_with_no_system_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, truth = big_store(tmp_path, 20, 40)
    store = SampleStore(path)
    with TierStack(store, store.file_bytes) as stack:
        if not store.map_locked:
            pytest.skip("this process may not lock the store's map (RLIMIT_MEMLOCK)")
        wait_until(lambda: store.map_resident, what="the whole store mapped")
        calls: list[int] = []
        monkeypatch.setattr(
            "loaderd.storage.store.populate_read", lambda a, n: calls.append(len(a)) or (1, 0)
        )
        with store.views(np.arange(20)) as views:
            unpins = store.pin_many(views)
        assert all(u is not None for u in unpins) and calls == []
        assert stack.get_many(np.arange(20)) == truth
    with SampleStore(path) as cold, TierStack(cold, cold.file_bytes, load_map=False):
        assert not cold.map_resident
        with cold.views(np.arange(20)) as views:
            cold.pin_many(views)
        assert calls == [20]  # without the loader, the pages are mapped record by record


def test_reads_of_a_map_mapped_whole_ask_the_kernel_to_read_nothing_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's ranges asked for with ``WILLNEED`` (``advise_known``) walk the page cache
    in the serving loop: a third of its time in a warm-miss epoch once all was in RAM."""
    path, truth = big_store(tmp_path, 20, 40)
    asked: list[int] = []
    real = os.posix_fadvise
    monkeypatch.setattr(
        os, "posix_fadvise", lambda fd, o, n, a: asked.append(n) or real(fd, o, n, a)
    )
    for load in (True, False):
        store = SampleStore(path)
        with TierStack(store, store.file_bytes, load_map=load) as stack:
            if not store.map_locked:
                pytest.skip("this process may not lock the store's map (RLIMIT_MEMLOCK)")
            assert store.value_index is not None
            if load:
                wait_until(lambda s=store: s.map_resident, what="the whole store mapped")
            asked.clear()
            assert stack.get_many(np.arange(20)) == truth
            assert (asked == []) == load  # without the loader the batch's reads are asked for


def test_records_of_a_map_mapped_whole_are_admitted_by_the_read_not_queued(
    tmp_path: Path,
) -> None:
    """Holding a record of a mapped map costs no system call: less than waking the
    admission queue's thread, which then took the GIL from the serving loop every batch."""
    path, truth = big_store(tmp_path, 20, 40)
    for load in (True, False):
        store = SampleStore(path)
        with TierStack(store, store.file_bytes, load_map=load, admit_queue_bytes=8 << 20) as stack:
            if not store.map_locked:
                pytest.skip("this process may not lock the store's map (RLIMIT_MEMLOCK)")
            if load:
                wait_until(lambda s=store: s.map_resident, what="the whole store mapped")
            assert stack.get_many(np.arange(20)) == truth
            assert stack.settle()
            dram = stack.stats()["tiers"][0]
            assert dram["items"] == 20
            assert dram["admitted_late"] == (0 if load else 20)


def test_a_store_larger_than_the_memory_available_is_not_brought_in_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A DRAM budget larger than the machine must not lock the machine's memory at start.
    path, truth = big_store(tmp_path, 20, 40)
    store = SampleStore(path)
    monkeypatch.setattr("loaderd.storage.tiers.memory_available", lambda: store.file_bytes)
    with caplog.at_level("INFO"), TierStack(store, 4 * store.file_bytes) as stack:
        assert "map_load" not in stack.stats()["tiers"][0]
        assert not stack.loading and not stack.in_ram_whole
        assert "more than the memory available" in caplog.text
        assert stack.get_many(np.arange(20)) == truth

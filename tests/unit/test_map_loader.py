"""The whole store brought into RAM at start, in file order (``map_loader.py``): a locked
map, or, where the process may not lock, a map made memory of its own."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from loaderd.launch import as_ordinary_user
from loaderd.storage.map_loader import MapLoader
from loaderd.storage.store import SampleStore
from loaderd.storage.syscalls import _read_into_fresh, move_over, private_copy
from loaderd.storage.tiers import TierStack
from tests.helpers import evict, mapped_kib, wait_until
from tests.unit.test_cache_dram import big_store

ROOT = Path(__file__).resolve().parents[2]


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
        rss, locked = mapped_kib(path / "data.mdb", "Rss", "Locked")
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
        rss, _ = mapped_kib(path / "data.mdb", "Rss", "Locked")
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


def test_a_file_maps_pages_are_replaced_by_a_copy_of_its_bytes(tmp_path: Path) -> None:
    page = mmap.PAGESIZE
    f = tmp_path / "f"
    data = np.random.default_rng(1).bytes(3 * page + 100)  # a partial last page
    f.write_bytes(data)
    fd = os.open(f, os.O_RDONLY)
    m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    view = np.frombuffer(m, np.uint8)
    base = view.ctypes.data
    length = 4 * page
    try:
        with pytest.raises(OSError, match="Bad file descriptor"):
            private_copy(length, -1, 0)
        assert bytes(view) == data and mapped_kib(f, "Anonymous") == (0,)  # the map as it was
        move_over(private_copy(length, fd, 0), length, base)
        own = mapped_kib(f, "Rss", "Anonymous")
        assert own == (4 * page >> 10,) * 2  # every page the process's own now
        assert bytes(view) == data  # at the same addresses, the same bytes
        past = (ctypes.c_char * (length - len(data))).from_address(base + len(data))
        assert bytes(past) == b"\0" * (length - len(data))  # past the end, as in the map
        # Where the kernel cannot populate a private map (before 5.14), the file is read into
        # fresh memory instead: the same bytes, zeros past the end.
        fresh = _read_into_fresh(length, fd, 0)
        assert ctypes.string_at(fresh, length) == data + b"\0" * (length - len(data))
    finally:
        os.close(fd)
        del view
        m.close()


def test_a_store_owned_whole_reads_its_bytes_while_the_copy_is_under_way(tmp_path: Path) -> None:
    # A chunk of pages at a time, while another thread reads every record through LMDB:
    # before its chunk is copied and after, each read is the store's bytes.
    path, truth = big_store(tmp_path, 60, 40)
    store = SampleStore(path)
    try:
        assert store.own_map() and store.map_owned and not store.map_locked
        span = store.held_range
        assert span is not None
        bad: list[int] = []
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                got = store.get_many(range(60))
                bad.extend(i for i, (a, b) in enumerate(zip(got, truth, strict=True)) if a != b)

        reader = threading.Thread(target=read)
        reader.start()
        loader = MapLoader(
            span[0],
            span[1] - span[0],
            label="test",
            chunk_bytes=4 * mmap.PAGESIZE,
            on_done=store.map_loaded,
            copy_from=path / "data.mdb",
        )
        wait_until(lambda: not loader.running, what="the copy's end")
        stop.set()
        reader.join()
        assert loader.done and loader.error is None and store.map_resident
        assert bad == []
        rss, own = mapped_kib(path / "data.mdb", "Rss", "Anonymous")
        assert own == rss and own << 10 >= store.file_bytes  # all of it the process's own
        assert store.get_many(range(60)) == truth
    finally:
        store.close()


def test_a_copy_closed_part_way_moves_nothing_more_and_counts_what_it_moved(
    tmp_path: Path,
) -> None:
    # After ``close`` the store's map may go away and its addresses be mapped again: no
    # chunk may be moved there. What was moved is what the loader says it loaded.
    path, truth = big_store(tmp_path, 200, 200)  # 10,000 chunks of a page: closed part way
    store = SampleStore(path)
    try:
        store.own_map()
        span = store.held_range
        assert span is not None
        loader = MapLoader(
            span[0],
            span[1] - span[0],
            label="test",
            chunk_bytes=mmap.PAGESIZE,
            on_done=store.map_loaded,
            copy_from=path / "data.mdb",
        )
        wait_until(lambda: loader.loaded_bytes > 0, what="a first chunk")
        loader.close()
        moved = mapped_kib(path / "data.mdb", "Anonymous")[0] << 10
        assert 0 < moved == loader.loaded_bytes < loader.length and not store.map_resident
        time.sleep(0.05)
        assert mapped_kib(path / "data.mdb", "Anonymous")[0] << 10 == moved  # none after ``close``
        assert loader.error is None
        assert store.get_many(range(200)) == truth  # copied or not, the store's bytes
    finally:
        store.close()


def test_a_daemon_that_may_not_lock_owns_the_store_whole_where_dram_can_hold_it(
    tmp_path: Path,
) -> None:
    # A real refusal: a child process that may lock no more than an ordinary user.
    under = as_ordinary_user(64 << 10)  # less than the store: its map cannot be locked
    if under is None:
        pytest.skip("prlimit or setpriv is missing")
    path, truth = big_store(tmp_path, 30, 40)
    script = f"""
import numpy as np, sys
from loaderd.storage.store import SampleStore
from loaderd.storage.syscalls import _read_into_fresh, move_over, private_copy
from loaderd.storage.tiers import TierStack
from tests.helpers import wait_until
store = SampleStore({str(path)!r})
with TierStack(store, store.file_bytes) as stack:
    assert not store.map_locked and store.map_owned
    wait_until(lambda: store.map_resident, what="the store copied whole")
    got = stack.get_many(np.arange(30))
    dram = stack.stats()["tiers"][0]
    assert dram["map_owned"] and dram["pinned"] == 30 and dram["map_load"]["error"] is None
    assert stack.in_ram_whole
    sys.stdout.buffer.write(b"".join(got))
"""
    done = subprocess.run(
        [*under, sys.executable, "-c", script], capture_output=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout == b"".join(truth)


def test_where_the_memory_available_is_short_a_store_is_not_owned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the loader makes an owned map hold anything: without one, records are held
    # one by one (locked, or copied), as where DRAM cannot hold the store.
    path, truth = big_store(tmp_path, 20, 40)
    store = SampleStore(path)
    monkeypatch.setattr(store, "lock_map", lambda: False)  # as the kernel refuses it
    monkeypatch.setattr("loaderd.storage.tiers.memory_available", lambda: store.file_bytes)
    with TierStack(store, 4 * store.file_bytes) as stack:
        assert not store.map_owned and store.held_range is None and not stack.loading
        assert stack.get_many(np.arange(20)) == truth
        assert not stack.stats()["tiers"][0]["map_owned"]

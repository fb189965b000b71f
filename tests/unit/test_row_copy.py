"""The compiled row copy: built by the install, and the same rows as the Python copy."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from loaderd import row_copy
from loaderd.prefetch import gather_rows


def python_rows(records: list[bytes], offset: int, width: int) -> bytes:
    return b"".join(r[offset : offset + width] for r in records)


def test_the_install_builds_the_compiled_copy() -> None:
    assert row_copy.AVAILABLE, "loaderd/gather_rows.c was not built (is gcc there?)"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 9])
@pytest.mark.parametrize("fields", [[(16, 8)], [(3, 4077), (4080, 19)], [(0, 200)]])
def test_every_split_and_store_kind_copies_the_same_rows(
    stream: bool, threads: int, n: int, fields: list[tuple[int, int]]
) -> None:
    lib = row_copy._LIB
    assert lib is not None
    size = max(offset + width for offset, width in fields) + 1
    rng = np.random.default_rng(n * 31 + size)
    records = [rng.bytes(size) for _ in range(n)]
    sources = np.array([np.frombuffer(r, np.uint8).ctypes.data for r in records], np.uint64)
    # Destinations off their alignment (streaming stores need 16), with guards around them.
    dsts = [np.zeros(n * width + 64, np.uint8) for _, width in fields]
    outs = np.array(
        [(d.ctypes.data + 1, off, w) for d, (off, w) in zip(dsts, fields, strict=True)], np.uint64
    )
    started = lib.loaderd_gather_rows(
        sources.ctypes.data, n, outs.ctypes.data, len(fields), threads, stream
    )
    for d, (offset, width) in zip(dsts, fields, strict=True):
        assert d[1 : 1 + n * width].tobytes() == python_rows(records, offset, width)
        assert d[0] == 0 and not d[1 + n * width :].any()  # nothing written around the rows
    assert 1 <= started <= max(1, min(threads, n))


def test_a_batch_of_views_of_a_read_only_map_is_gathered_like_bytes(tmp_path: Path) -> None:
    size, n = 150_000, 24  # 3.6 MB: streamed, on more than one thread where there are cores
    rng = np.random.default_rng(3)
    blob = rng.bytes(size * n + 4096)
    (tmp_path / "data").write_bytes(blob)
    with open(tmp_path / "data", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        whole = memoryview(m)
        starts = rng.permutation(n) * size + 7
        records = [whole[a : a + size] for a in starts.tolist()]
        frames = [memoryview(bytearray(n * (size - 100))), memoryview(bytearray(n * 8))]
        assert row_copy.gather(records, [(frames[0], 100, size - 100), (frames[1], 0, 8)])
        want = [bytes(r) for r in records]
        assert bytes(frames[0]) == python_rows(want, 100, size - 100)
        assert bytes(frames[1]) == python_rows(want, 0, 8)
        del records, whole


def test_a_frame_that_does_not_fit_is_refused_and_left_untouched() -> None:
    records = [bytes([i]) * 40 for i in range(4)]
    short = memoryview(bytearray(4 * 30 - 1))
    with pytest.raises(ValueError, match=r"rows \[10, 40\) of 4 records"):
        row_copy.gather(records, [(short, 10, 30)])
    assert not any(short)
    with pytest.raises(ValueError, match=r"shortest 40 B"):
        row_copy.gather(records, [(memoryview(bytearray(4 * 30)), 11, 30)])  # past a record
    with pytest.raises(ValueError, match="writable"):
        row_copy.gather(records, [(memoryview(bytes(4 * 30)), 10, 30)])


def test_records_given_by_address_are_gathered_and_checked_the_same() -> None:
    records = [bytes(range(i, i + 50)) for i in range(5)]
    arrays = [np.frombuffer(r, np.uint8) for r in records]
    at = np.array([a.ctypes.data for a in arrays[::-1]], np.uint64)
    out = memoryview(bytearray(5 * 20))
    row_copy.gather_at(at, 50, [(out, 30, 20)])
    assert bytes(out) == python_rows(records[::-1], 30, 20)
    untouched = memoryview(bytearray(5 * 20))
    with pytest.raises(ValueError, match=r"shortest 49 B"):  # a row past the shortest record
        row_copy.gather_at(at, 49, [(untouched, 30, 20)])
    assert not any(untouched)


def test_without_the_library_rows_are_copied_from_python(monkeypatch: pytest.MonkeyPatch) -> None:
    records = [bytes(range(i, i + 200)) * 100 for i in range(3)]  # 20 KB: past the join
    monkeypatch.setattr(row_copy, "_LIB", None)
    assert not row_copy.gather(records, [(memoryview(bytearray(3 * 100)), 0, 100)])
    out = memoryview(bytearray(3 * 19_000))
    gather_rows(records, [(out, 500, 19_000)])
    assert bytes(out) == python_rows(records, 500, 19_000)

"""What loaderd is measured against: the disk, memcpy, a DataLoader over LMDB, MosaicML Streaming.

Every function returns samples per second. ``evict`` empties the page cache of a file
(``posix_fadvise(DONTNEED)``), which works only for pages no process maps: callers stop their
daemons and close their LMDB environments first, and ``resident`` says what is left.
"""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import os
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

BATCH = 64
_libc = ctypes.CDLL(None, use_errno=True)


# --- the page cache ----------------------------------------------------------------------------


def evict(paths: Iterable[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            # Dirty pages (a store just written) are not dropped: write them back first, or a
            # "cold" read of a fresh store is served from the page cache.
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def evict_all(path: Path, timeout_s: float = 10.0) -> None:
    """``evict`` until the file is out of the page cache (1 % left at most) or ``timeout_s``.

    A daemon stopped just before may leave its miss workers a moment, mapping pages that
    eviction then skips.
    """
    deadline = time.monotonic() + timeout_s
    evict([path])
    while resident([path]) > 0.01 and time.monotonic() < deadline:
        time.sleep(0.2)
        evict([path])


def resident(paths: Iterable[Path]) -> float:
    """Share of the files' pages in the page cache (mincore)."""
    have = total = 0
    for p in paths:
        size = p.stat().st_size
        if not size:
            continue
        with open(p, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            addr = np.frombuffer(mm, np.uint8).ctypes.data
            if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                return float("nan")
            have += sum(v & 1 for v in vec)
            total += pages
    return have / total if total else 0.0


def warm(paths: Iterable[Path]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


# A process that maps the files and locks them in RAM until its stdin closes.
_HOLDER = """
import ctypes, mmap, os, sys
import numpy as np
libc = ctypes.CDLL(None, use_errno=True)
held, ok = [], True
for p in sys.argv[1:]:
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            held.append(np.frombuffer(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ), np.uint8))
for a in held:
    ok = ok and libc.mlock(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(a.nbytes)) == 0
print("locked" if ok else "not locked", flush=True)
sys.stdin.read()
"""


@contextmanager
def held_in_cache(paths: Iterable[Path]) -> Iterator[bool]:
    """Keep the files in the page cache while the block runs; yields whether they are locked.

    On the VM these numbers come from, the host takes back the page cache of files nobody
    maps at tens of MB/s (a 2 GB store read whole was 41 % cached 30 s later), so a "warm"
    row that runs for seconds runs partly cold, and the more so the later it runs. A warm
    row is measured with the files read and locked by a helper process (its own map, so no
    loader's memory counts them); where it may not lock them they are read again before.
    """
    paths = [Path(p) for p in paths]
    warm(paths)
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, *map(str, paths)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        locked = proc.stdout.readline().strip() == "locked"
        if not locked:
            warnings.warn(
                "cannot lock the store in the page cache: warm rows may decay", stacklevel=2
            )
        yield locked
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=30)


# --- bounds ------------------------------------------------------------------------------------


def memcpy_bound(nbytes: int = 256 << 20, runs: int = 5) -> float:
    """Bytes per second of one core copying into memory already touched."""
    src = np.ones(nbytes, np.uint8)
    dst = np.ones(nbytes, np.uint8)
    best = 0.0
    for _ in range(runs):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, nbytes / (time.perf_counter() - t0))
    return best


def disk_bound(db: Path, threads: int = 32) -> tuple[float, float]:
    """(samples/s, bytes/s) of ``threads`` threads pread-ing every record, cold, in random order."""
    from loaderd.storage.store import SampleStore

    with SampleStore(db) as s:
        index = s.value_index
        n = s.num_samples
    assert index is not None, "the benchmark's store must have a value index"
    order = np.random.default_rng(7).permutation(n)
    path = db / "data.mdb"
    evict([path])
    fd = os.open(path, os.O_RDONLY)
    try:

        def read(part: np.ndarray) -> int:
            return sum(
                len(os.pread(fd, int(index.lengths[i]), int(index.offsets[i]))) for i in part
            )

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            nbytes = sum(ex.map(read, [order[i::threads] for i in range(threads)]))
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return n / dt, nbytes / dt


def sequential_bound(db: Path) -> tuple[float, float]:
    """(samples/s, bytes/s) of the whole file read in order, cold: the disk's best.

    Read as the daemon's ``MapLoader`` reads a store DRAM can hold (``map_loader.py``: a map
    populated 64 MiB at a time under ``MADV_SEQUENTIAL``), which on the VM measured beat
    ``read()`` of 8 MiB blocks. The pages are evicted again afterwards.
    """
    from loaderd.storage.map_loader import MapLoader
    from loaderd.storage.store import SampleStore

    with SampleStore(db) as s:
        n = s.num_samples
    path = db / "data.mdb"
    evict([path])
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        view = np.frombuffer(mm, np.uint8)
        t0 = time.perf_counter()
        loader = MapLoader(view.ctypes.data, size - size % mmap.PAGESIZE, label="bound")
        while loader.running:
            time.sleep(0.002)
        dt = time.perf_counter() - t0
        assert loader.done, loader.error
        del view
    evict([path])
    return n / dt, size / dt


# --- a DataLoader over the same LMDB -----------------------------------------------------------


class LmdbMapDataset:
    """The usual recipe: env opened lazily per worker, frombuffer + clone, default collate."""

    def __init__(self, db: Path, transform: Callable[[dict[str, Any]], Any] | None = None) -> None:
        from loaderd.storage.store import SampleStore

        with SampleStore(db) as s:
            self.n = s.num_samples
            self.fields = [
                (f.name, f.dtype, f.shape, f.offset, f.nbytes) for f in s.schema.layout.fixed
            ]
        self.db = db
        self.transform = transform  # per sample, in the worker
        self.env: Any = None
        self.txn: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        import lmdb
        import torch

        if self.env is None:  # opened in the worker, never across a fork
            self.env = lmdb.open(str(self.db), readonly=True, lock=False, max_dbs=2)
            self.sub = self.env.open_db(b"samples", create=False)
            self.txn = self.env.begin(db=self.sub, buffers=True)
        raw = self.txn.get(int(i).to_bytes(8, "big"))
        out: dict[str, Any] = {}
        for name, dtype, shape, off, nbytes in self.fields:
            t = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes, offset=off).clone()
            out[name] = t.view(getattr(torch, dtype)).reshape(shape)
        return out if self.transform is None else self.transform(out)

    def close(self) -> None:
        if self.env is not None:
            self.txn.abort()
            self.env.close()
            self.env = self.txn = None


def epochs_of(
    loader: Any, epochs: int, key: str | int, after_first: Callable[[], object] | None = None
) -> list[float]:
    """Samples/s of each epoch, timed from its first batch (worker start-up is not counted).

    ``after_first`` runs between the first epoch and the others (the warm ones).
    """
    rates = []
    for e in range(epochs):
        if e == 1 and after_first is not None:
            after_first()
        it = iter(loader)
        first = next(it)
        t0 = time.perf_counter()
        n = sum(len(b[key]) for b in it)
        rates.append(n / (time.perf_counter() - t0) if n else float("nan"))
        del first
    return rates


def dataloader(
    db: Path,
    workers: int,
    epochs: int,
    cold: bool,
    transform: Callable[[dict[str, Any]], Any] | None = None,
) -> dict[str, float]:
    """{"cold": first epoch after eviction (if ``cold``), "warm": best later epoch}.

    ``transform``: applied to each sample in the worker, before the default collate.
    """
    from torch.utils.data import DataLoader

    if cold:
        evict([db / "data.mdb"])
        left = resident([db / "data.mdb"])
        if left > 0.05:
            warnings.warn(f"{left:.0%} of the store is still in the page cache", stacklevel=1)
    ds = LmdbMapDataset(db, transform)
    with warnings.catch_warnings(), ExitStack() as warm_rows:
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        loader = DataLoader(
            ds, batch_size=BATCH, shuffle=True, num_workers=workers, persistent_workers=workers > 0
        )
        hold = partial(warm_rows.enter_context, held_in_cache([db / "data.mdb"]))
        rates = epochs_of(loader, epochs + 1, "label", after_first=hold)
        del loader
    ds.close()
    return {"cold": rates[0], "warm": max(rates[1:])}


# --- MosaicML Streaming over local MDS shards --------------------------------------------------


def _streaming() -> Any:
    """``streaming.base``, without the package's __init__.

    Streaming's package imports its vision module, hence torchvision, for which there is no
    build matching the pinned CPU torch here; the base package (writer, dataset) needs neither.
    """
    if "streaming.base" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("mosaicml-streaming is not installed (make bench-throughput)")
        pkg = types.ModuleType("streaming")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = pkg
    import streaming.base as base

    return base


def streaming_available() -> bool:
    try:
        _streaming()
    except Exception:
        return False
    return True


def write_mds(db: Path, out: Path) -> Path:
    """The store's samples as MDS shards (once): ``image`` bytes and ``label`` int."""
    if (out / "index.json").exists():
        return out
    from loaderd.storage.records import RecordCodec
    from loaderd.storage.store import SampleStore

    base = _streaming()
    tmp = out.with_name(out.name + ".tmp")
    with SampleStore(db) as s:
        codec = RecordCodec(s.schema)
        columns = {"image": "bytes", "label": "int64"}
        with base.MDSWriter(out=str(tmp), columns=columns, size_limit=1 << 26) as w:
            for lo in range(0, s.num_samples, 1024):
                ids = list(range(lo, min(s.num_samples, lo + 1024)))
                for sid, rec in zip(ids, s.get_many(ids), strict=True):
                    f = codec.decode(rec, sid, "bench")
                    w.write({"image": f["image"].tobytes(), "label": int(f["label"])})
    tmp.rename(out)
    return out


def streaming_rates(mds: Path, workers: int, epochs: int) -> dict[str, float]:
    """{"cold": first epoch after eviction, "warm": best later epoch} of a StreamingDataset."""
    import torch
    from torch.utils.data import DataLoader

    base = _streaming()
    base.util.clean_stale_shared_memory()
    evict(p for p in mds.iterdir() if p.suffix == ".mds")

    class Dataset(base.StreamingDataset):  # type: ignore[misc, name-defined]
        def __getitem__(self, i: int) -> dict[str, Any]:
            s = super().__getitem__(i)
            return {
                "image": torch.frombuffer(bytearray(s["image"]), dtype=torch.uint8),
                "label": torch.tensor(s["label"]),
            }

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = Dataset(local=str(mds), shuffle=True, batch_size=BATCH, shuffle_seed=1)
        loader = DataLoader(ds, batch_size=BATCH, num_workers=workers, persistent_workers=False)
        with ExitStack() as warm_rows:
            shards = [p for p in mds.iterdir() if p.suffix == ".mds"]
            hold = partial(warm_rows.enter_context, held_in_cache(shards))
            rates = epochs_of(loader, epochs + 1, "label", after_first=hold)
        del loader, ds
    return {"cold": rates[0], "warm": max(rates[1:])}


# --- where the time goes -----------------------------------------------------------------------


def top_frames(raw: Path, k: int = 12) -> list[tuple[float, str]]:
    """The frames most often on the stack in a py-spy raw profile (share of busy samples)."""
    counts: dict[str, int] = {}
    total = 0
    idle = ("wait (threading", "poll (zmq", "_wait_for_tstate_lock", "select (", "Condition.wait")
    try:
        lines = raw.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not n.isdigit() or any(s in stack for s in idle):
            continue
        total += int(n)
        for frame in set(stack.split(";")):
            counts[frame] = counts.get(frame, 0) + int(n)
    skip = ("threading.py", "<module>", "runpy", "thread.py", "cli.py", "__main__", "bench_")
    ranked = sorted(
        ((c / total, f) for f, c in counts.items() if not any(s in f for s in skip)), reverse=True
    )
    return ranked[:k] if total else []

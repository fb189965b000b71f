"""A record's xxh3-64, computed without letting go of the GIL.

python-xxhash lets go of the GIL while it hashes. A thread that lets go must win it back, and
while another thread runs Python (the daemon's server loop, the other assembler, the
read-ahead) that takes up to the switch interval: measured here, a 100 KB record took 700 us
to hash beside a thread running Python, against 10 us of CPU; once per record of a batch,
that wait was a large part of the miss path (python-xxhash lets go above 64 KiB only). So
the hash is called through ``ctypes.PyDLL``, which keeps the GIL, from the xxHash library
python-xxhash is built with (the function ``xxh3_64_intdigest`` calls, with the CPU's widest
vectors). Where that library does not export it, the module's function is used as before.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence

import numpy as np
import xxhash
import xxhash._xxhash

from loaderd.storage.syscalls import address_of

logger = logging.getLogger(__name__)


def _keeping_gil() -> Callable[[int, int, int], int] | None:
    try:
        lib = ctypes.PyDLL(xxhash._xxhash.__file__)
        fn = lib.XXH3_64bits_withSeed_dispatch
    except (OSError, AttributeError):
        logger.info("xxHash's XXH3_64bits is not exported: records are hashed by python-xxhash")
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
    fn.restype = ctypes.c_uint64
    probe = np.arange(1000, dtype=np.uint8)
    for seed in (0, 12345):
        if fn(probe.ctypes.data, probe.nbytes, seed) != xxhash.xxh3_64_intdigest(
            probe.tobytes(), seed
        ):
            logger.info("xxHash's XXH3_64bits disagrees with python-xxhash: not used")
            return None
    return fn


_XXH3 = _keeping_gil()


# python-xxhash lets go of the GIL above this many bytes (measured: 64 KiB hashed in 1.3 us
# beside a thread running Python, 64 KiB + 1 in 880 us). Below it, its own call is cheaper
# than finding the buffer's address for ours.
_LETS_GO_ABOVE = 64 << 10


def xxh3_64(data: bytes | bytearray | memoryview, seed: int = 0) -> int:
    """The xxh3-64 of ``data`` with ``seed``, as ``xxhash.xxh3_64_intdigest``, the GIL held."""
    if _XXH3 is None or len(data) <= _LETS_GO_ABOVE:
        return xxhash.xxh3_64_intdigest(data, seed)
    return int(_XXH3(address_of(memoryview(data)), len(data), seed))


def xxh3_64_all(data: Sequence[bytes | memoryview], seeds: Sequence[int]) -> np.ndarray:
    """``xxh3_64`` of each buffer with its seed, as uint64: one C call per buffer."""
    if max(map(len, data), default=0) <= _LETS_GO_ABOVE:
        return np.fromiter(map(xxhash.xxh3_64_intdigest, data, seeds), np.uint64, len(data))
    return np.fromiter(map(xxh3_64, data, seeds), np.uint64, len(data))

"""A feedback journal whose disk refuses a write: cut back to the last whole entry, never torn.

The refusal is real: the appending process runs under RLIMIT_FSIZE, so the kernel fails the
write (EFBIG) the way a full disk fails it (ENOSPC), on any machine and without root.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loaderd.journal import FeedbackJournal

_APPEND_UNTIL_REFUSED = """
import resource, signal, sys
from pathlib import Path
import numpy as np
from loaderd.journal import FeedbackJournal, JournalWriteError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
j = FeedbackJournal(Path(sys.argv[1]))
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
ok = 0
try:
    for e in range(1000):
        j.append(e, "train", np.arange(50), np.full(50, e, np.float32))
        j.sync()
        ok += 1
except JournalWriteError as err:
    print(ok, err)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
j.append(ok, "train", np.arange(50), np.full(50, ok, np.float32))  # space is back
j.close()
"""


@pytest.mark.parametrize("limit", [4096, 4096 + 300])
def test_refused_append_leaves_no_torn_entry_and_later_ones_replay(
    tmp_path: Path, limit: int
) -> None:
    path = tmp_path / "feedback.log"
    out = subprocess.run(
        [sys.executable, "-c", _APPEND_UNTIL_REFUSED, str(path), str(limit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    ok, message = out.stdout.split(" ", 1)
    assert "cannot journal feedback in" in message and str(path) in message
    entries = list(FeedbackJournal.replay(path))
    # Every synced entry, then the one appended after the refusal: nothing torn between.
    assert [e.epoch for e in entries] == list(range(int(ok) + 1))
    assert all(np.all(e.losses == e.epoch) for e in entries)
    assert not list(tmp_path.glob("*.damaged-*"))

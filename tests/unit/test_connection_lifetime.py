"""A Connection nobody closed still closes its sockets, whatever order the collector picks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Run in a child: before the fix, the collector finalized the context before its sockets and
# the child hung in ``term()``. Warnings are errors there, and the collector's are printed.
DROPPED_IN_A_CYCLE = """
import gc, os, sys, warnings
warnings.simplefilter("error")
from loaderd.client.connection import Connection
from loaderd.client.errors import DaemonUnavailableError

def fds():
    return len(os.listdir("/proc/self/fd"))

class Neighbour:
    # Like a DataLoader iterator's shutdown, it still sends from its own finalizer, and waits.
    def __del__(self):
        self.conn.send(int(sys.argv[2]), {})
        try:
            self.conn.wait(self.conn.send(int(sys.argv[2]), {}), timeout_s=0.05)
        except DaemonUnavailableError:
            pass  # nobody answers here
        # It polled a pipe of its own, not a descriptor the collector closed and zmq reused.
        wake = os.readlink(f"/proc/self/fd/{self.conn._turns.wake_fd}")
        assert wake.startswith("pipe:"), wake

before = fds()
conn = Connection(sys.argv[1], timeout_s=1.0)
cycle = {"conn": conn, "neighbour": Neighbour()}
cycle["neighbour"].conn = conn
cycle["cycle"] = cycle
conn.cycle = cycle
gc.collect(0)  # the Connection moves to an older generation than...
conn.send(int(sys.argv[2]), {})  # ...the context and sockets its first request opens
del conn, cycle
gc.collect()  # a full collection lists the youngest generation first
print(fds() - before)
"""


def test_a_connection_dropped_in_a_reference_cycle_closes_its_sockets(tmp_path: Path) -> None:
    from loaderd.client.protocol import MsgType

    address = f"ipc://{tmp_path}/nobody.sock"  # the send is queued: no daemon is needed
    child = subprocess.run(
        [sys.executable, "-c", DROPPED_IN_A_CYCLE, address, str(int(MsgType.PING))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    assert child.stderr == "", child.stderr
    assert child.stdout.strip() == "0", "file descriptors left open"

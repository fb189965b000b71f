"""``loaderd ingest`` that SIGKILLs itself inside a write transaction; run by
test_ingest_kill.py.

python -m tests.integration.ingest_killed KILL_AT SOURCE --out DB ...
    runs the real ``loaderd ingest SOURCE --out DB ...``; when the KILL_AT-th record is
    put (counting from 1, across transactions) the process sends itself SIGKILL, with that
    record's transaction open and part of its batch put.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from loaderd.cli import main
from loaderd.storage.store_writer import StoreWriter

_puts = 0


class _KillingTxn:
    def __init__(self, txn: Any, kill_at: int) -> None:
        self._txn, self._kill_at = txn, kill_at

    def __enter__(self) -> _KillingTxn:
        self._txn.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._txn.__exit__(*exc)

    def put(self, *args: Any, **kwargs: Any) -> Any:
        global _puts
        if kwargs.get("db") is None:  # a record, not the progress beside it
            _puts += 1
            if _puts == self._kill_at:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        return self._txn.put(*args, **kwargs)


class _KillingEnv:
    def __init__(self, env: Any, kill_at: int) -> None:
        self._env, self._kill_at = env, kill_at

    def begin(self, **kwargs: Any) -> Any:
        txn = self._env.begin(**kwargs)
        return _KillingTxn(txn, self._kill_at) if kwargs.get("write") else txn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


if __name__ == "__main__":
    kill_at = int(sys.argv[1])
    append = StoreWriter.append

    def killing_append(w: StoreWriter, records: Any, extra: Any = None) -> None:
        if not isinstance(w._env, _KillingEnv):
            w._env = _KillingEnv(w._env, kill_at)  # type: ignore[assignment]
        append(w, records, extra)

    StoreWriter.append = killing_append  # type: ignore[method-assign]
    StoreWriter.COMMIT_SECONDS = 0.0  # a transaction per batch: the kill lands inside one
    sys.exit(main(["ingest", *sys.argv[2:]]))

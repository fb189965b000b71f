"""A daemon in a container's memory limit: a real memory cgroup, smaller than its store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loaderd.client.dataset import LoaderdDataset
from loaderd.launch import as_ordinary_user
from loaderd.storage.records import Field, RecordCodec, Schema
from loaderd.storage.store_writer import StoreWriter
from tests.helpers import Daemon, daemon_shm, memory_limited
from tests.integration.test_datapath import stats

pytestmark = pytest.mark.integration

RECORD = 20_000
N = 19_200  # 384 MB: more than the group lets the daemon fill
LIMIT = 320 << 20


def _image(i: int) -> np.ndarray:
    return np.full(RECORD, i % 251, np.uint8)


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    schema = Schema((Field("image", "uint8", (RECORD,)), Field("label", "int64")))
    codec = RecordCodec(schema)
    path = tmp_path_factory.mktemp("cg") / "s.db"
    with StoreWriter(path, schema) as w:
        w.append(codec.encode({"image": _image(i), "label": i}) for i in range(N))
    return path


def test_a_daemon_in_a_memory_cgroup_smaller_than_its_store_stays_up(
    big_store: Path, tmp_path: Path
) -> None:
    # An ordinary user's daemon (as in most containers) asked for DRAM to hold the whole
    # store: told the host's free memory, it copied the store at start and the group's
    # limit killed it. It holds no copy now, and DRAM no more than the group can hold.
    ordinary = as_ordinary_user()
    if ordinary is None:
        pytest.skip("prlimit or setpriv is missing")
    with memory_limited(LIMIT) as group:
        if group is None:
            pytest.skip("no memory cgroup can be made here")
        extra = ["--dram-bytes", "512MiB"]  # and the rings up to 1 GiB (--shm-bytes)
        with Daemon(big_store, tmp_path / "st", extra=extra, under=group + ordinary) as d:
            dram = stats(d.address)["tiers"][0]
            assert not dram["map_owned"] and not dram["map_locked"]
            # Less than asked, with a warning: DRAM, the rings and the daemon fit the group.
            assert dram["capacity_bytes"] + daemon_shm(d.address)["max_bytes"] < LIMIT
            memory = stats(d.address)["memory"]
            assert memory["cgroup"] is not None and memory["room_bytes"] < LIMIT
            assert memory["dram_bytes"] == dram["capacity_bytes"] < memory["dram_asked_bytes"]
            ds = LoaderdDataset(d.address, job="cg", batch_size=64)
            for _ in range(2):
                seen = 0
                for batch in ds:
                    images, ids = batch["image"].numpy(), batch["id"].numpy()
                    assert (images == (ids % 251)[:, None]).all()
                    assert (batch["label"].numpy() == ids).all()
                    seen += len(ids)
                assert seen == N
            ds.close()
            assert d.proc is not None and d.proc.poll() is None  # not killed
            assert stats(d.address)["tiers"][0]["items"] > 0
        assert "--dram-bytes 512 MiB lowered to" in d.log.read_text()

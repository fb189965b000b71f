"""The client's fast-path options: device refusal without CUDA, pickling, socket fallback."""

from __future__ import annotations

import pickle

import pytest
import torch

from loaderd.client import LoaderdDataset
from loaderd.client.fastpath import ShmReceiver, check_device, to_shared_tensors
from loaderd.client.protocol import Message, MsgType


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_device_is_refused_on_a_cpu_only_machine() -> None:
    with pytest.raises(RuntimeError, match=r"needs CUDA.*is_available\(\) is False"):
        LoaderdDataset("ipc:///tmp/none.sock", job="j", batch_size=4, device="cuda")


def test_bad_device_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="buffers"):
        check_device(None, 0)
    with pytest.raises(ValueError, match="CUDA device"):
        check_device("cpu", 3)
    assert check_device(None, 3) is None


def test_shm_is_asked_for_only_over_ipc() -> None:
    assert LoaderdDataset("ipc:///tmp/x.sock", job="j", batch_size=4)._shm.wanted
    assert not LoaderdDataset("ipc:///tmp/x.sock", job="j", batch_size=4, shm=False)._shm.wanted
    assert not LoaderdDataset("tcp://127.0.0.1:5555", job="j", batch_size=4)._shm.wanted


def test_receiver_pickles_without_its_mapping_and_falls_back() -> None:
    r = ShmReceiver(True)
    assert pickle.loads(pickle.dumps(r)).wanted
    # a WELCOME naming a ring that does not exist: use the socket
    assert not r.accept({"shm": {"ring": "loaderd-1-doesnotexist"}})
    assert not r.wanted
    msg = Message(MsgType.BATCH, 1, {"n": 0})
    assert not r.resolve(msg), "a BATCH without a descriptor keeps its frames"


def test_to_shared_tensors_copies_into_shared_memory() -> None:
    src = torch.arange(6)
    out = to_shared_tensors({"x": src, "names": ["a"]})
    assert out["x"].is_shared() and torch.equal(out["x"], src)
    assert out["x"].data_ptr() != src.data_ptr() and out["names"] == ["a"]

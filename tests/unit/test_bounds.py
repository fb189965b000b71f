"""The per-connection and overall bounds on parked OPEN_PASS requests, and their groups."""

from __future__ import annotations

import pytest

from loaderd.client.protocol import Message, MsgType
from loaderd.limits import LimitError
from loaderd.parked_opens import ParkedOpens


def opening(request_id: int) -> Message:
    return Message(MsgType.OPEN_PASS, request_id, {})


def test_parked_opens_are_bounded_per_connection_and_in_all() -> None:
    parked = ParkedOpens(per_client=2, total=3)
    key = ("j", 0, "train", None)
    parked.park(key, b"a", opening(1), "waits")
    parked.park(key, b"a", opening(2), "waits")
    with pytest.raises(LimitError, match="max_parked_opens_per_client"):
        parked.park(key, b"a", opening(3), "waits")
    parked.park(key, b"b", opening(4), "waits")
    with pytest.raises(LimitError, match=r"max_parked_opens\)"):
        parked.park(key, b"c", opening(5), "waits")
    assert len(parked) == 3 and parked.refused == 2


def test_a_group_is_taken_whole_and_put_back_behind_its_head() -> None:
    parked = ParkedOpens(per_client=8, total=8)
    same, other = ("j", 0, "train", None), ("j", 1, "train", None)
    for rid in range(3):
        parked.park(same, b"a", opening(rid), "first reason")
    parked.park(other, b"b", opening(9), "other")
    groups = parked.take()
    assert len(parked) == 0 and not parked
    assert [k for k, _ in groups] == [same, other]
    key, group = groups[0]
    head, rest = group.requests[0], group.requests[1:]
    parked.park(key, *head, "fresh reason")  # the head tried again and still waits
    group.requests = rest
    parked.put_back(key, group)
    assert parked.why(same) == "fresh reason"
    assert parked.waiting() == {(b"a", 0), (b"a", 1), (b"a", 2)}
    assert len(parked) == 3

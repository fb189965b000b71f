"""The outbox holds each reply until what it promises is durable, then sends in order."""

from __future__ import annotations

from loaderd.client.protocol import BatchKey, Message, MsgType
from loaderd.outbox import After, Outbox


def test_replies_wait_for_their_commit_and_keep_their_order() -> None:
    sent: list[tuple[str, object]] = []
    box = Outbox(
        lambda peer, m: sent.append(("reply", m.request_id)), lambda k: sent.append(("batch", k))
    )
    key = BatchKey("j", 0, 1, "train", 7)
    box.hold(b"a", Message(MsgType.OK, 1), After.CURSORS)
    box.hold(b"b", Message(MsgType.OK, 2), After.JOURNAL)
    box.hold_batch(key)
    box.hold(b"a", Message(MsgType.OK, 3), After.CURSORS)
    assert sent == [] and len(box) == 4
    assert box.waiting_for(After.JOURNAL) and box.waiting_for(After.CURSORS)

    box.release(After.CURSORS)  # batches first: their waiters asked before the ACKs arrived
    assert sent == [("batch", key), ("reply", 1), ("reply", 3)]
    assert not box.waiting_for(After.CURSORS) and len(box) == 1
    box.release(After.JOURNAL)
    assert sent[-1] == ("reply", 2) and len(box) == 0
    box.release(After.JOURNAL)  # nothing twice
    assert len(sent) == 4

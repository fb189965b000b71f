"""loaderd/jobs.py: pass lifecycle, acknowledgements, feedback checks and durable state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loaderd.client.errors import ErrorCode
from loaderd.importance import ImportanceConfig
from loaderd.jobs import Job, JobError, JobSpec
from loaderd.journal import FeedbackEntry, FeedbackJournal, SelectionEntry
from loaderd.pass_state import PassState

N = 40
SPEC = JobSpec("job-a", world_size=2, seed=3, batch_size=4)  # 20 samples a rank: 5 batches


def make_job(state_dir: Path | None, spec: JobSpec = SPEC) -> Job:
    return Job(spec, N, ImportanceConfig(), state_dir)


def drain(job: Job, rank: int, state: PassState, worker: int = 0) -> list[int]:
    out = []
    while (got := job.assign(rank, state, worker)) is not None:
        out.append(got[0])
    return out


def engine_state(job: Job) -> dict[str, np.ndarray]:
    return job.engine.state_dict()


def assert_same_engine(a: Job, b: Job) -> None:
    sa, sb = engine_state(a), engine_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


# ---------------------------------------------------------------- pass lifecycle


def test_pass_lifecycle(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    try:
        state = job.open_pass(0, worker=0, phase="train")
        assert (state.epoch, state.phase, state.plan.num_batches) == (0, "train", 5)
        assert job.epoch == 0

        # two workers take turns; each batch goes to exactly one of them
        got = [job.assign(0, state, w) for w in (0, 1, 0, 1, 0)]
        assert all(g is not None for g in got)
        indices = [g[0] for g in got]  # type: ignore[index]
        assert indices == [0, 1, 2, 3, 4]
        assert state.inflight == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0}
        served = np.concatenate([g[1] for g in got])  # type: ignore[index]
        assert sorted(served.tolist()) == sorted(state.plan.ids.tolist())
        assert len(served) == 20
        assert job.batches_served == 5 and job.samples_served == 20
        assert np.all(job.served_epoch[served] == 0)

        # nothing left to hand out: END, though the pass is not complete until acked
        assert job.assign(0, state, 1) is None
        assert not state.complete

        job.ack(state, [0, 2, 4])
        job.ack(state, [1, 3])
        assert state.complete and state.inflight == {}
        assert job.duplicate_acks == 0

        # the other rank is independent: still epoch 0 when it opens
        other = job.open_pass(1, worker=0, phase="train")
        assert other.epoch == 0

        nxt = job.open_pass(0, worker=0, phase="train")
        assert nxt is not state
        assert (nxt.epoch, nxt.phase) == (1, "train")
        assert job.epoch == 1
        assert job.get_pass(0, 0, "train") is None  # a stale request for the old pass
        assert job.get_pass(0, 1, "train") is nxt
        # a new epoch is shuffled differently
        assert not np.array_equal(nxt.plan.ids, state.plan.ids)
    finally:
        job.close()


def test_reopen_incomplete_pass_requeues_only_that_workers_batches() -> None:
    job = make_job(None)
    state = job.open_pass(0, worker=0, phase="train")
    job.assign(0, state, 0)  # 0 -> worker 0
    job.assign(0, state, 1)  # 1 -> worker 1
    job.assign(0, state, 0)  # 2 -> worker 0
    job.assign(0, state, 1)  # 3 -> worker 1
    job.ack(state, [0])

    again = job.open_pass(0, worker=0, phase="train")
    assert again is state and again.epoch == 0
    assert list(again.queue) == [2, 4]  # worker 0's unacked batch first, then the rest
    assert again.inflight == {1: 1, 3: 1}  # worker 1's batches stay with worker 1
    assert again.acked == {0}
    assert [job.assign(0, again, 0)[0] for _ in range(2)] == [2, 4]  # type: ignore[index]


def test_requeue_keeps_order() -> None:
    job = make_job(None)
    state = job.open_pass(0, worker=0, phase="train")
    for _ in range(4):
        job.assign(0, state, 7)
    assert state.requeue(7) == 4
    assert list(state.queue) == [0, 1, 2, 3, 4]
    assert state.requeue(7) == 0


def test_batches_the_loop_never_got_go_out_again_and_survive_a_kill(tmp_path: Path) -> None:
    """A batch a DataLoader worker handed over whose bytes the loop could not take."""
    job = make_job(tmp_path)
    state = job.open_pass(0, worker=0, phase="train")
    for worker in (0, 1, 0):
        job.assign(0, state, worker)  # 0 -> 0, 1 -> 1, 2 -> 0
    job.ack(state, [0])
    job.commit_cursors()  # the pass's start: job.json whole
    assert job.lost(0, state, [1, 0, 1, 9]) == 1, "only a batch handed out and not received"
    assert list(state.queue) == [1, 3, 4] and state.inflight == {2: 0}
    job.commit_cursors()  # a line of the cursor log
    assert job.journal is not None and job.cursor_log is not None
    job.journal.close()  # killed without close()
    job.cursor_log.close()
    again = make_job(tmp_path)
    try:
        restored = again.get_pass(0, 0, "train")
        assert restored is not None
        assert restored.inflight == {2: 0} and restored.acked == {0}
        assert drain(again, 0, restored) == [1, 3, 4]
    finally:
        again.close()


def test_duplicate_and_unknown_acks_are_counted_not_applied() -> None:
    job = make_job(None)
    state = job.open_pass(0, worker=0, phase="train")
    job.assign(0, state, 0)
    job.assign(0, state, 0)
    job.ack(state, [0, 0])
    assert job.duplicate_acks == 1 and state.acked == {0}
    job.ack(state, [0])
    assert job.duplicate_acks == 2
    job.ack(state, [99])  # no such batch
    assert job.duplicate_acks == 3 and 99 not in state.acked
    assert job.stats()["duplicate_acks"] == 3
    assert job.stats()["ranks"][0] == {
        "epoch": 0,
        "phase": "train",
        "batches": 5,
        "acked": 1,
        "inflight": 1,
    }


@pytest.mark.parametrize("rank", [-1, 2, 100])
def test_bad_rank(rank: int) -> None:
    job = make_job(None)
    for call in (
        lambda: job.open_pass(rank, 0, "train"),
        lambda: job.get_pass(rank, 0, "train"),
        lambda: job.check_rank(rank),
    ):
        with pytest.raises(JobError, match=f"rank {rank} out of range.*world_size 2") as info:
            call()
        assert info.value.code is ErrorCode.BAD_RANK


def test_unknown_phase() -> None:
    with pytest.raises(JobError, match="unknown phase 'eval'") as info:
        make_job(None).open_pass(0, 0, "eval")
    assert info.value.code is ErrorCode.BAD_ARGUMENT


def test_rescore_before_the_epoch_is_finished_is_refused() -> None:
    job = make_job(None)
    job.open_pass(0, 0, "train")
    with pytest.raises(JobError, match="epoch 0 is not finished"):
        job.open_pass(0, 0, "rescore")


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        (JobSpec("", 1, 0, 1), "job name"),
        (JobSpec("a/b", 1, 0, 1), "job name"),
        (JobSpec(".hidden", 1, 0, 1), "job name"),
        (JobSpec("x" * 129, 1, 0, 1), "job name"),
        (JobSpec("a", 0, 0, 1), "`world_size` must be >= 1"),
        (JobSpec("a", 1, 0, 0), r"`batch_size` must be in \[1, 64\]"),
        (JobSpec("a", 1, 0, 65), r"`batch_size` must be in \[1, 64\], got 65"),
    ],
)
def test_spec_check(spec: JobSpec, pattern: str) -> None:
    with pytest.raises(JobError, match=pattern):
        spec.check(64)


def test_bad_importance_options_are_a_job_error() -> None:
    with pytest.raises(JobError, match="job 'job-a': unknown importance option"):
        make_job(None, JobSpec("job-a", 1, 0, 4, {"nope": 1}))


# ---------------------------------------------------------------- feedback


@pytest.mark.parametrize("bad", [N, -1, 10**9])
def test_feedback_id_out_of_range(bad: int) -> None:
    job = make_job(None)
    ids = np.array([1, bad, 2], np.int64)
    with pytest.raises(JobError, match=f"feedback for sample {bad}, but the dataset has {N}"):
        job.record_feedback(ids, np.ones(3, np.float32), "train")
    assert job.engine.stats()["feedback_samples"] == 0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_feedback_non_finite_loss(bad: float) -> None:
    job = make_job(None)
    ids = np.array([1, 7, 2], np.int64)
    losses = np.array([0.5, bad, 0.25], np.float32)
    with pytest.raises(JobError, match="feedback for sample 7 has a non-finite loss"):
        job.record_feedback(ids, losses, "train")
    assert job.engine.stats()["feedback_samples"] == 0


def test_feedback_is_recorded_under_the_serving_epoch() -> None:
    job = make_job(None)
    state = job.open_pass(0, 0, "train")
    _, ids, _ = job.assign(0, state, 0)  # type: ignore[misc]
    job.record_feedback(ids, np.full(len(ids), 2.0, np.float32), "train")
    assert job.stats()["feedback_samples"] == len(ids)
    np.testing.assert_array_equal(job.engine.importance()[ids], 2.0)


# ---------------------------------------------------------------- durable state


def run_some(job: Job) -> PassState:
    """Open rank 0's pass, hand out four batches to two workers, ack two, send feedback."""
    state = job.open_pass(0, worker=0, phase="train")
    handed = [job.assign(0, state, w) for w in (0, 1, 0, 1)]
    job.ack(state, [0, 3])
    for _, ids, _ in handed:  # type: ignore[misc]
        job.record_feedback(ids, (ids * 0.1 + 0.5).astype(np.float32), "train")
    job.open_pass(1, worker=0, phase="train")
    return state


def test_state_survives_close_and_reopen(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    state = run_some(job)
    job.close()
    job.close()  # twice is harmless

    again = make_job(tmp_path)
    try:
        assert again.epoch == 0
        assert again.batches_served == 4 and again.samples_served == 16
        assert again.stats()["feedback_samples"] == 16
        restored = again.get_pass(0, 0, "train")
        assert restored is not None
        assert restored.acked == {0, 3}
        # every unacked batch is either waiting or still held by its worker...
        assert sorted([*restored.queue, *restored.inflight]) == [1, 2, 4]
        # ...and once both workers are back, all of them wait to be handed out again
        again.open_pass(0, worker=0, phase="train")
        again.open_pass(0, worker=1, phase="train")
        assert sorted(restored.queue) == [1, 2, 4] and restored.inflight == {}
        np.testing.assert_array_equal(restored.plan.ids, state.plan.ids)
        np.testing.assert_array_equal(restored.plan.bounds, state.plan.bounds)
        other = again.get_pass(1, 0, "train")
        assert other is not None and other.acked == set()
        assert_same_engine(job, again)
    finally:
        again.close()


def test_feedback_is_replayed_from_the_journal(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    run_some(job)
    job.save()  # what the server's tick does: syncs the journal, no engine snapshot
    assert job.journal is not None
    job.journal.close()  # the daemon dies here (kill -9): no close(), no save_engine()
    assert (tmp_path / "feedback.log").stat().st_size > 0

    again = make_job(tmp_path)
    try:
        assert again.stats()["feedback_samples"] == 16
        assert_same_engine(job, again)
        assert again.get_pass(0, 0, "train").acked == {0, 3}  # type: ignore[union-attr]
    finally:
        again.close()


def test_completed_pass_restores_and_the_next_open_advances(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    state = job.open_pass(0, 0, "train")
    job.ack(state, drain(job, 0, state))
    assert state.complete
    job.close()

    again = make_job(tmp_path)
    try:
        assert again.get_pass(0, 0, "train").complete  # type: ignore[union-attr]
        nxt = again.open_pass(0, 0, "train")
        assert nxt.epoch == 1 and again.epoch == 1
    finally:
        again.close()


def test_torn_journal_tail_is_cut_and_whole_entries_survive(tmp_path: Path) -> None:
    losses = [np.linspace(0.1, 1.0, 4, dtype=np.float32) * k for k in (1, 2, 3)]
    job = make_job(tmp_path)
    state = job.open_pass(0, 0, "train")
    batches = [job.assign(0, state, 0) for _ in range(3)]
    log = tmp_path / "feedback.log"
    sizes = []
    for (_, ids, _), loss in zip(batches, losses, strict=True):  # type: ignore[misc]
        job.record_feedback(ids, loss, "train")
        job.save()
        sizes.append(log.stat().st_size)
    assert job.journal is not None
    job.journal.close()  # killed without close()
    with open(log, "r+b") as f:
        f.truncate(sizes[-1] - 5)  # the last entry is torn

    # what the job should know: the selection, then the two whole entries
    expected = make_job(None)
    exp_state = expected.open_pass(0, 0, "train")
    for (_, ids, _), loss in zip(batches[:2], losses[:2], strict=True):  # type: ignore[misc]
        expected.assign(0, exp_state, 0)
        expected.record_feedback(ids, loss, "train")

    again = make_job(tmp_path)
    try:
        assert log.stat().st_size == sizes[1]  # cut at the end of the last whole entry
        assert again.stats()["feedback_samples"] == 8
        assert_same_engine(expected, again)
        # new feedback appends after the cut, and replays on the next start
        _, ids, _ = batches[2]  # type: ignore[misc]
        again.record_feedback(ids, losses[2], "train")
        again.save()
        assert again.journal is not None
        again.journal.close()
        third = make_job(tmp_path)
        try:
            assert third.stats()["feedback_samples"] == 12
            assert_same_engine(job, third)
        finally:
            third.close()
    finally:
        again.close()


def test_selections_replay_in_their_place_among_the_feedback(tmp_path: Path) -> None:
    path = tmp_path / "feedback.log"
    journal = FeedbackJournal(path)
    journal.append(0, "train", np.arange(4), np.ones(4, np.float32))
    journal.append_selection(1, 30, 0.25)
    journal.append(1, "rescore", np.arange(2), np.zeros(2, np.float32))
    whole = journal.size_bytes
    journal.append_selection(2, 7, float("nan"))
    journal.close()
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 3)  # the last selection is torn
    got = list(FeedbackJournal.replay(path))
    assert [(type(e), e.epoch) for e in got] == [
        (FeedbackEntry, 0),
        (SelectionEntry, 1),
        (FeedbackEntry, 1),
    ]
    assert got[1] == SelectionEntry(1, 30, 0.25)
    assert isinstance(got[2], FeedbackEntry) and got[2].kind == "rescore"
    assert path.stat().st_size == whole  # cut at the end of the last whole entry


@pytest.mark.parametrize(
    "change", [{"seed": 4}, {"world_size": 3}, {"batch_size": 8}, {"options": {"mix": 0.5}}]
)
def test_conflicting_spec(tmp_path: Path, change: dict) -> None:
    make_job(tmp_path).close()
    spec = JobSpec(**{**_spec_dict(), **change})
    with pytest.raises(JobError, match="job 'job-a' exists with") as info:
        make_job(tmp_path, spec)
    assert info.value.code is ErrorCode.JOB_CONFLICT


def _spec_dict() -> dict:
    return {
        "name": SPEC.name,
        "world_size": SPEC.world_size,
        "seed": SPEC.seed,
        "batch_size": SPEC.batch_size,
        "options": dict(SPEC.options),
    }


def test_same_spec_reopens(tmp_path: Path) -> None:
    make_job(tmp_path).close()
    make_job(tmp_path, JobSpec(**_spec_dict())).close()


def test_duplicate_acks_survive_restart(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    state = job.open_pass(0, 0, "train")
    job.assign(0, state, 0)
    job.ack(state, [0, 0, 0])
    assert job.duplicate_acks == 2
    job.close()
    again = make_job(tmp_path)
    try:
        assert again.duplicate_acks == 2
    finally:
        again.close()


def test_the_journal_stays_bounded(tmp_path: Path) -> None:
    # A client feeding the same samples' losses back again and again within one epoch: the
    # journal is emptied into a snapshot once it holds its bound, and a start after a kill
    # still knows every loss (the entries since, joined into one run, ids repeated).
    job = make_job(tmp_path)
    job.journal_min_bytes = 2048
    mirror = make_job(None)
    served = []
    for job_ in (job, mirror):
        state = job_.open_pass(0, 0, "train")
        served.append([i for _ in range(5) for i in job_.assign(0, state, 0)[1]])  # type: ignore[index]
    assert served[0] == served[1]
    ids = np.array(served[0], np.int64)
    log = tmp_path / "feedback.log"
    entry = 32 + 12 * len(ids)  # header, ids and losses of one FEEDBACK
    peak = 0
    for k in range(200):
        losses = np.full(len(ids), 0.5 + 0.01 * k, np.float32)
        job.record_feedback(ids, losses, "train")
        mirror.record_feedback(ids, losses, "train")
        peak = max(peak, log.stat().st_size)
    assert peak < job._journal_bound() + entry  # not 200 entries' worth
    job.save()
    assert job.journal is not None
    job.journal.close()  # killed without close()
    again = make_job(tmp_path)
    try:
        assert_same_engine(mirror, again)
    finally:
        again.close()

"""loaderd/epoch_plan.py through Job: a restored job plans nothing until a pass is used."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loaderd.epoch_plan import NotReady
from loaderd.importance import ImportanceConfig, ImportanceEngine
from loaderd.jobs import Job, JobSpec
from loaderd.journal import FeedbackJournal, SelectionEntry
from loaderd.pass_state import PassState

N = 40
WORLD = 2
WARMUP = 3  # epochs 0-2 train everything; from 3 on, each epoch re-scores, then selects
SPEC = JobSpec("sel", world_size=WORLD, seed=5, batch_size=2, options={"sampler": "importance"})
NOISY = np.arange(N) % 5 == 0  # their losses swing from epoch to epoch: the re-score group


class CountingEngine(ImportanceEngine):
    """The real engine, counting the calls that make a pass's samples."""

    def __init__(self, num_samples: int, config: ImportanceConfig) -> None:
        super().__init__(num_samples, config)
        self.calls: list[str] = []

    def select(self, epoch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        self.calls.append(f"select {epoch}")
        return super().select(epoch, seed)

    def rescore_ids(self, epoch: int) -> np.ndarray:
        self.calls.append(f"rescore_ids {epoch}")
        return super().rescore_ids(epoch)


def make_job(state_dir: Path) -> Job:
    return Job(
        SPEC,
        N,
        ImportanceConfig(warmup_epochs=WARMUP),
        state_dir,
        engine_type=CountingEngine,
    )


def engine(job: Job) -> CountingEngine:
    assert isinstance(job.engine, CountingEngine)
    return job.engine


def losses(ids: np.ndarray, epoch: int) -> np.ndarray:
    base = 0.5 + (ids % 7) * 0.05
    return (base + np.where(NOISY[ids], (-1.0) ** epoch * 0.4, 0.0)).astype(np.float32)


def finish(job: Job, rank: int, state: PassState) -> None:
    """Hand out and acknowledge the rest of the pass, its losses fed back, then its end."""
    while (got := job.assign(rank, state, 0)) is not None:
        index, ids, _ = got
        job.record_feedback(ids, losses(ids, state.epoch), state.phase)
        job.ack(state, [index])
    state.ended = True  # what the consumer's ACK with `end` says


def run_epoch(job: Job, epoch: int) -> None:
    if epoch >= WARMUP:
        for rank, state in [(r, job.open_pass(r, 0, "rescore")) for r in range(WORLD)]:
            finish(job, rank, state)
    for rank in range(WORLD):
        finish(job, rank, job.open_pass(rank, 0, "train"))


@pytest.mark.parametrize("phase", ["rescore", "train"])
def test_restoring_a_job_plans_nothing(tmp_path: Path, phase: str) -> None:
    job = make_job(tmp_path)
    for epoch in range(WARMUP):
        run_epoch(job, epoch)
    # Epoch 3 selects: both ranks re-score it; with "train", rank 0 trains it too.
    rescores = [job.open_pass(r, 0, "rescore") for r in range(WORLD)]
    assert rescores[0].num_batches >= 2, "the test needs a re-score group"
    if phase == "train":
        for rank, state in enumerate(rescores):
            finish(job, rank, state)
    state = job.open_pass(0, 0, phase)
    assert (state.epoch, state.phase) == (WARMUP, phase)
    job.assign(0, state, 0)
    job.assign(0, state, 1)
    job.ack(state, [0])
    want = state.plan
    job.close()

    again = make_job(tmp_path)
    try:
        assert engine(again).calls == [], "restoring computed a pass's samples"
        assert again.planner.cached == [], "restoring planned a pass"
        restored = again.passes[0]
        assert restored is not None and restored.planned is None
        assert (restored.epoch, restored.phase, restored.num_batches) == (
            WARMUP,
            phase,
            want.num_batches,
        )
        assert restored.acked == {0} and restored.inflight == {1: 1}
        assert again.stats()["ranks"][0]["batches"] == want.num_batches  # stats plan nothing

        used = again.get_pass(0, WARMUP, phase)  # a consumer asks: now it is planned
        assert used is restored
        np.testing.assert_array_equal(used.plan.ids, want.ids)
        np.testing.assert_array_equal(used.plan.bounds, want.bounds)
        assert again.planner.cached == [(WARMUP, phase)]
        # the selection was made once, before the restart: loaded, never selected again
        assert not [c for c in engine(again).calls if c.startswith("select")]
    finally:
        again.close()


def kill(job: Job) -> None:
    """What a daemon killed after its last tick leaves: the files as they are, nothing more."""
    job.save()
    assert job.journal is not None and job.cursor_log is not None
    job.journal.close()
    job.cursor_log.close()


def assert_same_engine(a: Job, b: Job) -> None:
    sa, sb = a.engine.state_dict(), b.engine.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


@pytest.mark.parametrize("stop", ["close", "kill"])
def test_a_restored_job_trains_on_exactly_as_an_uninterrupted_one(
    tmp_path: Path, stop: str
) -> None:
    plain = make_job(tmp_path / "plain")
    cut = tmp_path / "cut"
    job = make_job(cut)
    try:
        for epoch in range(WARMUP + 3):
            run_epoch(plain, epoch)
            run_epoch(job, epoch)
            job.close() if stop == "close" else kill(job)  # and back, every epoch
            job = make_job(cut)
            assert_same_engine(plain, job)  # the selections' moves too, replayed from the journal
        assert plain.epoch == job.epoch == WARMUP + 2
        for epoch in range(WARMUP, WARMUP + 3):
            np.testing.assert_array_equal(plain.selection(epoch)[0], job.selection(epoch)[0])
    finally:
        plain.close()
        job.close()


def test_an_epoch_start_journals_its_selection_and_snapshots_nothing(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    try:
        for epoch in range(WARMUP + 1):
            run_epoch(job, epoch)
        assert not (tmp_path / "importance.npz").exists()
        # the warm-up epochs train every sample: (seed, epoch) make them again, nothing is kept
        assert [p.name for p in tmp_path.glob("selection-*.npz")] == [f"selection-{WARMUP}.npz"]
        log = list(FeedbackJournal.replay(tmp_path / "feedback.log"))
        selections = [e for e in log if isinstance(e, SelectionEntry)]
        assert [e.epoch for e in selections] == list(range(WARMUP + 1))
        assert selections[-1].selected == len(job.selection(WARMUP)[0]) < N
        assert selections[-1].cut == job.engine.last_selection[2]
    finally:
        job.close()
    assert (tmp_path / "importance.npz").exists()  # a clean stop snapshots


def test_a_job_killed_in_a_selected_epoch_restarts_as_it_stood(tmp_path: Path) -> None:
    mirror = make_job(tmp_path / "mirror")
    job = make_job(tmp_path / "job")
    try:
        for j in (mirror, job):
            for epoch in range(WARMUP):
                run_epoch(j, epoch)
            for rank in range(WORLD):
                finish(j, rank, j.open_pass(rank, 0, "rescore"))
            state = j.open_pass(0, 0, "train")  # epoch WARMUP selects: half of it, fed back
            for _ in range(state.num_batches // 2):
                index, ids, _ = j.assign(0, state, 0)  # type: ignore[misc]
                j.record_feedback(ids, losses(ids, WARMUP) * 2, "train")
                j.ack(state, [index])
        kill(job)
        again = make_job(tmp_path / "job")
        try:
            assert_same_engine(mirror, again)
            assert again.stats()["importance"] == mirror.stats()["importance"]
            # the selection is the file's, not made again from the losses fed back since
            assert not [c for c in engine(again).calls if c.startswith("select")]
            rest = again.open_pass(0, 0, "train")
            assert rest.acked == mirror.passes[0].acked  # type: ignore[union-attr]
            np.testing.assert_array_equal(rest.plan.ids, mirror.passes[0].plan.ids)  # type: ignore[union-attr]
        finally:
            again.close()
    finally:
        mirror.close()


def test_a_selecting_epoch_waits_for_every_ranks_rescore_after_a_restart(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    for epoch in range(WARMUP):
        run_epoch(job, epoch)
    first, _ = (job.open_pass(r, 0, "rescore") for r in range(WORLD))
    finish(job, 0, first)
    job.close()

    again = make_job(tmp_path)
    try:
        with pytest.raises(NotReady, match=r"waiting for rank\(s\) 1 to finish re-scoring"):
            again.open_pass(0, 0, "train")
        assert not [c for c in engine(again).calls if c.startswith("select")]
        rescore = again.open_pass(1, 0, "rescore")  # rank 1 resumes its re-score pass
        assert rescore.acked == set() and rescore.planned is not None
        finish(again, 1, rescore)
        train = again.open_pass(0, 0, "train")
        assert (train.epoch, train.phase) == (WARMUP, "train")
    finally:
        again.close()


def test_a_cursor_saved_with_another_batch_count_follows_its_plan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job = make_job(tmp_path)
    state = job.open_pass(0, 0, "train")
    job.assign(0, state, 0)
    job.ack(state, [0])
    want = state.plan
    job.close()
    saved = json.loads((tmp_path / "job.json").read_text())
    saved["ranks"][0]["batches"] += 3  # not what the plan says: the plan wins, as it must
    (tmp_path / "job.json").write_text(json.dumps(saved))

    again = make_job(tmp_path)
    try:
        assert again.passes[0] is not None and again.passes[0].num_batches == want.num_batches + 3
        used = again.get_pass(0, 0, "train")
        assert used is not None and used.num_batches == want.num_batches
        assert used.acked == {0} and list(used.queue) == list(range(1, want.num_batches))
        assert again.passes[0] is used
        assert "saved with" in caplog.text
    finally:
        again.close()


def test_with_a_source_the_selection_is_its_decision_never_a_local_one(tmp_path: Path) -> None:
    decided = {(WARMUP, "train"): (np.arange(0, N, 2, dtype=np.int64), np.ones(N // 2, np.float32))}
    asked: list[tuple[int, int, str]] = []

    def inputs(job: Job, rank: int, epoch: int, phase: str) -> tuple[np.ndarray, np.ndarray]:
        asked.append((rank, epoch, phase))
        if (epoch, phase) not in decided:
            raise NotReady(f"epoch {epoch}'s {phase} pass waits for the cluster")
        return decided[(epoch, phase)]

    job = Job(
        SPEC,
        N,
        ImportanceConfig(warmup_epochs=WARMUP),
        tmp_path,
        inputs,
        engine_type=CountingEngine,
    )
    try:
        with pytest.raises(NotReady, match="waits for the cluster"):
            job.open_pass(1, 0, "train")  # epoch 0: not decided
        job.passes[0] = PassState.restore(WARMUP - 1, "train", 0)  # as if rank 0 got there
        job.passes[1] = PassState.restore(WARMUP - 1, "train", 0)
        state = job.open_pass(1, 0, "train")
        assert (state.epoch, len(state.plan.ids)) == (WARMUP, N // 4)
        np.testing.assert_array_equal(job.selection(WARMUP)[0], decided[(WARMUP, "train")][0])
        assert asked == [(1, 0, "train"), (1, WARMUP, "train")]  # the selection was planned
        assert engine(job).calls == [] and job.kept_selections() == []
    finally:
        job.close()

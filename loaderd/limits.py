"""What one client may ask of the daemon, checked at the door (HELLO), before anything is sized.

Every number in a HELLO sizes memory or disk that outlives the request: a new job name is
a state directory reloaded at every restart, ``warmup_epochs`` sizes the engine's per-sample
loss history. One greedy or buggy client must not be able to take the daemon down for the
others, so each is bounded (``LimitsConfig``) and refused past the bound with an error that
names the field, the value and the limit. Values that would pass here and fail later (a
negative seed persisted with the job, a name no file system stores) are refused too.
"""

from __future__ import annotations

from collections.abc import Collection

from loaderd.client.errors import ProtocolError
from loaderd.client.protocol import Message, MsgType
from loaderd.config import LimitsConfig
from loaderd.jobs import Job, JobError, JobSpec, Resume

_MAX_NAME_BYTES = 255  # one path component on every common file system
_MAX_SEED = 2**63 - 1


class LimitError(JobError):
    """A request past one of the daemon's limits."""


def check_hello(spec: JobSpec, jobs: Collection[str], limits: LimitsConfig) -> None:
    """Refuse a HELLO whose job would pass validation now and fail later, or cost too much.

    Args:
        spec: the job the client asks for.
        jobs: the names of the jobs the daemon holds now.
        limits: the daemon's limits.

    Raises:
        LimitError: a field out of bounds, naming it.
    """
    name = spec.name
    if not isinstance(name, str) or any(ord(c) < 32 or c == "\x7f" for c in name):
        raise LimitError(f"job name {name!r} must not contain control characters (NUL, ...)")
    if len(name.encode("utf-8", "surrogatepass")) > _MAX_NAME_BYTES:
        raise LimitError(f"job name must be at most {_MAX_NAME_BYTES} bytes in UTF-8")
    if not isinstance(spec.seed, int) or not 0 <= spec.seed <= _MAX_SEED:
        raise LimitError(f"`seed` must be an int in [0, 2**63), got {spec.seed!r}")
    warmup = spec.options.get("warmup_epochs") if isinstance(spec.options, dict) else None
    if isinstance(warmup, int) and warmup > limits.max_warmup_epochs:
        raise LimitError(
            f"`warmup_epochs` {warmup} is past this daemon's limit of "
            f"{limits.max_warmup_epochs} (each epoch costs memory per sample)"
        )
    if name not in jobs and len(jobs) >= limits.max_jobs:
        raise LimitError(
            f"this daemon holds {len(jobs)} jobs, its limit (max_jobs); "
            f"job {name!r} was not created: reuse a job name or raise the limit"
        )


def check_request_size(msg: Message, limits: LimitsConfig) -> None:
    """Refuse a request with too many frames, too many bytes in all, or too many samples.

    ZMQ_MAXMSGSIZE bounds each frame, not their number: 4,096 frames of 1 GiB would pass it.
    Checked before any handler looks at the payload, so nothing is sized from it.

    Raises:
        ProtocolError: past a limit (a BAD_MESSAGE reply naming it).
    """
    if len(msg.frames) > limits.max_request_frames:
        raise ProtocolError(
            f"{msg.type.name}: {len(msg.frames)} payload frames, at most "
            f"{limits.max_request_frames} (max_request_frames)"
        )
    total = sum(f.nbytes for f in msg.frames)
    if total > limits.max_request_bytes:
        raise ProtocolError(
            f"{msg.type.name}: {total} payload bytes, at most {limits.max_request_bytes} "
            "(max_request_bytes)"
        )
    if msg.type == MsgType.FEEDBACK and msg.frames:
        samples = msg.frames[0].nbytes // 8
        if samples > limits.max_feedback_samples:
            raise ProtocolError(
                f"FEEDBACK of {samples} samples, at most {limits.max_feedback_samples} "
                "per message (max_feedback_samples): send it in parts"
            )


def check_rewind(job: Job, resume: Resume | None) -> None:
    """Refuse a rewind to an epoch past the job's progress (it would move the job for good).

    A checkpoint can only hold epochs the daemon served, so a rewind is at most one epoch
    ahead of the job's newest pass (the next one, opened as the checkpoint was taken). A job
    with no pass yet (a state directory lost or new) accepts any epoch.

    Raises:
        LimitError: the rewind's epoch is ahead of the job.
    """
    if resume is None or not resume.rewind or all(p is None for p in job.passes):
        return
    if resume.epoch > job.epoch + 1:
        raise LimitError(
            f"resume.epoch {resume.epoch} is ahead of job {job.spec.name!r}, which is at "
            f"epoch {job.epoch}: a checkpoint holds only epochs the daemon served"
        )

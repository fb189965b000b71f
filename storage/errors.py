"""Errors raised by the storage layer; the daemon maps them to the protocol's error codes."""

from __future__ import annotations


class StorageError(Exception):
    """Base class for every error the storage layer raises on purpose."""


class CorruptRecordError(StorageError):
    """A record failed its checksum: the bytes are wrong and must never be served."""

    def __init__(self, sample_id: int, where: str, detail: str = "checksum mismatch") -> None:
        super().__init__(f"sample {sample_id}: {detail} in {where}")
        self.sample_id = sample_id
        self.where = where


class NotAStoreError(StorageError):
    """A path that should hold a loaderd sample store does not."""


class StoreFullError(StorageError):
    """The store or a tier has no room left (LMDB map full, arena full, disk full)."""


class SourceError(StorageError):
    """An ingest source is missing, unreadable, empty or of an unsupported kind."""


class ResumeError(SourceError):
    """An interrupted ingest cannot be continued: another source, or another ingest is live."""

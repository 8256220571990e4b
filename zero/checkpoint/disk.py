"""The disk's errors during a save, named as such: a full disk, a quota, a read-only or unwritable folder said in one
line ("no space left on device"), never a traceback ending in torch's "unexpected pos 704 vs 598".

Why they get lost: torch.save writes its zip archive through a C++ writer, which turns the file's OSError into a
RuntimeError ("[enforce fail at inline_container.cc] unexpected pos ...") whose __context__ alone holds the errno;
and DCP sends each rank's failure to every rank pickled, which keeps an exception's arguments and drops its
__context__. So ``Writer`` (DCP's FileSystemWriter) raises the OSError itself, the errno in its arguments, for DCP to
carry; ``os_error`` finds it in a chain, ``disk_problem`` says it in words, and a save refuses with ``DiskError``.
"""
from __future__ import annotations

import errno
import os
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from zero.checkpoint.checks import CheckpointError

class DiskError(CheckpointError):
    """A save stopped by the disk, in one line: "zero.checkpoint.save: cannot save checkpoint PATH: REASON", the
    reason (``disk_problem``'s words) kept apart for a caller that names its own checkpoint."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"zero.checkpoint.save: cannot save checkpoint {path}: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self) -> Any:  # sent between ranks whole
        return DiskError, (self.path, self.reason)


NAMED = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
         errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EPERM: "permission denied"}


def os_error(error: BaseException | None) -> OSError | None:
    """The first OSError with an errno in ``error``, its cause and context chain, or DCP's failures of any rank."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, CheckpointException):
            for failure in error.failures.values():
                found = os_error(failure[0] if isinstance(failure, tuple) else failure)
                if found is not None:
                    return found
        if isinstance(error, OSError) and error.errno is not None:
            return error
        error = error.__cause__ or error.__context__
    return None


def disk_problem(error: BaseException) -> str | None:
    """The disk's error behind ``error`` in words ("no space left on device"), or None where it is not one."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, DiskError):
            return cause.reason
        cause = cause.__cause__ or cause.__context__
    found = os_error(error)
    if found is None:
        return None
    return NAMED.get(found.errno) or (found.strerror or os.strerror(found.errno)).lower()


class Writer(FileSystemWriter):
    """DCP's FileSystemWriter whose failures keep their errno across ranks (the module docstring)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)
        except Exception as error:
            raise os_error(error) or error

    def finish(self, metadata: Any, results: Any) -> None:
        try:
            super().finish(metadata, results)
        except Exception as error:
            raise os_error(error) or error

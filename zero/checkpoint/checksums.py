"""Checksums of checkpoints, checked before a tensor is read: flipped bytes are refused in one line naming the file
("file __1_0.distcp does not match its checksum (corrupt ...)"), never loaded as a weight a little off.

[Note: the checksums are torch's own] Nothing is added at save: every checkpoint already carries CRC32s. torch.save
writes a zip archive whose every record (the pickle, each storage's bytes) has its CRC32 in the archive's directory
(``torch.serialization.get_crc32_options()``, on by default), and DCP's FileSystemWriter writes each item of a data
file (a tensor, or a pickled object) as one such archive at its (offset, length), which the .metadata records. But
torch.load never checks them (bytes flipped inside a record load in silence), and neither does DCP's reader. So a
reader checks them here, item by item, with the standard library's zipfile (which compares each record's CRC32 as it
reads it), before any tensor is read:

- a folder (``folder_problem``): the items of the parts a load reads, the work split over the ranks that read
  together (each rank a share of the bytes: 1/W of them, about what the load itself reads at the same world size),
  the verdict agreed; ``read_extra`` checks the extra's few kB alone;
- a file, last.pt (``file_problem``): every record of its one archive, by the rank that reads it, or where every
  rank of the group maps it (zero/checkpoint/whole.py), each rank a share of the records, the verdict agreed.

Why not a checksums file written beside the data (each rank hashing what it wrote, gathered to rank 0): the CRC32s
are already computed while each record is written, so a save pays nothing more, and the save paths are unchanged (an
asynchronous writer needs no call after dcp.save); folders written before this, and FSDP2's, are checked too; and a
folder stays what DCP and ``dcp_to_torch_save`` read, with no file of ours in it. What it does not cover: DCP's
.metadata (a pickle without a checksum: a flip there mostly makes it unreadable or the items' archives unparseable,
both refused as torn or corrupt, but one inside a recorded offset or size could go unseen), the zip headers' padding
(never read as data), and a checkpoint saved with torch's CRC32s switched off (every record's CRC32 0): such one is
read unchecked, as before, with no error. DCP's stream-transform extensions could carry a checksum instead, but
their descriptor is fixed before the data is written and a reader without the extension registered (torch alone,
``dcp_to_torch_save``) would refuse the folder.

Cost: one read of the checked bytes and a CRC32 over them (zlib's crc32: 2.1 GiB/s on 100 MiB on the 2-core AMD
EPYC VM, against sha256 1.3 and blake2b 0.5; a 320 MiB folder checked in 0.23 s by one process: docs/zero.md),
before the load reads them again (then from the page cache).
"""
from __future__ import annotations

import io
import os
import zipfile
from typing import Any, Iterable

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from zero.checkpoint.checks import agree

CHUNK = 1 << 20  # bytes read at a time from a record


class Slice(io.RawIOBase):
    """The bytes [offset, offset + length) of an open file, as a seekable file of their own (one DCP item: a zip
    archive whose offsets count from its first byte)."""

    def __init__(self, file: Any, offset: int, length: int):
        self.file, self.offset, self.length, self.position = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = min(max(base + position, 0), self.length)
        return self.position

    def read(self, size: int = -1) -> bytes:  # (RawIOBase's would read into a buffer, then copy it)
        count = self.length - self.position if size is None or size < 0 else min(size, self.length - self.position)
        if count <= 0:
            return b""
        self.file.seek(self.offset + self.position)
        data = self.file.read(count)
        self.position += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self.length - self.position)
        if count <= 0:
            return 0
        self.file.seek(self.offset + self.position)
        read = self.file.readinto(memoryview(buffer)[:count])
        self.position += read
        return read


def archive_problem(file: Any, rank: int = 0, ranks: int = 1, pickle_only: bool = False) -> str | None:
    """What is wrong with one torch.save archive (a file object positioned anywhere), or None: every record read
    and its CRC32 compared (zipfile does it as the record's last byte is read); with ``ranks`` > 1, this rank's
    share of the records (``share``, by their sizes); with ``pickle_only``, the pickle alone (data.pkl: what a
    reader of the small keys uses, the tensors' records left to whoever loads them). An archive saved with torch's
    CRC32s off (all 0) is not checked."""
    try:
        with zipfile.ZipFile(file) as archive:
            records = archive.infolist()
            if all(record.CRC == 0 for record in records if record.file_size):
                return None  # saved without CRC32s: nothing to check against
            if pickle_only:
                records = [record for record in records if record.filename.endswith("/data.pkl")]
            if ranks > 1:
                mine = {name for name, _, _, _ in share([(r.filename, r.header_offset, r.file_size, r.filename)
                                                         for r in records], rank, ranks)}
                records = [record for record in records if record.filename in mine]
            for record in records:
                with archive.open(record) as data:
                    while data.read(CHUNK):
                        pass
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, OSError) as error:
        return " ".join(str(error).split()) or type(error).__name__
    return None


def file_problem(path: str, rank: int = 0, ranks: int = 1, pickle_only: bool = False) -> str | None:
    """last.pt (one torch.save archive): what makes it corrupt, in words naming the file, or None; with ``ranks`` >
    1, as far as this rank's share of its records shows (the caller agrees the verdict: checks.agree); with
    ``pickle_only``, as far as its pickle shows (archive_problem). A file that is not a zip archive at all is left
    to torch.load's own refusal (a legacy torch.save, or not a checkpoint)."""
    with open(path, "rb") as file:
        if file.read(4) != b"PK\x03\x04":
            return None
        file.seek(0)
        why = archive_problem(file, rank, ranks, pickle_only)
    return None if why is None else f"file {os.path.basename(path)} does not match its checksum (corrupt: {why})"


def items(metadata: Metadata, parts: Iterable[str] | None) -> list[tuple[str, int, int, str]]:
    """The stored items a read of ``parts`` ("model", "optimizer", "extra"; None: all) touches, one per stored
    archive: (file, offset, length, the key it holds), in file order. Items de-duplicated by DCP share nothing."""
    wanted = None if parts is None else set(parts)
    found: dict[tuple[str, int, int], str] = {}
    for index, info in metadata.storage_data.items():
        where = metadata.planner_data.get(index.fqn, (index.fqn,)) if isinstance(metadata.planner_data, dict) else ()
        if wanted is not None and (not where or where[0] not in wanted):
            continue
        found.setdefault((info.relative_path, info.offset, info.length), index.fqn)
    return sorted((file, offset, length, key) for (file, offset, length), key in found.items())


def share(stored: list[tuple[str, int, int, str]], rank: int, ranks: int) -> list[tuple[str, int, int, str]]:
    """This rank's share of the items to check: the largest first, each to the rank with the fewest bytes so far
    (the same on every rank: the same metadata), then in file order."""
    loads, mine = [0] * ranks, []
    for item in sorted(stored, key=lambda item: (-item[2], item)):
        least = loads.index(min(loads))
        loads[least] += item[2]
        if least == rank:
            mine.append(item)
    return sorted(mine)


def folder_problem(path: str, metadata: Metadata, parts: Iterable[str] | None = None,
                   group: dist.ProcessGroup | None = None, alone: bool = False) -> str | None:
    """A DCP folder whose .metadata was read: the first stored item of ``parts`` whose archive does not match its
    CRC32s, in words naming its file, or None. Every rank of ``group`` calls it, each checking its share of the
    bytes, and the verdict is agreed (the lowest rank's problem for all); ``alone``: this process checks them all,
    with no collective. Call it before reading: a refused folder has changed nothing."""
    stored = items(metadata, parts)
    mine = stored if alone else share(stored, dist.get_rank(group), dist.get_world_size(group))
    problem, handles = None, {}
    try:
        for name, offset, length, key in mine:
            if name not in handles:
                handles[name] = open(os.path.join(path, name), "rb")
            why = archive_problem(Slice(handles[name], offset, length))
            if why is not None:
                problem = (f"file {name} does not match its checksum (corrupt: bytes {offset}-{offset + length} "
                           f"holding {key}: {why})")
                break
    except OSError as error:
        problem = f"file {name} cannot be read to check its checksum ({error.strerror or error})"
    finally:
        for handle in handles.values():
            handle.close()
    return problem if alone else agree(problem, group, split=True)


def verify(path: str, parts: Iterable[str] | None = None, group: dist.ProcessGroup | None = None) -> str | None:
    """For a reader that reads a folder with DCP itself (FSDP2's dcp.load): its .metadata read and its items'
    checksums checked (``folder_problem``), every rank of ``group`` a share, the verdict agreed; the problem in words
    or None. A folder that is not a checkpoint or is torn is left to the reader's own refusal."""
    from zero.checkpoint.checks import read_folder
    metadata, problem = read_folder(path)
    if agree("unread" if problem else None, group) is not None:
        return None
    return folder_problem(path, metadata, parts, group)

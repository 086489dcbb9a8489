"""The disk tier's files: one KV block per file, crash-safe and self-checking.

A file is a fixed header then the payload (the block's K and V over all
layers, as raw bytes). The header holds a magic, the format version, a
fingerprint of the KV layout (layers, KV heads, head dim, block size, dtype:
a file written by another model or layout is foreign), the payload size and
a CRC-32 of the payload. A file is written under a temporary name and
renamed into place, so a crash leaves at worst a stray temporary, never a
torn file under a slot's name; a read checks every header field and the
checksum and raises `DiskBlockError` on a short, torn, foreign or corrupt
file (the caller drops the copy and the request recomputes those tokens).
CRC-32 because the check guards against torn and corrupt files, not against
an adversary, and it runs several times faster than a cryptographic hash,
which would bound the tier's bandwidth (docs/gpu.md, 'The disk tier').

Slot `n`'s file is `agentserve-kv-<n>.blk` in the tier's directory; `clean`
removes only files of that pattern (and their temporaries), at start-up:
what a previous run left there cannot be trusted to match this run's index.

`write_many` / `read_many` handle a batch of blocks on a few threads (file
I/O and the checksum release the GIL): one file a block on one thread reads
and writes well below what an SSD moves. Threads: half the CPUs, at most 8;
one (no pool) on a machine of 2-3 CPUs, whose cores the forward pass holds."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import struct
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MAGIC = b"AGSVKVB\x00"
VERSION = 2  # 1: BLAKE2b digests
_HEADER = struct.Struct("<8sI16sQI")  # magic, version, fingerprint, payload size, payload CRC-32
HEADER_BYTES = _HEADER.size
_NAME = re.compile(r"agentserve-kv-\d+\.blk(\.tmp)?")


class DiskBlockError(Exception):
    """A disk-tier file that cannot be trusted: missing, short, torn, foreign or corrupt."""


def fingerprint(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: str) -> bytes:
    desc = f"layers={num_layers};kv_heads={num_kv_heads};head_dim={head_dim};block={block_size};dtype={dtype}"
    return hashlib.blake2b(desc.encode(), digest_size=16).digest()


def _digest(payload: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(payload)


def default_io_threads() -> int:
    return min(8, max(1, (os.cpu_count() or 1) // 2))


# what one block's write or read may raise and still leave the rest of a batch to run
_BLOCK_ERRORS = (OSError, ValueError, RuntimeError, MemoryError, DiskBlockError)


class DiskStore:
    def __init__(self, directory: str | os.PathLike[str], fp: bytes, payload_bytes: int,
                 threads: int | None = None) -> None:
        self.dir = Path(directory)
        self.fp = fp
        self.payload_bytes = payload_bytes
        self.threads = default_io_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        self._pool: ThreadPoolExecutor | None = None

    def _map(self, fn: Callable, items: Sequence) -> list:
        """`fn` of each item, in order: its result, or the error it raised."""
        def guarded(item):
            try:
                return fn(item)
            except _BLOCK_ERRORS as e:
                return e
        if self.threads == 1 or len(items) <= 1:
            return [guarded(x) for x in items]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="agentserve-disk")
        return list(self._pool.map(guarded, items))

    def write_many(self, items: Sequence[tuple[int, bytes | memoryview]]) -> list[Exception | None]:
        """`write` each (slot, payload); per item None or the error that failed it."""
        return self._map(lambda item: self.write(*item), items)

    def read_many(self, slots: Sequence[int]) -> list[bytearray | Exception]:
        """`read` each slot; per slot its payload or the error (DiskBlockError, ...) that failed it."""
        return self._map(self.read, slots)

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    def path(self, slot: int) -> Path:
        return self.dir / f"agentserve-kv-{slot}.blk"

    def clean(self) -> int:
        """Create the directory if needed and remove this server's files from it
        (nothing else). Returns how many were removed. Raises OSError."""
        self.dir.mkdir(parents=True, exist_ok=True)
        n = 0
        for entry in os.scandir(self.dir):
            if _NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                n += 1
        return n

    def write(self, slot: int, payload: bytes | memoryview) -> None:
        """Write slot `slot`'s file atomically (temporary name, then rename). Raises OSError."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, the tier's blocks have {self.payload_bytes}")
        final = self.path(slot)
        write_block_file(final, final.with_name(final.name + ".tmp"), self.fp, payload)

    def read(self, slot: int) -> bytearray:
        """Slot `slot`'s payload, checked; raises DiskBlockError if it cannot be trusted."""
        return read_block_file(self.path(slot), self.fp, self.payload_bytes, f"disk block {slot}")


def write_block_file(final: Path, tmp: Path, fp: bytes, payload: bytes | memoryview) -> None:
    """Write one block file under `tmp`, then rename it to `final` (atomic: a
    reader sees the whole file or none). Raises OSError."""
    header = _HEADER.pack(MAGIC, VERSION, fp, len(payload), _digest(payload))
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, final)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_block_file(path: Path, fp: bytes, payload_bytes: int, what: str) -> bytearray:
    """The payload of the block file at `path`, checked against fingerprint `fp`;
    raises DiskBlockError (naming `what`) if it cannot be trusted."""
    payload = bytearray(payload_bytes)  # read into in place: no second copy of 2 MB blocks
    try:
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
            got = f.readinto(payload) if len(header) == HEADER_BYTES else 0
            extra = len(f.read(1))
    except OSError as e:
        raise DiskBlockError(f"cannot read {what}: {e}") from None
    if len(header) < HEADER_BYTES:
        raise DiskBlockError(f"{what}: short file ({len(header)} bytes)")
    magic, version, got_fp, size, digest = _HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise DiskBlockError(f"{what}: not a KV block file of this format")
    if got_fp != fp:
        raise DiskBlockError(f"{what}: written for another model, KV layout or prefix")
    if size != payload_bytes or got != size or extra:
        raise DiskBlockError(f"{what}: torn ({got + extra} of {size} payload bytes)")
    if _digest(payload) != digest:
        raise DiskBlockError(f"{what}: payload checksum mismatch")
    return payload

"""The disk tier's files: one KV block per file, crash-safe and self-checking.

A file is a fixed header then the payload (the block's K and V over all
layers, as raw bytes). The header holds a magic, the format version, a
fingerprint of the KV layout (layers, KV heads, head dim, block size, dtype:
a file written by another model or layout is foreign), the payload size and
a BLAKE2b digest of the payload. A file is written under a temporary name and
renamed into place, so a crash leaves at worst a stray temporary, never a
torn file under a slot's name; a read checks every header field and the
digest and raises `DiskBlockError` on a short, torn, foreign or corrupt file
(the caller drops the copy and the request recomputes those tokens).

Slot `n`'s file is `agentserve-kv-<n>.blk` in the tier's directory; `clean`
removes only files of that pattern (and their temporaries), at start-up:
what a previous run left there cannot be trusted to match this run's index."""

from __future__ import annotations

import hashlib
import os
import re
import struct
import zlib
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


class DiskStore:
    def __init__(self, directory: str | os.PathLike[str], fp: bytes, payload_bytes: int) -> None:
        self.dir = Path(directory)
        self.fp = fp
        self.payload_bytes = payload_bytes

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
        tmp = final.with_name(final.name + ".tmp")
        header = _HEADER.pack(MAGIC, VERSION, self.fp, len(payload), _digest(payload))
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, final)

    def read(self, slot: int) -> bytearray:
        """Slot `slot`'s payload, checked; raises DiskBlockError if it cannot be trusted."""
        payload = bytearray(self.payload_bytes)  # read into in place: no second copy of 2 MB blocks
        try:
            with open(self.path(slot), "rb") as f:
                header = f.read(HEADER_BYTES)
                got = f.readinto(payload) if len(header) == HEADER_BYTES else 0
                extra = len(f.read(1))
        except OSError as e:
            raise DiskBlockError(f"cannot read disk block {slot}: {e}") from None
        if len(header) < HEADER_BYTES:
            raise DiskBlockError(f"disk block {slot}: short file ({len(header)} bytes)")
        magic, version, fp, size, digest = _HEADER.unpack(header)
        if magic != MAGIC or version != VERSION:
            raise DiskBlockError(f"disk block {slot}: not a KV block file of this format")
        if fp != self.fp:
            raise DiskBlockError(f"disk block {slot}: written for another model or KV layout")
        if size != self.payload_bytes or got != size or extra:
            raise DiskBlockError(f"disk block {slot}: torn ({got + extra} of {size} payload bytes)")
        if _digest(payload) != digest:
            raise DiskBlockError(f"disk block {slot}: payload checksum mismatch")
        return payload

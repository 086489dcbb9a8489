"""A KV directory several servers share (`--disk-kv-shared`, and every replica
of `agentserve cluster --disk-kv-dir`): a program that moves to another server
reloads its context from there instead of recomputing it.

Write-through: when a turn ends and its program goes on (into a tool call),
the blocks of its context that no server wrote yet are copied off the device
at once (the step loop reads them before the next step can reuse them) and
written by a writer thread, each under its chain key (kv/shared_chain.py), in
the disk tier's checked format (runner/disk_store.py) with the key folded into
the fingerprint: a file renamed to another prefix's or tenant's name is
foreign, and removed when found (nobody can have written it under that name).
A file is written under a temporary name of this process and renamed into
place, so a reader in any process sees a whole file or none; an existing file
is not written again. The budget counts the files this server wrote and
evicts only those.

Read: when a request arrives whose prompt runs past what this server holds
(device, host or disk tier), the chain keys of the missing blocks are looked
up in order; the files found are read, checked and put into host-tier slots
as confirmed copies, up to the first missing or rejected file (a rejected one
is logged and counted, never loaded). The admission then matches them as host
copies and reloads them through the host tier's usual path. The read runs on
the engine's thread when the request is added: it costs what reading the
files costs, where recomputing them would have cost a prefill."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path

import torch

from agentserve.kv.manager import KVCacheManager
from agentserve.kv.prefix_index import Node
from agentserve.kv.shared_chain import STALE_S, OwnedFiles, chain_keys
from agentserve.runner.disk_store import HEADER_BYTES, DiskBlockError, read_block_file, write_block_file
from agentserve.runner.kv_cache import PagedKVCache

log = logging.getLogger("agentserve")

PREFIX = "agentserve-kvs-"
TMP_STALE_S = 600.0  # a temporary no writer renamed within this long: its writer died
KNOWN_MAX = 1 << 20  # keys remembered as written or read, at most
BACKLOG_BYTES = 1 << 30  # copied off the device, not written yet, at most: beyond, a turn is not written


class SharedKVDir:
    def __init__(self, cache: PagedKVCache, kv: KVCacheManager, directory: str | os.PathLike[str],
                 budget_bytes: int, namespace: str) -> None:
        if cache.host_kv is None:
            raise ValueError("the shared KV directory needs a host tier (its blocks are read into host slots)")
        self.cache = cache
        self.kv = kv
        self.dir = Path(directory)
        self.namespace = f"{namespace}\x00{cache.fingerprint.hex()}"  # the model and its KV layout
        self.payload_bytes = cache.block_bytes
        self.file_bytes = HEADER_BYTES + self.payload_bytes
        self.owned = OwnedFiles(budget_bytes // self.file_bytes)  # raises ValueError below one file
        self.dir.mkdir(parents=True, exist_ok=True)  # raises OSError
        self._tag = f"{os.getpid()}-{secrets.token_hex(4)}"  # this process's temporaries
        self._known: set[str] = set()  # keys this server queued or found on disk (engine thread)
        self._gone: queue.SimpleQueue[str] = queue.SimpleQueue()  # own files the writer deleted
        self._jobs: queue.SimpleQueue[tuple[list[str], torch.Tensor] | None] = queue.SimpleQueue()
        self._backlog = 0  # bytes queued for the writer
        self._lock = threading.Lock()
        self._closed = False
        self._idle = threading.Condition(self._lock)
        self.num_imported = 0  # blocks read into the host tier
        self.num_rejected = 0  # files found and rejected (corrupt, foreign)
        self.num_written = 0
        self.num_write_failed = 0
        self.num_skipped = 0  # blocks not written: the writer's backlog was full
        self.num_swept = self.sweep()
        self._writer = threading.Thread(target=self._run, name="agentserve-kv-shared", daemon=True)
        self._writer.start()

    def path(self, key: str) -> Path:
        return self.dir / f"{PREFIX}{key}.blk"

    def _fp(self, key: str) -> bytes:
        return hashlib.blake2b(self.cache.fingerprint + bytes.fromhex(key), digest_size=16).digest()

    def sweep(self, now: float | None = None) -> int:
        """Remove the files of servers that are gone (untouched for `STALE_S`)
        and temporaries no writer finished. Returns how many."""
        now = time.time() if now is None else now
        n = 0
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.startswith(PREFIX) and name.endswith(".blk"):
                limit = STALE_S
            elif name.startswith("." + PREFIX) and name.endswith(".tmp"):
                limit = TMP_STALE_S
            else:
                continue
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > limit:
                    os.unlink(entry.path)
                    n += 1
        if n:
            log.info("shared KV directory: removed %d stale files from %s", n, self.dir)
        return n

    # --- the engine's hooks (engine/llm_engine.py `KVShare`) ---

    def before_add(self, req) -> None:
        self.import_prefix(req.token_ids, req.cache_salt)

    def after_turns(self, reqs: Iterable) -> None:
        for req in reqs:
            prog = req.program
            if req.is_last_turn or prog is None or prog.anonymous or prog.ended or prog.chain is None:
                continue  # nothing comes back to this context
            chain = prog.chain
            self.publish(chain.tokens, chain.node, chain.salt)

    # --- read: before a request is admitted ---

    def import_prefix(self, token_ids: Sequence[int], salt: Hashable = None) -> int:
        """Put the blocks of `token_ids` past what this server holds that the
        directory has into host-tier slots. Returns the blocks read."""
        kv = self.kv
        bs = kv.block_size
        want = (len(token_ids) - 1) // bs  # a match leaves one token to compute
        m = kv.match(token_ids, salt)
        start = len(m.nodes)
        if start >= want:
            return 0
        keys = chain_keys(token_ids, bs, want, salt, self.namespace)
        if not self.path(keys[start]).exists():
            return 0
        parent = m.nodes[-1] if m.nodes else kv.index.root
        host = kv.host
        protect = set(kv.copies.loading) | set(host.pending)
        got = 0
        for i in range(start, want):
            node = kv.index.get_or_create(parent, tuple(token_ids[i * bs:(i + 1) * bs]), salt)
            if node is None or node.block is not None or node.host_slot is not None or node.disk_slot is not None:
                break  # a collision, or KV in flight there: not this reader's to fill
            if not self._read_into(node, keys[i], protect):
                kv.index.prune(node)
                break
            protect.add(node)
            parent = node
            got += 1
        self.num_imported += got
        return got

    def _read_into(self, node: Node, key: str, protect: set[Node]) -> bool:
        path = self.path(key)
        try:
            payload = read_block_file(path, self._fp(key), self.payload_bytes, f"shared KV block {key}")
        except DiskBlockError as e:
            if path.exists():  # (else it was evicted meanwhile: an ordinary miss)
                # Under this name only this model and layout write this prefix: a file that fails the
                # check is nobody's block. It goes, so that the next server to compute it writes it.
                self.num_rejected += 1
                log.warning("shared KV directory: %s; recomputing from there and removing it", e)
                with contextlib.suppress(OSError):
                    os.unlink(path)
            return False
        slot = self.kv.host.store(node, protect)
        if slot is None:
            return False  # the host tier is full of copies in use
        block = torch.frombuffer(payload, dtype=torch.uint8).view(self.cache.dtype)
        self.cache.host_kv[slot].copy_(block.reshape(self.cache.host_kv.shape[1:]))
        self.kv.host.confirm(node)
        self._known.add(key)
        with contextlib.suppress(OSError):
            os.utime(path)  # read: not stale
        return True

    # --- write-through: after a turn ends ---

    def publish(self, token_ids: Sequence[int], last: Node | None, salt: Hashable = None) -> int:
        """Queue the device blocks of the chain ending at `last` (the indexed
        full blocks of `token_ids`) that no server wrote yet. Returns how many."""
        while True:
            try:
                self._known.discard(self._gone.get_nowait())
            except queue.Empty:
                break
        root = self.kv.index.root
        nodes = []
        node = last
        while node is not None and node is not root:
            nodes.append(node)
            node = node.parent
        if node is not root or not nodes:
            return 0  # pruned meanwhile
        nodes.reverse()
        bs = self.kv.block_size
        if len(nodes) * bs > len(token_ids) or tuple(token_ids[(len(nodes) - 1) * bs:len(nodes) * bs]) != last.tokens:
            return 0
        keys = chain_keys(token_ids, bs, len(nodes), salt, self.namespace)
        if len(self._known) > KNOWN_MAX:
            self._known.clear()  # the writer finds the files that exist
        todo = [(k, n.block.block_id) for k, n in zip(keys, nodes)
                if k not in self._known and n.block is not None and not self.kv.is_loading(n.block)]
        if not todo or self._closed:
            return 0
        size = len(todo) * self.payload_bytes
        with self._lock:
            if self._backlog and self._backlog + size > BACKLOG_BYTES:
                self.num_skipped += len(todo)
                return 0
            self._backlog += size
        staged = self.cache.gather([b for _, b in todo])  # (2, layers, heads, n, block, dim)
        blocks = staged.permute(3, 0, 1, 2, 4, 5).contiguous().cpu()
        self._known.update(k for k, _ in todo)
        self._jobs.put(([k for k, _ in todo], blocks))
        return len(todo)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            keys, blocks = job
            for i, key in enumerate(keys):
                try:
                    self._write(key, blocks[i])
                except Exception:  # a bug must not stop the writer (flush would wait for ever)
                    self.num_write_failed += 1
                    self._gone.put(key)
                    log.exception("shared KV directory: writing block %s failed", key)
            with self._lock:
                self._backlog -= len(keys) * self.payload_bytes
                self._idle.notify_all()

    def _write(self, key: str, block: torch.Tensor) -> None:
        final = self.path(key)
        if final.exists():
            return  # another server wrote it (it is that server's to evict)
        tmp = self.dir / f".{PREFIX}{key}.{self._tag}.tmp"
        try:
            write_block_file(final, tmp, self._fp(key), block.view(torch.uint8).reshape(-1).numpy().data)
        except OSError as e:
            self.num_write_failed += 1
            self._gone.put(key)
            log.warning("shared KV directory: writing block %s failed: %s", key, e)
            return
        self.num_written += 1
        for old in self.owned.add(key):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(old))
            self._gone.put(old)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queued writes are on disk; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._backlog == 0, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (within `timeout`) and stop the writer; later turns are not written."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._writer.join(timeout=timeout)

    def stats(self) -> dict[str, int]:
        return {"shared_kv_blocks_imported": self.num_imported, "shared_kv_files_rejected": self.num_rejected,
                "shared_kv_blocks_written": self.num_written, "shared_kv_write_failures": self.num_write_failed,
                "shared_kv_blocks_skipped": self.num_skipped, "shared_kv_files_owned": len(self.owned)}


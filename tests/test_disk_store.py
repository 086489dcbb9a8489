"""The disk KV tier's files (runner/disk_store.py) and the runner around them:
a block survives device -> host -> disk -> device exactly; a torn, short,
foreign or corrupt file is rejected, never loaded; start-up cleaning removes
only this server's files; the CLI's one-line errors for bad flags."""

from __future__ import annotations

import pytest
import torch

from agentserve.cli import main as cli_main
from agentserve.engine.sampling_params import SamplingParams
from agentserve.llm import LLM
from agentserve.runner.config import ModelConfig
from agentserve.runner.disk_store import HEADER_BYTES, DiskBlockError, DiskStore, fingerprint
from agentserve.runner.kv_cache import PagedKVCache
from tiny_models import DEVICE, hf_greedy, hf_llama, loaded, prompt

N_NEW = 16
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
FP = fingerprint(2, 2, 16, 4, "torch.float32")


@pytest.fixture(scope="module")
def hf():
    return hf_llama()


def make_llm(hf, **kw) -> LLM:
    opts = dict(dtype="float32", device=DEVICE, kv_cache_tokens=160, block_size=4, policy="continuum",
                host_kv_tokens=128)
    opts.update(kw)
    return LLM(loaded(hf), **opts)


def store(tmp_path, fp=FP, n=64) -> DiskStore:
    s = DiskStore(tmp_path, fp, n)
    s.clean()
    return s


# --- the file format ---

def test_write_then_read_returns_the_payload(tmp_path):
    s = store(tmp_path)
    s.write(3, bytes(range(64)))
    assert bytes(s.read(3)) == bytes(range(64))
    assert s.path(3).stat().st_size == s.file_bytes == HEADER_BYTES + 64
    assert not list(tmp_path.glob("*.tmp"))  # written under a temporary name, then renamed


@pytest.mark.parametrize("damage", ["short", "torn", "corrupt", "magic", "version", "missing"])
def test_a_damaged_file_is_rejected(tmp_path, damage):
    s = store(tmp_path)
    s.write(0, bytes(64))
    p = s.path(0)
    data = bytearray(p.read_bytes())
    if damage == "short":
        data = data[:HEADER_BYTES - 5]
    elif damage == "torn":
        data = data[:HEADER_BYTES + 30]
    elif damage == "corrupt":
        data[HEADER_BYTES + 7] ^= 0x40
    elif damage == "magic":
        data[0] ^= 1
    elif damage == "version":
        data[8] += 1
    if damage == "missing":
        p.unlink()
    else:
        p.write_bytes(bytes(data))
    with pytest.raises(DiskBlockError):
        s.read(0)


def test_a_file_of_another_layout_is_foreign(tmp_path):
    other = fingerprint(2, 2, 16, 8, "torch.float32")  # another block size
    assert other != FP and fingerprint(2, 2, 16, 4, "torch.bfloat16") != FP
    DiskStore(tmp_path, other, 64).write(0, bytes(64))
    with pytest.raises(DiskBlockError, match="another model"):
        DiskStore(tmp_path, FP, 64).read(0)


def test_clean_removes_only_this_servers_files(tmp_path):
    s = DiskStore(tmp_path / "kv", FP, 64)
    s.clean()  # creates the directory
    s.write(0, bytes(64))
    s.write(7, bytes(64))
    (s.dir / "agentserve-kv-9.blk.tmp").write_bytes(b"torn")
    keep = [s.dir / "notes.txt", s.dir / "agentserve-kv-x.blk", s.dir / "my-agentserve-kv-1.blk"]
    for k in keep:
        k.write_text("mine")
    assert s.clean() == 3
    assert sorted(p.name for p in s.dir.iterdir()) == sorted(k.name for k in keep)


# --- the runner's copies ---

def test_block_survives_device_host_disk_device_exactly(tmp_path):
    cfg = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    cache = PagedKVCache(cfg, 4, 4, 2, torch.float32, torch.device("cpu"))
    cache.attach_disk(tmp_path)
    torch.manual_seed(0)
    cache.device_kv[:, :, :, 1] = torch.randn(cache.block_shape)
    want = cache.device_kv[:, :, :, 1].clone()
    assert cache.offload([(1, 0)]) == []
    assert cache.spill([(0, 5)]) == []
    cache.host_kv.zero_()
    assert cache.load_disk([(5, 3)]) == []
    assert torch.equal(cache.device_kv[:, :, :, 3], want)
    cache.disk.path(5).write_bytes(cache.disk.path(5).read_bytes()[:-1])  # torn
    cache.device_kv[:, :, :, 2] = 7.0
    assert cache.load_disk([(5, 2)]) == [0]
    assert torch.all(cache.device_kv[:, :, :, 2] == 7.0), "a rejected file was loaded"



def test_a_batch_on_threads_reports_each_failure_at_its_position(tmp_path):
    s = DiskStore(tmp_path, FP, 64, threads=3)
    s.clean()
    assert s.write_many([(i, bytes([i]) * 64) for i in range(7)]) == [None] * 7
    errors = s.write_many([(7, bytes(64)), (8, bytes(63)), (9, bytes(64))])  # a payload of the wrong size
    assert errors[0] is None and isinstance(errors[1], ValueError) and errors[2] is None
    s.path(4).write_bytes(s.path(4).read_bytes()[:-1])  # torn
    s.path(6).unlink()
    got = s.read_many(range(8))
    assert [bytes(g) for i, g in enumerate(got) if i not in (4, 6)] == [bytes([i]) * 64 for i in (0, 1, 2, 3, 5)] + [bytes(64)]
    assert isinstance(got[4], DiskBlockError) and isinstance(got[6], DiskBlockError)
    assert isinstance(s.read_many([6])[0], DiskBlockError)  # one item: no pool
    with pytest.raises(ValueError, match="threads"):
        DiskStore(tmp_path, FP, 64, threads=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_runner_spills_and_reloads_a_batch_on_threads(tmp_path, threads):
    cfg = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    cache = PagedKVCache(cfg, 12, 4, 6, torch.float32, torch.device("cpu"))
    cache.attach_disk(tmp_path)
    cache.disk.threads = threads  # reads in chunks of 4 (one thread) or 8 (two, on a pool)
    cache.device_kv.normal_()
    want = cache.device_kv[:, :, :, :6].clone()
    assert cache.offload([(b, b) for b in range(6)]) == []
    assert cache.spill([(h, 10 + h) for h in range(6)]) == []
    cache.disk.path(15).write_bytes(b"foreign")
    cache.device_kv[:, :, :, 6:12] = 7.0
    assert cache.load_disk([(10 + h, 6 + h) for h in range(6)]) == [5]
    for h in range(6):
        if h == 5:
            assert torch.all(cache.device_kv[:, :, :, 11] == 7.0), "a rejected file was loaded"
        else:
            assert torch.equal(cache.device_kv[:, :, :, 6 + h], want[:, :, :, h])

def _evict_to_disk(llm, hf):
    p1 = prompt(11, 37)
    first = llm.generate([p1], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True), program_ids=["A"])[0]
    for i in range(8):  # one at a time: each step evicts less than the host tier holds
        llm.generate([prompt(100 + i, 60)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return p1 + first.token_ids + prompt(12, 5)


def test_a_prefix_evicted_to_disk_is_reloaded_from_there(hf, tmp_path):
    llm = make_llm(hf, disk_kv_bytes=10**6, disk_kv_dir=str(tmp_path))
    turn2 = _evict_to_disk(llm, hf)
    assert llm.kv.disk_copies.num_spilled > 0 and list(tmp_path.glob("agentserve-kv-*.blk"))
    m = llm.kv.match(turn2)
    assert m.num_disk_blocks >= 8, "the prefix did not reach the disk tier"
    before = llm.scheduler.stats.loaded_tokens
    out = llm.generate([turn2], GREEDY, program_ids=["A"])[0]
    assert llm.scheduler.stats.loaded_tokens - before >= 32
    assert llm.scheduler.stats.reload_failed_blocks == 0
    assert out.token_ids == hf_greedy(hf, turn2, N_NEW)
    llm.check_integrity()


def test_corrupt_disk_files_are_recomputed_never_read(hf, tmp_path):
    llm = make_llm(hf, disk_kv_bytes=10**6, disk_kv_dir=str(tmp_path))
    turn2 = _evict_to_disk(llm, hf)
    for p in tmp_path.glob("agentserve-kv-*.blk"):
        data = bytearray(p.read_bytes())
        data[-1] ^= 0xFF
        p.write_bytes(bytes(data))
    out = llm.generate([turn2], GREEDY, program_ids=["A"])[0]
    assert llm.scheduler.stats.reload_failed_blocks >= 8
    assert out.token_ids == hf_greedy(hf, turn2, N_NEW)
    llm.check_integrity()
    # what /metrics and the stats read: the tiers' sizes, what went to disk, the copies that failed
    from agentserve.policy.toolcall_stream import ValidatorCounts
    from agentserve.server.engine_snapshot import take_snapshot
    snap = take_snapshot(llm.scheduler, ValidatorCounts())
    assert snap.host_blocks == llm.kv.host.num_slots > 0 and snap.disk_blocks == llm.kv.disk.num_slots > 0
    assert 0 < snap.disk_blocks_used <= snap.disk_blocks and snap.disk_blocks_written >= 8
    assert snap.tier_copy_failures >= 8


def test_llm_cleans_the_directory_at_start_and_checks_the_budget(hf, tmp_path):
    (tmp_path / "agentserve-kv-3.blk").write_bytes(b"old run")
    (tmp_path / "keep.txt").write_text("not ours")
    llm = make_llm(hf, disk_kv_bytes=10**6, disk_kv_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert llm.kv.disk.num_slots == 10**6 // llm.kv_cache.disk.file_bytes
    with pytest.raises(ValueError, match="holds no block file"):
        make_llm(hf, disk_kv_bytes=100, disk_kv_dir=str(tmp_path))
    with pytest.raises(ValueError, match="needs a host tier"):
        make_llm(hf, host_kv_tokens=0, disk_kv_bytes=10**6, disk_kv_dir=str(tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not usable"):
        make_llm(hf, disk_kv_bytes=10**6, disk_kv_dir=str(tmp_path / "file"))


@pytest.mark.parametrize("flags, msg", [
    (["--disk-kv-bytes", "-1", "--disk-kv-dir", "D"], "--disk-kv-bytes must be 0"),
    (["--disk-kv-bytes", "1000000"], "needs --disk-kv-dir"),
    (["--disk-kv-dir", "D"], "needs --disk-kv-bytes"),
    (["--disk-kv-bytes", "1000000", "--disk-kv-dir", "D"], "needs --host-kv-tokens"),
    (["--disk-kv-bytes", "1000000", "--disk-kv-dir", "FILE", "--host-kv-tokens", "64"], "is not a directory"),
])
def test_cli_rejects_bad_disk_flags_in_one_line(tmp_path, capsys, flags, msg):
    (tmp_path / "FILE").write_text("x")
    flags = [str(tmp_path / f) if f in ("D", "FILE") else f for f in flags]
    assert cli_main(["generate", "hi", "--model", str(tmp_path / "no-model"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1

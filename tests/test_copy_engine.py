"""The runner's copy engine (runner/copy_engine.py): tier copies on two
worker threads (the host link, the disk link) beside the forward pass. An
offload copies its device block as it was when handed over (the block may be
rewritten at once); a spill writes its host slot as it was before the same
batch's offload reused it; batches run in the order given on each link;
failures are reported per batch and link, never lost; a slow copy does not
hold up the step, and a slow spill does not hold up a later host reload,
within the spill backlog's bound. End to end, a request whose reloads are in
flight waits while another decodes, and outputs stay transformers'. The CUDA
path (side streams) runs where a GPU is present."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from agentserve.engine.sampling_params import SamplingParams
from agentserve.engine.scheduler_output import SchedulerOutput
from agentserve.llm import LLM
from agentserve.runner.config import ModelConfig
from agentserve.runner.copy_engine import CopyEngine
from agentserve.runner.kv_cache import PagedKVCache
from tiny_models import DEVICE, hf_greedy, hf_llama, loaded, prompt


def cache(device: str = "cpu", blocks: int = 6, host: int = 4) -> PagedKVCache:
    cfg = ModelConfig(num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1, vocab_size=10)
    c = PagedKVCache(cfg, blocks, 2, host, torch.float32, torch.device(device))
    c.device_kv.copy_(torch.randn_like(c.device_kv))
    return c


def batch(ticket: int, **lists) -> SchedulerOutput:
    return SchedulerOutput(copy_ticket=ticket, **lists)


def land(engine: CopyEngine, n: int = 1) -> list:
    done = []
    deadline = time.monotonic() + 10
    while len(done) < n and time.monotonic() < deadline:
        done += engine.poll(wait=1.0)
    assert len(done) == n
    return done


def test_an_offload_copies_the_block_as_it_was_when_handed_over():
    c = cache()
    eng = CopyEngine(c)
    before = c.device_kv[:, :, :, [1, 3]].clone()
    eng.submit(batch(5, blocks_to_offload=[(1, 0), (3, 2)]))
    c.device_kv[:, :, :, [1, 3]] = 7.0  # the step's forward pass reuses the evicted blocks at once
    [done] = land(eng)
    assert done.ticket == 5 and list(done.failed_offloads) == []
    assert torch.equal(c.host_kv[[0, 2]], before.permute(3, 0, 1, 2, 4, 5))  # host slots are block-major
    eng.close()


def test_batches_run_in_the_order_given():
    """A reload from a host slot the batch before wrote gets what it wrote."""
    c = cache()
    eng = CopyEngine(c)
    want = c.device_kv[:, :, :, 2].clone()
    eng.submit(batch(1, blocks_to_offload=[(2, 3)]))
    eng.submit(batch(2, blocks_to_load=[(3, 5)]))
    done = land(eng, 2)
    assert [d.ticket for d in done] == [1, 2]
    assert torch.equal(c.device_kv[:, :, :, 5], want)
    eng.close()


def test_failures_are_reported_with_their_batch():
    c = cache()
    eng = CopyEngine(c)
    c.load = lambda pairs: [1]  # the second reload failed (kv_cache reports positions)
    eng.submit(batch(1, blocks_to_load=[(0, 1), (1, 2)]))

    def broken(pairs, staged=None):
        raise ValueError("the copy itself broke")

    c.offload = broken  # a batch whose copy raises: all of it fails, none is lost
    eng.submit(batch(2, blocks_to_offload=[(0, 0), (1, 1)], blocks_to_load=[(2, 3)]))
    d1, d2 = land(eng, 2)
    assert list(d1.failed_loads) == [1]
    assert list(d2.failed_offloads) == [0, 1] and list(d2.failed_loads) == [0]
    eng.close()


def disk_cache(tmp_path, host: int = 4) -> PagedKVCache:
    c = cache(host=host)
    c.attach_disk(tmp_path)
    c.host_kv.copy_(torch.randn_like(c.host_kv))
    return c


def held(fn, gate: threading.Event):
    def slow(*args):
        gate.wait(10)  # a slow disk (waiting releases the GIL, as I/O does)
        return fn(*args)
    return slow


def test_a_spill_writes_its_host_slot_as_it_was_before_the_batch_reused_it(tmp_path):
    c = disk_cache(tmp_path)
    eng = CopyEngine(c)
    old = c.host_kv[1].clone()
    new = c.device_kv[:, :, :, 2].clone()
    # host slot 1 goes to disk slot 7, and the same batch offloads device block 2 into it
    eng.submit(batch(1, blocks_to_spill=[(1, 7)], blocks_to_offload=[(2, 1)]))
    done = {d.tier: d for d in land(eng, 2)}
    assert done.keys() == {"host", "disk"} and {d.ticket for d in done.values()} == {1}
    assert not list(done["disk"].failed_spills) and not list(done["host"].failed_offloads)
    assert torch.equal(c.host_kv[1], new)  # a host slot holds one block as a device block does
    eng.submit(batch(2, blocks_to_load_disk=[(7, 5)]))
    [d] = land(eng)
    assert d.tier == "disk" and not list(d.failed_disk_loads)
    assert torch.equal(c.device_kv[:, :, :, 5], old)
    eng.close()


def test_a_slow_spill_does_not_hold_up_a_later_host_reload(tmp_path):
    c = disk_cache(tmp_path, host=8)
    eng = CopyEngine(c)
    gate = threading.Event()
    c.write_spills = held(c.write_spills, gate)
    want = c.host_kv[3].clone()
    eng.submit(batch(1, blocks_to_spill=[(0, 0)], blocks_to_offload=[(1, 0)]))
    eng.submit(batch(2, blocks_to_load=[(3, 4)]))
    got = land(eng, 2)  # batch 1's offload and batch 2's reload, while batch 1's spill waits
    assert [(d.ticket, d.tier) for d in got] == [(1, "host"), (2, "host")]
    assert torch.equal(c.device_kv[:, :, :, 4], want)
    assert eng.in_flight == 1 and eng.backlog.blocks == 1
    gate.set()
    [d] = land(eng)
    assert (d.ticket, d.tier, list(d.failed_spills)) == (1, "disk", [])
    assert eng.backlog.blocks == 0 and eng.backlog.peak == 1
    eng.close()


def test_spills_past_the_backlog_bound_wait_for_the_disk(tmp_path, caplog):
    c = disk_cache(tmp_path)  # a host tier of 4 slots: at most 1 spill waits in memory
    eng = CopyEngine(c)
    assert eng.backlog.cap == 1
    gate = threading.Event()
    c.write_spills = held(c.write_spills, gate)
    eng.submit(batch(1, blocks_to_spill=[(0, 0)]))
    eng.submit(batch(2, blocks_to_spill=[(1, 1)], blocks_to_load=[(2, 3)]))
    time.sleep(0.3)
    assert eng.poll() == []  # batch 2's reload waits behind its spill, which waits for room
    assert eng.backlog.num_waits == 1 and eng.backlog.blocks == 1
    assert "disk writes slower than the host tier evicts" in caplog.text  # said once, when it starts
    gate.set()
    got = land(eng, 3)
    assert [(d.ticket, d.tier) for d in got if d.tier == "disk"] == [(1, "disk"), (2, "disk")]
    assert all(not list(d.failed_spills) and not list(d.failed_loads) for d in got)
    assert eng.backlog.blocks == 0
    eng.close()


def test_failed_spills_and_disk_reloads_are_reported_on_the_disk_link(tmp_path):
    c = disk_cache(tmp_path)
    eng = CopyEngine(c)

    def broken(slots):
        raise IndexError("a host slot out of range")  # any error: the batch is never lost

    real = c.stage_spills
    c.stage_spills = broken
    eng.submit(batch(1, blocks_to_spill=[(0, 0), (1, 1)], blocks_to_offload=[(1, 1)]))
    done = {d.tier: d for d in land(eng, 2)}
    assert list(done["disk"].failed_spills) == [0, 1] and not list(done["host"].failed_offloads)
    assert eng.backlog.blocks == 0
    c.stage_spills = real
    eng.submit(batch(2, blocks_to_spill=[(2, 2)], blocks_to_load_disk=[(5, 4)]))  # no file for disk slot 5
    [d] = land(eng)
    assert d.tier == "disk" and not list(d.failed_spills) and list(d.failed_disk_loads) == [0]
    eng.close()


def test_a_slow_copy_does_not_hold_up_the_step():
    c = cache()
    eng = CopyEngine(c)
    release = threading.Event()
    real = c.load

    def slow(pairs):
        release.wait(10)  # a disk read that takes long (waiting releases the GIL, as I/O does)
        return real(pairs)

    c.load = slow
    t0 = time.perf_counter()
    eng.submit(batch(1, blocks_to_load=[(0, 1)]))
    assert time.perf_counter() - t0 < 0.5
    assert eng.poll() == [] and eng.in_flight == 1
    release.set()
    assert [d.ticket for d in land(eng)] == [1]
    eng.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the copy engine's side stream")
def test_cuda_side_stream_copies():
    c = cache("cuda")
    eng = CopyEngine(c)
    assert eng.stream is not None
    before = c.device_kv[:, :, :, [1, 3]].clone()
    eng.submit(batch(1, blocks_to_offload=[(1, 0), (3, 2)]))
    c.device_kv[:, :, :, [1, 3]] = 7.0  # the compute stream rewrites them right after the snapshot
    eng.submit(batch(2, blocks_to_load=[(0, 4), (2, 5)]))
    d1, d2 = land(eng, 2)
    assert not list(d1.failed_offloads) and not list(d2.failed_loads)
    assert torch.equal(c.host_kv[[0, 2]], before.permute(3, 0, 1, 2, 4, 5).cpu())
    assert torch.equal(c.device_kv[:, :, :, [4, 5]], before)
    eng.close()


# --- end to end ---

N_NEW = 12
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    return hf_llama()


def _evicted(llm: LLM) -> list[int]:
    """Program A's first turn, evicted to the host tier by other work: its next turn's prompt."""
    p1 = prompt(11, 37)
    first = llm.generate([p1], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True), program_ids=["A"])[0]
    llm.generate([prompt(100 + i, 60) for i in range(4)], SamplingParams(max_tokens=8, temperature=0.0,
                                                                          ignore_eos=True))
    turn2 = p1 + first.token_ids + prompt(12, 5)
    assert llm.kv.match(turn2).num_host_blocks >= 8
    return turn2


def test_a_request_waits_for_its_reloads_while_another_decodes(hf):
    llm = LLM(loaded(hf), dtype="float32", device=DEVICE, kv_cache_tokens=192, block_size=4, policy="vllm-fcfs",
              host_kv_tokens=1024, speculate=0)
    turn2 = _evicted(llm)
    gate = threading.Event()
    real = llm.kv_cache.load

    def held_load(pairs):
        gate.wait(10)  # the reload is slow: it lands only when the test says so
        return real(pairs)

    llm.kv_cache.load = held_load
    eng = llm.engine
    other = eng.add_request(prompt(7, 9), GREEDY, program_id="B")
    eng.step()
    a = eng.add_request(turn2, GREEDY, program_id="A")
    steps_while_loading = 0
    for _ in range(5):
        eng.step()
        assert a.block_table is not None and llm.kv.loads_pending(a.block_table)
        assert a.num_output_tokens == 0
        steps_while_loading += 1
        llm.check_integrity()
    assert other.num_output_tokens >= 6  # B decoded on while A's reloads were in flight
    gate.set()
    while eng.has_unfinished:
        eng.step()
        llm.check_integrity()
    llm.settle_copies()
    assert a.num_loaded_tokens >= 32 and llm.scheduler.stats.reload_failed_blocks == 0
    assert a.output_token_ids == hf_greedy(hf, turn2, N_NEW)
    assert other.output_token_ids == hf_greedy(hf, prompt(7, 9), N_NEW)
    llm.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_overlapped_and_in_step_copies_give_transformers_tokens(hf, overlap):
    llm = LLM(loaded(hf), dtype="float32", device=DEVICE, kv_cache_tokens=160, block_size=4, policy="continuum",
              host_kv_tokens=1024, overlap_copies=overlap)
    assert (llm.executor.copier is not None) == overlap == llm.scheduler.config.overlap_copies
    turn2 = _evicted(llm)
    out = llm.generate([turn2], GREEDY, program_ids=["A"])[0]
    assert out.token_ids == hf_greedy(hf, turn2, N_NEW)
    assert llm.scheduler.stats.loaded_tokens >= 32 and llm.kv.copies.num_written > 0
    assert not llm.scheduler.copies_in_flight  # generate() returns with its copies counted
    llm.check_integrity()

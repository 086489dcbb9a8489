"""Simulator profiles, cost model and executor.

Sanity figures the bundled profiles are checked against (public vLLM-class
numbers for Llama-3.1-8B bf16; the profiles themselves are roofline estimates,
see each file's "derivation"):
  * decode, one stream: ~100-150 tok/s on H100, ~80-95 tok/s on A100;
  * decode, batch 64 at ~2k context: ~3-5k tok/s on H100;
  * prefill: compute-bound; the roofline at 50% MFU on H100 gives ~33k tok/s at
    2-4k context (the often-quoted "10-15k tok/s" matches an A100 at 55% MFU,
    ~11.5k tok/s, and an H100 only at ~20% MFU), H100/A100 ~ 2.8x;
  * host reload over PCIe is an order of magnitude cheaper than re-prefill.
"""

from __future__ import annotations

import json

import pytest

from agentserve.clock import SimClock
from agentserve.cost.cost_model import CostModel
from agentserve.cost.profile import Profile, ProfileError, list_profiles, load_profile
from agentserve.engine.executor import Executor
from agentserve.engine.request import Request
from agentserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from agentserve.sim.executor import FILLER_TOKEN_ID, SimExecutor

H100 = "llama3.1-8b-h100"
A100 = "llama3.1-8b-a100"
MiB = 1 << 20


# ---------------------------------------------------------------- helpers

_counter = iter(range(10**9))


def make_request(prompt_len: int, outputs: int = 0, sim_output: list[int] | None = None) -> Request:
    i = next(_counter)
    req = Request(request_id=f"r{i}", program_id=f"p{i}", prompt_token_ids=[7] * prompt_len,
                  max_tokens=1000, arrival_time=0.0, sim_output=sim_output)
    for _ in range(outputs):
        req.append_output(5)
    return req


def prefill_chunk(req: Request, start: int, n: int) -> ScheduledChunk:
    return ScheduledChunk(request=req, start=start, num_tokens=n, sample=start + n >= req.num_tokens)


def decode_chunk(context: int, sim_output: list[int] | None = None) -> ScheduledChunk:
    """A decode of one token after `context` tokens of KV."""
    req = make_request(context, outputs=1, sim_output=sim_output)
    ch = ScheduledChunk(request=req, start=context, num_tokens=1, sample=True)
    assert ch.is_decode
    return ch


def decode_output(batch: int, context: int) -> SchedulerOutput:
    return SchedulerOutput(chunks=[decode_chunk(context) for _ in range(batch)])


@pytest.fixture(scope="module")
def h100() -> CostModel:
    return CostModel(H100, block_size=16)


@pytest.fixture(scope="module")
def a100() -> CostModel:
    return CostModel(A100, block_size=16)


# ---------------------------------------------------------------- profiles

def test_bundled_profiles_load_and_validate():
    names = list_profiles()
    assert {H100, A100} <= set(names)
    for name in names:
        p = load_profile(name)
        assert isinstance(p, Profile) and p.name == name
        assert p.model.num_layers > 0 and p.derivation and p.description
        # a roofline estimate names its efficiencies; a measured profile the command that measured it
        assert "efficiency" in p.derivation or "utilisation" in p.derivation or \
            p.derivation.startswith("Measured with `agentserve profile")
        assert p.max_num_batched_tokens == 2048 and p.max_num_seqs == 256
    p = load_profile(H100)
    assert p.model.num_layers == 32 and p.model.num_kv_heads == 8 and p.model.head_dim == 128
    assert p.model.hidden == 4096 and p.model.params == 8.03e9 and p.model.dtype_bytes == 2
    assert load_profile(H100 + ".json") == p


def test_load_by_path_and_roundtrip(tmp_path):
    p = load_profile(A100)
    path = tmp_path / "measured.json"
    p.dump(path)
    assert load_profile(path) == p
    assert load_profile(str(path)) == p


def _write(tmp_path, data) -> str:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_missing_field_is_named(tmp_path):
    data = load_profile(H100).to_dict()
    del data["kv_read_s_per_token"]
    with pytest.raises(ProfileError, match="missing field.*'kv_read_s_per_token'"):
        load_profile(_write(tmp_path, data))
    data = load_profile(H100).to_dict()
    del data["model"]["num_layers"]
    with pytest.raises(ProfileError, match="model.num_layers"):
        load_profile(_write(tmp_path, data))
    # optional fields may be left out
    data = load_profile(H100).to_dict()
    for k in ("per_seq_overhead_s", "host_copy_latency_s", "gpu", "num_gpus"):
        del data[k]
    p = load_profile(_write(tmp_path, data))
    assert p.per_seq_overhead_s == 0.0 and p.num_gpus == 1


def test_invalid_profiles_rejected(tmp_path):
    base = load_profile(H100).to_dict()
    with pytest.raises(ProfileError, match="unknown profile"):
        load_profile("no-such-profile")
    with pytest.raises(ProfileError, match="not found"):
        load_profile(str(tmp_path / "nope.json"))
    with pytest.raises(ProfileError, match="kv_bytes_per_token"):
        load_profile(_write(tmp_path, {**base, "kv_bytes_per_token": 4096}))
    with pytest.raises(ProfileError, match="prefill_b_s_per_token"):
        load_profile(_write(tmp_path, {**base, "prefill_b_s_per_token": -1.0}))
    with pytest.raises(ProfileError, match="kv_capacity_tokens.*integer"):
        load_profile(_write(tmp_path, {**base, "kv_capacity_tokens": 1.5}))
    with pytest.raises(ProfileError, match="unknown field.*'prefil_a'"):
        load_profile(_write(tmp_path, {**base, "prefil_a": 1.0}))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ProfileError, match="invalid JSON"):
        load_profile(str(tmp_path / "broken.json"))


@pytest.mark.parametrize("name, mem_mib, host_gb", [(A100, 81920, 100), (H100, 81559, 200)])
def test_capacity_arithmetic(name, mem_mib, host_gb):
    p = load_profile(name)
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    # GPU memory * 0.9 - bf16 weights - ~4 GB activations/graphs, in tokens
    kv_bytes = mem_mib * MiB * 0.9 - 8.03e9 * 2 - 4e9
    assert p.kv_capacity_tokens == int(kv_bytes // 131072)
    assert 380_000 < p.kv_capacity_tokens < 480_000
    assert p.host_kv_capacity_tokens == int(host_gb * 1e9 // 131072)
    assert p.num_blocks(16) == p.kv_capacity_tokens // 16
    assert p.host_num_blocks(16) == p.host_kv_capacity_tokens // 16
    assert p.block_bytes(16) == 16 * 131072
    with pytest.raises(ValueError):
        p.num_blocks(0)


def test_70b_profile_if_bundled():
    if "llama3.1-70b-h100x4" not in list_profiles():
        pytest.skip("no 70B profile")
    p = load_profile("llama3.1-70b-h100x4")
    assert p.num_gpus == 4 and p.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    cm = CostModel(p)
    assert 40 < 1 / cm.decode_step_time(1, 1024) < 80  # ~50-60 tok/s single stream on 4xH100


# ---------------------------------------------------------------- cost model

def test_prefill_is_the_quadratic(h100):
    p = h100.profile
    for L in (1000, 2000, 4000, 32000):
        expect = p.prefill_a_s_per_token2 * L * L + p.prefill_b_s_per_token * L + p.step_overhead_s
        assert h100.prefill_time(L) == pytest.approx(expect)
    assert h100.prefill_time(0) == 0.0
    # a whole prompt in one step costs exactly t(L)
    req = make_request(3000)
    assert h100.step_time(SchedulerOutput(chunks=[prefill_chunk(req, 0, 3000)])) == pytest.approx(h100.prefill_time(3000))
    # delta prefill after a prefix hit is cheaper than the full prefill
    assert h100.prefill_time(500, start=20000) < h100.prefill_time(20500) / 10


@pytest.mark.parametrize("name", [H100, A100])
def test_chunked_prefill_sums_to_full_prefill(name):
    cm = CostModel(name)
    L, chunk = 20000, cm.profile.max_num_batched_tokens
    req = make_request(L)
    starts = list(range(0, L, chunk))
    total = sum(cm.step_time(SchedulerOutput(chunks=[prefill_chunk(req, s, min(chunk, L - s))])) for s in starts)
    overhead = cm.profile.step_overhead_s
    assert total - len(starts) * overhead == pytest.approx(cm.prefill_time(L) - overhead, rel=1e-9)


def test_public_sanity_figures(h100, a100):
    # prefill throughput at 2-4k context (compute-bound)
    for L in (2048, 4096):
        h, a = L / h100.prefill_time(L), L / a100.prefill_time(L)
        assert 20_000 < h < 40_000
        assert 9_000 < a < 15_000
        assert 2.3 < h / a < 3.5
    # one decode stream
    assert 100 < 1 / h100.decode_step_time(1, 1024) < 150
    assert 70 < 1 / a100.decode_step_time(1, 1024) < 100
    # batch-64 decode at 2k context
    assert 3_000 < 64 / h100.decode_step_time(64, 2048) < 5_000
    # decode_step_time agrees with step_time on a real batch
    assert h100.step_time(decode_output(8, 1500)) == pytest.approx(h100.decode_step_time(8, 1500))
    # reloading a 30k-token conversation from host beats re-prefilling it by >10x
    assert h100.reload_time(30_000) * 10 < h100.prefill_time(30_000)
    assert a100.reload_time(30_000) * 10 < a100.prefill_time(30_000)


def test_decode_step_grows_with_batch_and_context(h100):
    by_batch = [h100.step_time(decode_output(b, 1024)) for b in (1, 2, 8, 32, 64, 128, 256)]
    assert all(x < y for x, y in zip(by_batch, by_batch[1:]))
    by_ctx = [h100.step_time(decode_output(16, c)) for c in (16, 512, 2048, 8192, 32768)]
    assert all(x < y for x, y in zip(by_ctx, by_ctx[1:]))
    # memory-bound: per-token cost falls with batch size
    assert by_batch[-1] / 256 < by_batch[0] / 4
    # a decode step's floor is reading the weights once
    assert by_batch[0] > h100.profile.decode_weight_read_s


def test_mixed_step_is_monotone(h100):
    req = make_request(4000)
    prefill = prefill_chunk(req, 0, 1024)
    decodes = [decode_chunk(2000) for _ in range(32)]
    t_mix = h100.step_time(SchedulerOutput(chunks=[prefill, *decodes]))
    assert t_mix >= h100.step_time(SchedulerOutput(chunks=[prefill]))
    assert t_mix >= h100.step_time(SchedulerOutput(chunks=decodes))
    # a later chunk of the same size costs more (attention over a longer prefix)
    assert h100.step_time(SchedulerOutput(chunks=[prefill_chunk(req, 2048, 1024)])) > \
        h100.step_time(SchedulerOutput(chunks=[prefill]))


def test_loads_add_time(h100):
    base = decode_output(8, 1024)
    t0 = h100.step_time(base)
    with_loads = SchedulerOutput(chunks=base.chunks, blocks_to_load=[(i, i) for i in range(100)])
    copy = h100.copy_blocks_time(100)
    assert copy == pytest.approx(h100.profile.host_copy_latency_s
                                 + 100 * 16 * 131072 / h100.profile.host_copy_bandwidth_bytes_s)
    assert h100.step_time(with_loads) == pytest.approx(t0 + copy)
    # more blocks, more time; loads alone still take time
    more = SchedulerOutput(chunks=base.chunks, blocks_to_load=[(i, i) for i in range(200)])
    assert h100.step_time(more) > h100.step_time(with_loads)
    assert h100.step_time(SchedulerOutput(blocks_to_load=[(0, 0)])) > 0
    # reload_time is the same copy priced per token
    assert h100.reload_time(1600) == pytest.approx(copy)


def test_offloads_overlap_with_compute(h100):
    base = decode_output(8, 1024)
    t0 = h100.step_time(base)
    small = SchedulerOutput(chunks=base.chunks, blocks_to_offload=[(i, i) for i in range(10)])
    assert h100.copy_blocks_time(10) < t0
    assert h100.step_time(small) == pytest.approx(t0)  # hidden behind the forward pass
    big = SchedulerOutput(chunks=base.chunks, blocks_to_offload=[(i, i) for i in range(5000)])
    assert h100.step_time(big) == pytest.approx(h100.copy_blocks_time(5000))  # copy-bound
    assert h100.step_time(big) < t0 + h100.copy_blocks_time(5000)


def test_empty_output_costs_nothing(h100):
    assert h100.step_time(SchedulerOutput()) == 0.0


# ---------------------------------------------------------------- executor

def test_executor_advances_clock_and_returns_scripted_tokens(h100):
    clock = SimClock(start=10.0)
    ex = SimExecutor(clock, h100)
    assert isinstance(ex, Executor)

    scripted = make_request(300, sim_output=[11, 12, 13])
    unscripted = make_request(50)
    partial = make_request(5000, sim_output=[99])
    out = SchedulerOutput(chunks=[
        prefill_chunk(scripted, 0, 300),
        prefill_chunk(unscripted, 0, 50),
        prefill_chunk(partial, 0, 1000),  # not the end of the prompt: nothing sampled
    ])
    res = ex.execute(out)
    assert res.elapsed == pytest.approx(h100.step_time(out)) and res.elapsed > 0
    assert clock.now() == pytest.approx(10.0 + res.elapsed)
    assert res.sampled == {scripted.request_id: [11], unscripted.request_id: [FILLER_TOKEN_ID]}

    # the scheduler appends; the next decode gets the next scripted token
    scripted.append_output(11)
    scripted.num_computed_tokens = 300
    t1 = clock.now()
    res2 = ex.execute(SchedulerOutput(chunks=[ScheduledChunk(scripted, 300, 1, True)],
                                      blocks_to_load=[(1, 2), (3, 4)], blocks_to_offload=[(5, 6)]))
    assert res2.sampled == {scripted.request_id: [12]}
    assert clock.now() == pytest.approx(t1 + res2.elapsed)

    # past the end of the script: filler
    for tok in (12, 13):
        scripted.append_output(tok)
    res3 = ex.execute(SchedulerOutput(chunks=[ScheduledChunk(scripted, 302, 1, True)]))
    assert res3.sampled == {scripted.request_id: [FILLER_TOKEN_ID]}

    s = ex.stats
    assert s.steps == 3
    assert s.busy_time == pytest.approx(res.elapsed + res2.elapsed + res3.elapsed)
    assert clock.now() == pytest.approx(10.0 + s.busy_time)
    assert s.prefill_tokens == 1350 and s.decode_tokens == 2 and s.sampled_tokens == 4
    assert s.loaded_blocks == 2 and s.offloaded_blocks == 1

    # an empty step takes no time and is not counted
    assert ex.execute(SchedulerOutput()).elapsed == 0.0
    assert ex.stats.steps == 3


def test_overlapped_copies_run_on_a_host_link_and_a_disk_link(h100):
    """A slow disk write holds up no host reload: each link reports its part of a
    batch when it ends, and the disk link writes a spill once the host link staged it."""
    clock = SimClock()
    ex = SimExecutor(clock, h100, overlap_copies=True, host_blocks=100_000)
    spills = SchedulerOutput(copy_ticket=1, blocks_to_spill=[(i, i) for i in range(1000)],
                             blocks_to_offload=[(i, i) for i in range(10)])
    assert ex.execute(spills).copies_pending
    loads = SchedulerOutput(copy_ticket=2, blocks_to_load=[(i, i) for i in range(5)])
    ex.execute(loads)
    host1 = h100.host_copy_time(spills)
    assert host1 == pytest.approx(h100.copy_blocks_time(1000) + h100.copy_blocks_time(10))
    host2 = host1 + h100.host_copy_time(loads)
    disk1 = h100.copy_blocks_time(1000) + h100.disk_copy_time(spills)
    assert host2 < disk1  # the reload lands long before the spills are written
    assert ex.next_copy_time() == pytest.approx(host1)
    got = ex.poll_copies(wait=host2)  # moves the clock to the first landing only
    assert [(d.ticket, d.tier) for d in got] == [(1, "host")] and clock.now() == pytest.approx(host1)
    clock.advance_to(host2)
    assert [(d.ticket, d.tier) for d in ex.poll_copies()] == [(2, "host")]
    assert ex.next_copy_time() == pytest.approx(disk1) and ex.backlog.blocks == 1000
    clock.advance_to(disk1)
    assert [(d.ticket, d.tier) for d in ex.poll_copies()] == [(1, "disk")]
    assert ex.next_copy_time() is None
    assert ex.stats.copy_time == pytest.approx(host2) and ex.stats.disk_copy_time == pytest.approx(
        h100.disk_copy_time(spills))


def test_spills_past_the_backlog_wait_for_the_disk_link(h100):
    clock = SimClock()
    ex = SimExecutor(clock, h100, overlap_copies=True, host_blocks=400)  # at most 100 staged spills
    assert ex.backlog.cap == 100
    first = SchedulerOutput(copy_ticket=1, blocks_to_spill=[(i, i) for i in range(100)])
    ex.execute(first)
    written = h100.copy_blocks_time(100) + h100.disk_copy_time(first)
    second = SchedulerOutput(copy_ticket=2, blocks_to_spill=[(i, i) for i in range(50)], blocks_to_load=[(0, 0)])
    ex.execute(second)
    assert ex.stats.spill_waits == 1
    # the second batch's host part starts once the first batch's spills are written
    assert ex.next_copy_time() == pytest.approx(written)
    clock.advance_to(written)
    assert [(d.ticket, d.tier) for d in ex.poll_copies()] == [(1, "disk")]
    host2 = written + h100.host_copy_time(second)
    assert ex.next_copy_time() == pytest.approx(host2)
    assert ex.backlog.blocks == 50 and ex.backlog.peak == 100


def test_cost_model_is_cheap(h100):
    """Tens of thousands of steps must stay fast: no per-token work. (CPU time of
    this process, so other work on the machine does not make it fail.)"""
    import time
    out = SchedulerOutput(chunks=[prefill_chunk(make_request(4000), 0, 1024)] + [decode_chunk(8192) for _ in range(64)])
    t = time.process_time()
    for _ in range(20_000):
        h100.step_time(out)
    assert time.process_time() - t < 2.0


def test_the_free_reloads_profile_is_the_h100_profile_with_free_reloads():
    """benchmarks/profiles/llama3.1-8b-h100-free-reloads.json (the prefetch ceiling of docs/simulator.md)
    stays the bundled profile in everything but its reload speeds."""
    import json
    from pathlib import Path

    from agentserve.cost.profile import _bundled_dir

    root = Path(__file__).resolve().parent.parent
    free = json.loads((root / "benchmarks/profiles/llama3.1-8b-h100-free-reloads.json").read_text())
    base = json.loads(_bundled_dir().joinpath("llama3.1-8b-h100.json").read_text())
    changed = {"name", "description", "derivation", "host_copy_bandwidth_bytes_s", "host_copy_latency_s",
               "disk_read_bandwidth_bytes_s", "disk_write_bandwidth_bytes_s"}
    assert {k: v for k, v in free.items() if k not in changed} == {k: v for k, v in base.items() if k not in changed}
    cost = CostModel(load_profile(root / "benchmarks/profiles/llama3.1-8b-h100-free-reloads.json"), 16)
    reloads = cost.tier_reloads()
    assert reloads["host"](100_000) < 1e-6 and reloads["disk"](100_000) < 1e-6

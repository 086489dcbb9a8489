"""A KV directory two servers share (runner/shared_kv.py, kv/shared_chain.py):
a program's turn on server A is written through; server B, given the
program's next turn, reloads the prefix from the directory and answers as a
fresh computation does, token for token. A corrupt file, a file renamed to
another tenant's name and a file of another model are misses, never loaded;
each server evicts only its own files within its budget."""

from __future__ import annotations

import os

import pytest

from agentserve.cli import main as cli_main
from agentserve.engine.sampling_params import SamplingParams
from agentserve.kv.shared_chain import OwnedFiles, chain_keys
from agentserve.llm import LLM
from tiny_models import DEVICE, hf_greedy, hf_llama, loaded, prompt

N_NEW = 8
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    return hf_llama()


def make_llm(hf, tmp_path, **kw) -> LLM:
    opts = dict(dtype="float32", device=DEVICE, kv_cache_tokens=160, block_size=4, policy="continuum",
                host_kv_tokens=128, disk_kv_bytes=10**6, disk_kv_dir=str(tmp_path), disk_kv_shared=True)
    opts.update(kw)
    return LLM(loaded(hf), **opts)


def shared_files(tmp_path):
    return sorted(tmp_path.glob("agentserve-kvs-*.blk"))


def first_turn(llm, program="P", salt=None):
    p1 = prompt(11, 37)
    if salt is None:
        out = llm.generate([p1], GREEDY, program_ids=[program])[0]
    else:
        req = llm.engine.add_request(p1, GREEDY, program_id=program, cache_salt=salt)
        out = llm._run([req.request_id])[0]
    return p1 + out.token_ids + prompt(12, 5)


def second_turn(llm, turn2, program="P", salt=None):
    before = llm.scheduler.stats.loaded_tokens
    req = llm.engine.add_request(turn2, GREEDY, program_id=program, cache_salt=salt)
    out = llm._run([req.request_id])[0]
    return out, llm.scheduler.stats.loaded_tokens - before


# --- the names and the budget (no engine) ---

def test_chain_keys_are_stable_and_split_by_salt_model_and_prefix():
    toks = list(range(40))
    a = chain_keys(toks, 4, 10)
    assert a == chain_keys(toks, 4, 10) and len(set(a)) == 10
    assert chain_keys(toks[:20], 4, 5) == a[:5]  # a prefix's keys are its extension's first keys
    assert chain_keys(toks, 4, 10, salt=("t1", None))[0] != a[0]
    assert chain_keys(toks, 4, 10, namespace="other-model")[0] != a[0]
    changed = toks[:]
    changed[1] = 99
    assert all(x != y for x, y in zip(chain_keys(changed, 4, 10), a))  # every later key depends on block 0
    with pytest.raises(ValueError, match="need 44 tokens"):
        chain_keys(toks, 4, 11)


def test_owned_files_evict_oldest_first_within_the_budget():
    own = OwnedFiles(2)
    assert own.add("a") == [] and own.add("b") == []
    assert own.add("c") == ["a"] and "a" not in own and len(own) == 2
    own.discard("b")
    assert own.add("d") == [] and own.num_evicted == 1
    with pytest.raises(ValueError, match="at least one file"):
        OwnedFiles(0)


# --- two servers on one directory ---

def test_a_moved_program_reloads_its_prefix_from_the_shared_directory(hf, tmp_path):
    a = make_llm(hf, tmp_path)
    turn2 = first_turn(a)
    assert a.shared_kv.num_written >= 10 and len(shared_files(tmp_path)) == a.shared_kv.num_written
    b = make_llm(hf, tmp_path)
    out, loaded_tokens = second_turn(b, turn2)
    assert b.shared_kv.num_imported >= 10 and loaded_tokens >= 40
    assert out.num_cached_tokens >= 40
    assert out.token_ids == hf_greedy(hf, turn2, N_NEW)
    assert b.scheduler.stats.reload_failed_blocks == 0
    a.check_integrity()
    b.check_integrity()
    # B found A's files there: it writes only the blocks of its own turn that were new
    assert b.shared_kv.num_written <= (len(turn2) + N_NEW) // 4 - a.shared_kv.num_written + 1
    # /metrics says what came from the directory
    from agentserve.policy.toolcall_stream import ValidatorCounts
    from agentserve.server.engine_snapshot import take_snapshot
    from agentserve.server.metrics import ServerMetrics
    text = ServerMetrics("m").render(take_snapshot(b.scheduler, ValidatorCounts(), shared_kv=b.shared_kv)).decode()
    assert f'agentserve:shared_kv_blocks_imported_total{{model_name="m"}} {float(b.shared_kv.num_imported)}' in text
    assert "agentserve:shared_kv_files_owned{" in text


def test_a_corrupt_file_is_a_miss_and_the_turn_recomputes(hf, tmp_path):
    a = make_llm(hf, tmp_path)
    turn2 = first_turn(a)
    key = chain_keys(turn2, 4, 3, None, a.shared_kv.namespace)[2]
    path = tmp_path / f"agentserve-kvs-{key}.blk"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    b = make_llm(hf, tmp_path)
    out, loaded_tokens = second_turn(b, turn2)
    assert b.shared_kv.num_rejected == 1 and b.shared_kv.num_imported == 2  # up to the bad file, not past it
    assert loaded_tokens == 8
    assert out.token_ids == hf_greedy(hf, turn2, N_NEW)
    b.check_integrity()
    b.shared_kv.flush()  # the bad file went; B wrote the block again, whole
    assert path.exists() and b.shared_kv.num_written >= 1
    c = make_llm(hf, tmp_path)
    _, loaded_tokens = second_turn(c, turn2)
    assert c.shared_kv.num_rejected == 0 and loaded_tokens >= 40


def test_another_tenants_file_is_a_miss(hf, tmp_path):
    a = make_llm(hf, tmp_path)
    turn2 = first_turn(a, salt=("tenant-a", None))
    b = make_llm(hf, tmp_path)
    out, loaded_tokens = second_turn(b, turn2, salt=("tenant-b", None))  # same tokens, another tenant
    assert b.shared_kv.num_imported == 0 and loaded_tokens == 0
    # a file renamed to the name tenant B looks up is foreign, not loaded
    ns = a.shared_kv.namespace
    ka = chain_keys(turn2, 4, 1, ("tenant-a", None), ns)[0]
    c = make_llm(hf, tmp_path)
    kc = chain_keys(turn2, 4, 1, ("tenant-c", None), ns)[0]
    os.replace(tmp_path / f"agentserve-kvs-{ka}.blk", tmp_path / f"agentserve-kvs-{kc}.blk")
    out, loaded_tokens = second_turn(c, turn2, program="Q", salt=("tenant-c", None))
    assert c.shared_kv.num_rejected == 1 and c.shared_kv.num_imported == 0 and loaded_tokens == 0
    assert out.token_ids == hf_greedy(hf, turn2, N_NEW)
    d = make_llm(hf, tmp_path)  # the renamed file went; C wrote tenant C's blocks, which D reads
    _, loaded_tokens = second_turn(d, turn2, program="R", salt=("tenant-c", None))
    assert d.shared_kv.num_rejected == 0 and loaded_tokens >= 40
    c.check_integrity()


def test_another_kv_layout_names_its_blocks_apart(hf, tmp_path):
    a = make_llm(hf, tmp_path)
    turn2 = first_turn(a)
    b = make_llm(hf, tmp_path, kv_dtype="bfloat16")  # one model, another KV dtype: other bytes, other names
    out, loaded_tokens = second_turn(b, turn2)
    assert b.shared_kv.num_imported == 0 and b.shared_kv.num_rejected == 0 and loaded_tokens == 0
    both = a.shared_kv.num_written + b.shared_kv.num_written
    assert b.shared_kv.num_written > 0 and len(shared_files(tmp_path)) == both
    b.check_integrity()


def test_each_server_evicts_only_its_own_files(hf, tmp_path):
    other = tmp_path / "agentserve-kvs-0123456789abcdef0123456789abcdef.blk"
    other.write_bytes(b"another server's block")
    budget = 5 * (a_file := make_llm(hf, tmp_path).shared_kv.file_bytes)
    a = make_llm(hf, tmp_path, disk_kv_bytes=budget)
    first_turn(a)
    assert a.shared_kv.num_written >= 10 and len(a.shared_kv.owned) == 5
    assert len(shared_files(tmp_path)) == 5 + 1 and other.exists()
    assert a_file > 0
    a.check_integrity()


def test_a_reader_never_sees_a_torn_file_while_another_process_writes(tmp_path):
    """Writers rename whole files into place: a concurrent reader gets one
    writer's whole payload or a miss, never a mix; a writer that writes in
    place (not this format's way) is caught as torn or corrupt."""
    import threading

    from agentserve.runner.disk_store import DiskBlockError, read_block_file, write_block_file
    fp, n = b"f" * 16, 1 << 16
    final = tmp_path / "agentserve-kvs-ab.blk"
    payloads = [bytes([i]) * n for i in range(4)]
    done = threading.Event()

    def writer(i):
        while not done.is_set():
            write_block_file(final, tmp_path / f".agentserve-kvs-ab.{i}.tmp", fp, payloads[i])
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    seen = set()
    try:
        for _ in range(300):
            try:
                got = bytes(read_block_file(final, fp, n, "block"))
            except DiskBlockError as e:
                assert "cannot read" in str(e)  # not there yet
                continue
            assert got in payloads[:2]
            seen.add(got[0])
    finally:
        done.set()
        for t in threads:
            t.join()
    assert seen
    with open(final, "r+b") as f:  # a writer in place, caught half way
        f.seek(n // 2)
        f.write(b"\x07" * 16)
    with pytest.raises(DiskBlockError, match="checksum"):
        read_block_file(final, fp, n, "block")
    with open(final, "r+b") as f:
        f.truncate(n // 2)
    with pytest.raises(DiskBlockError, match="torn"):
        read_block_file(final, fp, n, "block")


def test_stale_files_and_temporaries_are_swept_at_start(hf, tmp_path):
    old = tmp_path / "agentserve-kvs-00000000000000000000000000000000.blk"
    tmp = tmp_path / ".agentserve-kvs-00000000000000000000000000000001.99-ab.tmp"
    fresh = tmp_path / "agentserve-kvs-00000000000000000000000000000002.blk"
    keep = tmp_path / "notes.txt"
    for p in (old, tmp, fresh, keep):
        p.write_bytes(b"x")
    os.utime(old, (1, 1))
    os.utime(tmp, (1, 1))
    llm = make_llm(hf, tmp_path)
    assert llm.shared_kv.num_swept == 2 and not old.exists() and not tmp.exists()
    assert fresh.exists() and keep.exists()


def test_shared_needs_a_host_tier_and_a_budget(hf, tmp_path):
    with pytest.raises(ValueError, match="needs a host tier"):
        make_llm(hf, tmp_path, host_kv_tokens=0)
    with pytest.raises(ValueError, match="at least one file"):
        make_llm(hf, tmp_path, disk_kv_bytes=10)


def test_cli_rejects_shared_without_a_directory_in_one_line(tmp_path, capsys):
    assert cli_main(["generate", "hi", "--model", str(tmp_path / "no-model"), "--disk-kv-shared"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--disk-kv-shared needs --disk-kv-dir" in err and len(err.splitlines()) == 1


def test_close_writes_what_is_queued_and_then_nothing_more(hf, tmp_path):
    a = make_llm(hf, tmp_path)
    turn2 = first_turn(a)
    a.shared_kv.close()
    written = a.shared_kv.num_written
    assert written >= 10 and len(shared_files(tmp_path)) == written
    second_turn(a, turn2 + prompt(13, 20))  # a turn after the server stopped writing: not queued
    assert a.shared_kv.num_written == written and a.shared_kv.flush(timeout=1.0)
    a.check_integrity()


def test_two_servers_over_http_a_moved_programs_turn_reloads_from_the_directory(tmp_path):
    """A program's first turn on server A, its second on server B (as the cluster's router moves it):
    B answers from A's written-through blocks, under the tenant the API key names."""
    import httpx

    from agentserve.server.app import ServerConfig, create_app
    from server_fixtures import ServerThread, tiny_llm

    def server():
        llm = tiny_llm(host_kv_tokens=2048, disk_kv_bytes=10**7, disk_kv_dir=str(tmp_path), disk_kv_shared=True)
        return ServerThread(create_app(llm, ServerConfig(["tiny"], api_key="k"))).start(), llm

    (a, llm_a), (b, llm_b) = server(), server()
    try:
        headers = {"Authorization": "Bearer k", "X-Program-Id": "P"}
        messages = [{"role": "user", "content": "list the files in the repository and read the README " * 3}]

        def turn(srv):
            r = httpx.post(srv.url + "/v1/chat/completions", headers=headers, timeout=60,
                           json={"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        first = turn(a)
        assert llm_a.shared_kv.flush(timeout=30) and llm_a.shared_kv.num_written >= 10
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "now run the tests"}]
        second = turn(b)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 4 * 10 and llm_b.shared_kv.num_imported >= 10
        page = httpx.get(b.url + "/metrics", headers=headers, timeout=10).text
        want = f'agentserve:shared_kv_blocks_imported_total{{model_name="tiny"}} {float(llm_b.shared_kv.num_imported)}'
        assert want in page
    finally:
        a.stop()
        b.stop()

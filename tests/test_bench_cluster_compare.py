"""`python -m benchmarks cluster-compare` (benchmarks/cluster_compare.py): the `cluster-<router>`
servers beside bench compare's, and the router decisions read from a cluster's /metrics."""

from __future__ import annotations

import pytest

from agentserve.bench.peers.specs import DEFAULT_PORTS, SERVER_NAMES, UnknownServerError, server_spec
from benchmarks import cluster_compare as cc


def _arg(argv, flag):
    return argv[list(argv).index(flag) + 1]


def test_cluster_names_split_the_same_kv_and_cores_over_two_replicas(tmp_path):
    specs = dict(zip(cc.CLUSTER_NAMES, cc.specs_of(cc.CLUSTER_NAMES, 32768, peers_dir=tmp_path)))
    assert cc.CLUSTER_NAMES == ("cluster-program", "cluster-ray-default", "cluster-pow2", "cluster-prefix",
                                "cluster-round-robin")
    assert len({s.port for s in specs.values()} | set(DEFAULT_PORTS.values())) == len(specs) + len(SERVER_NAMES)
    argv = specs["cluster-ray-default"].argv
    assert argv[argv.index("cluster") + 1:argv.index("cluster") + 5] == ("--replicas", "2", "--router", "ray-default")
    assert _arg(argv, "--kv-cache-tokens") == "32768" and _arg(argv, "--threads") == "1"
    assert "16384 tokens and 1 thread each" in specs["cluster-program"].kv_setting
    one = server_spec("agentserve-continuum", 32768, peers_dir=tmp_path)
    for name, s in specs.items():
        assert s.name == name and s.log_path == one.log_path.with_name(f"{name}.log")
        assert s.health_path == "/health" and s.startup_timeout_s == cc.STARTUP_TIMEOUT_S
        assert (s.model_name, s.max_model_len, s.kv_bytes, s.env) == (one.model_name, one.max_model_len,
                                                                      one.kv_bytes, one.env)
        assert _arg(s.argv, "--port") == str(s.port) and _arg(s.argv, "--served-model-name") == one.model_name
    s = cc.cluster_spec("cluster-program", 32768, port=9999, threads=4, peers_dir=tmp_path, extra_args=["--x"])
    assert s.port == 9999 and _arg(s.argv, "--threads") == "2" and s.argv[-1] == "--x"
    # the other names are bench compare's
    assert cc.specs_of(["agentserve-continuum"], 32768, peers_dir=tmp_path) == [one]
    for bad in ("cluster-nope", "cluster-program:x"):
        with pytest.raises(UnknownServerError):
            cc.specs_of([bad], 32768)


def test_router_summary_reads_a_clusters_decisions(capsys):
    page = ('# TYPE agentserve:router_counters gauge\n'
            'agentserve:router_counters{deployment="d",counter="affinity"} 40\n'
            'agentserve:router_counters{deployment="d",counter="escapes"} 2.0\n'
            'agentserve:router_counters{deployment="d",counter="programs_remembered"} 9\n')
    assert cc.router_summary(page) == "affinity 40, escapes 2"
    assert cc.router_summary(None) == "" and cc.router_summary("agentserve:x 1\n") == ""
    cc.print_decisions([{"server": "cluster-program", "final_metrics": page}, {"server": "vllm-cpu"}], [], [])
    assert capsys.readouterr().err == "cluster-program: router decisions: affinity 40, escapes 2\n"


def test_unknown_server_is_a_one_line_error(capsys):
    assert cc.main(["--servers", "cluster-nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown cluster 'cluster-nope'" in err and err.count("\n") == 1

"""`agentserve cluster` without a cluster: Ray stays out of `agentserve serve`,
a missing Ray gets an install hint and exit 2, and the pure helpers of the
Ray plumbing (merged /metrics, what counts as output for failover)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentserve.cli import build_parser, main
from agentserve.router.metrics_merge import merge_pages, with_label


def test_serve_never_imports_ray():
    code = ("import sys, agentserve.cli as c; p = c.build_parser(); p.parse_args(['serve']); "
            "print('ray' in sys.modules or any(m.startswith('ray.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cluster_without_ray_says_how_to_install_it(monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert main(["cluster", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'agentserve[cluster]'" in err and err.count("\n") == 1


def test_cluster_takes_the_serve_flags():
    args = build_parser().parse_args(["cluster", "--replicas", "3", "--router", "pow2", "--kv-cache-tokens", "9000",
                                      "--api-key", "k", "--max-queue", "7"])
    assert (args.replicas, args.router, args.kv_cache_tokens, args.api_key, args.max_queue) == (3, "pow2", 9000,
                                                                                                ["k"], 7)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cluster", "--router", "nope"])


def test_with_label_puts_the_replica_first():
    assert with_label('a_total{model_name="m"} 3.0', "replica", "r1") == 'a_total{replica="r1",model_name="m"} 3.0'
    assert with_label("a_total 3.0", "replica", "r1") == 'a_total{replica="r1"} 3.0'
    assert with_label("a{} 1", "replica", 'x"y') == 'a{replica="x\\"y"} 1'


def test_merge_pages_has_one_header_per_family():
    page = ("# HELP a_total Things.\n# TYPE a_total counter\na_total{m=\"x\"} 1.0\n"
            "# HELP g A gauge.\n# TYPE g gauge\ng 2.0\n")
    merged = merge_pages([("r1", page), ("r2", page.replace("1.0", "5.0"))])
    lines = merged.splitlines()
    assert lines == ["# HELP a_total Things.", "# TYPE a_total counter", 'a_total{replica="r1",m="x"} 1.0',
                     'a_total{replica="r2",m="x"} 5.0', "# HELP g A gauge.", "# TYPE g gauge",
                     'g{replica="r1"} 2.0', 'g{replica="r2"} 2.0']
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    assert {s.labels["replica"] for s in fams["a"].samples} == {"r1", "r2"}


def test_replica_resources_and_kv_share():
    pytest.importorskip("ray")
    from agentserve.router.cluster_app import actor_options, replica_args

    args = build_parser().parse_args(["cluster", "--replicas", "2", "--kv-cache-tokens", "32768", "--threads", "3"])
    per = replica_args(args, 2)
    assert (per.kv_cache_tokens, per.threads) == (16384, 3)
    assert actor_options(per) == {"num_cpus": 3}
    gpu = replica_args(build_parser().parse_args(["cluster", "--gpus-per-replica", "0.5"]), 2)
    assert actor_options(gpu) == {"num_cpus": 1, "num_gpus": 0.5}


def test_replicas_share_one_disk_kv_directory_and_split_its_budget(tmp_path):
    pytest.importorskip("ray")
    from agentserve.router.cluster_app import replica_args

    args = build_parser().parse_args(["cluster", "--replicas", "2", "--host-kv-tokens", "4096",
                                      "--disk-kv-dir", str(tmp_path), "--disk-kv-bytes", "1000000"])
    per = replica_args(args, 2)
    assert (per.disk_kv_shared, per.disk_kv_dir, per.disk_kv_bytes) == (True, str(tmp_path), 500000)
    assert not replica_args(build_parser().parse_args(["cluster"]), 2).disk_kv_shared


@pytest.mark.parametrize("flags, msg", [
    (["--tool-stats-interval", "-1"], "--tool-stats-interval must be 0 (off)"),
    (["--tool-stats-interval", "nan"], "--tool-stats-interval must be 0 (off)"),
    (["--disk-kv-dir", "D"], "--disk-kv-dir needs --disk-kv-bytes"),
    (["--disk-kv-dir", "D", "--disk-kv-bytes", "1000000"], "needs --host-kv-tokens"),
    (["--disk-kv-dir", "D", "--disk-kv-bytes", "1", "--host-kv-tokens", "64", "--replicas", "2"],
     "gives no byte to each of 2 replicas"),
])
def test_cluster_refuses_bad_disk_and_tool_stats_flags_in_one_line(flags, msg, capsys, tmp_path):
    pytest.importorskip("ray")
    flags = [str(tmp_path / f) if f == "D" else f for f in flags]
    assert main(["cluster", *flags]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


@pytest.mark.parametrize("flags, msg", [(["--gpus-per-replica", "-1"], "--gpus-per-replica must be 0 or more"),
                                        (["--gpus-per-replica", "1", "--device", "cpu"], "--device cpu")])
def test_cluster_refuses_bad_gpu_flags(flags, msg, capsys):
    pytest.importorskip("ray")
    assert main(["cluster", *flags]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


def test_health_before_any_replica_is_up_is_a_quiet_503():
    pytest.importorskip("ray.serve")
    import asyncio

    from ray.serve.exceptions import DeploymentUnavailableError

    from agentserve.router.ingress import Ingress

    class Starting:  # the replicas' handle while Serve has none running yet
        def broadcast(self, *a):
            raise DeploymentUnavailableError(None)

    ing = Ingress(Starting(), {}, 1 << 20, 2)
    r = asyncio.run(ing._health())
    assert r.status_code == 503 and b"0 of 2 engine replicas healthy" in r.body
    m = asyncio.run(ing._metrics([]))
    assert m.status_code == 200 and b"agentserve:cluster_replicas_answering 0" in m.body

"""The pure-Python layers never import torch (DESIGN.md), and nothing below the
server reads the wall clock: time comes from an injected clock."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "src" / "agentserve"
PURE = ["policy", "kv", "engine", "sim", "bench", "server"]
NO_CLOCK = ["policy", "kv", "engine"]


def _modules(layer):
    return sorted((PKG / layer).rglob("*.py"))


def _imports(path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


@pytest.mark.parametrize("layer", PURE)
def test_pure_layers_do_not_import_torch(layer):
    files = _modules(layer)
    assert files, f"layer {layer} has no modules"
    bad = [f"{p.relative_to(PKG)} imports {m}" for p in files for m in _imports(p)
           if m == "torch" or m.startswith("torch.")]
    assert not bad, bad


@pytest.mark.parametrize("layer", NO_CLOCK)
def test_no_wall_clock_below_the_server(layer):
    bad = []
    for p in _modules(layer):
        src = p.read_text()
        for call in ("time.time(", "time.monotonic(", "time.perf_counter(", "datetime.now("):
            if call in src:
                bad.append(f"{p.relative_to(PKG)} calls {call}")
    assert not bad, bad


def test_checker_catches_a_torch_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom torch import nn\n")
    assert "torch" in list(_imports(f))

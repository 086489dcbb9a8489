"""The layout's rules (docs/architecture.md, "The code, one sentence a module"):

- imports run downward only: no import cycle between agentserve's modules, and
  none between its packages (each subpackage, each top-level module a node);
  every import, including those inside functions and under TYPE_CHECKING, is an
  edge, and each goes to a lower layer of `LAYERS`;
- the entry points (`llm.py`, `cli*.py`, the package root) may import anything,
  and nothing below them imports them;
- the torch-free layers never import torch, directly or through another module:
  each of their modules is imported in a subprocess where `import torch` fails;
- nothing below the server, nor the router, reads the wall clock: time comes from an injected clock;
- no module in engine/, kv/, policy/, server/, router/ grows much past 400 lines;
- the architecture page's module map lists every module, and only modules that exist;
- `benchmarks/` (the research measurements, beside src/) sits above the whole
  package: it imports agentserve, nothing in agentserve imports it, its modules
  form no import cycle, and none imports torch (they reach the runner and the
  offline `LLM` through agentserve, inside functions), so each imports without it.
"""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from collections import defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "agentserve"
TORCH_FREE = ["policy", "kv", "engine", "cost", "workload", "sim", "bench", "server", "router",
              "clock.py", "argtypes.py", "cli_errors.py", "text_table.py"]
NO_CLOCK = ["policy", "kv", "engine", "cost", "router"]

# Lowest first. A package or top-level module imports only from lower layers
# (and from itself); two names in one layer do not import each other.
LAYERS = [
    {"clock", "argtypes", "cli_errors", "cli_examples", "text_table"},  # leaves: the injected clocks, argparse types, the CLI's error type and examples, tables
    {"kv"},
    {"policy"},
    {"engine"},
    {"cost", "workload"},  # step costs and profiles; workloads and traces
    {"runner", "sim"},  # the real executor; the simulated one
    {"server"},
    {"integrations"},  # agentserve's policy inside other engines (vLLM's scheduler); imports the policy layer
    {"router"},  # scale-out: routing over replicas (engines, identity rules, the simulator); its Ray Serve plumbing
    {"llm"},  # the offline API: entry point
    {"bench"},  # what `agentserve bench` runs: servers over HTTP, the KV manager alone
    # entry points; "agentserve" is the package root (its lazy LLM export)
    {"agentserve", "cli_model", "cli_bench"},
    {"cli_serve"},
    {"cli_cluster"},
    {"cli"},
]
ENTRY_POINTS = {"llm", "cli", "cli_model", "cli_serve", "cli_cluster", "cli_bench", "agentserve"}
LLM_USERS = ENTRY_POINTS


# --- the import graph ---

def _module_name(path: pathlib.Path, src: pathlib.Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_files(src: pathlib.Path = SRC, top: str = "agentserve") -> dict[str, pathlib.Path]:
    return {_module_name(p, src): p for p in sorted((src / top).rglob("*.py"))}


def _imported_names(module: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """(dotted name, line) for every import statement in the file, wherever it is.
    `from a.b import c` yields a.b and a.b.c (c may be a module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def import_graph(src: pathlib.Path = SRC, top: str = "agentserve") -> dict[str, dict[str, int]]:
    """module -> {imported module of the same project: line of the first such import}."""
    files = _module_files(src, top)
    graph: dict[str, dict[str, int]] = {m: {} for m in files}
    for m, path in files.items():
        for name, line in _imported_names(m, path):
            while name and name not in files:  # a.b.func -> a.b
                name = name.rpartition(".")[0]
            if name and name != m:
                graph[m].setdefault(name, line)
    return graph


def cycles(graph: dict[str, set[str] | dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def unit(module: str) -> str:
    """The package-level node of a module: its subpackage, or the top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unit_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, list[str]]]:
    """unit -> {imported unit: ["module:line -> module", ...]}."""
    out: dict[str, dict[str, list[str]]] = defaultdict(dict)
    for a, targets in graph.items():
        out[unit(a)]
        for b, line in targets.items():
            ua, ub = unit(a), unit(b)
            if ua != ub:
                out[ua].setdefault(ub, []).append(f"{a}:{line} -> {b}")
    return out


def _explain(comp: list[str], edges) -> list[str]:
    return [f"{a} -> {b}" + (f" ({edges[a][b]})" if isinstance(edges[a], dict) else "")
            for a in comp for b in sorted(edges[a]) if b in comp]


GRAPH = import_graph()
UNITS = unit_graph(GRAPH)


def test_the_graph_sees_every_kind_of_import():
    g = GRAPH
    assert "agentserve.engine.scheduler" in g["agentserve.engine.llm_engine"]  # top-level, absolute
    assert "agentserve.cli_errors" in g["agentserve.bench.replay"]  # inside a function
    assert "agentserve.kv.pins" in g["agentserve.policy.base"]  # under TYPE_CHECKING
    assert "agentserve.server.engine_snapshot" in g["agentserve.server.stats_log"]


def test_no_import_cycle_between_modules():
    found = cycles(GRAPH)
    assert not found, "\n".join(f"cycle {c}: " + "; ".join(_explain(c, GRAPH)) for c in found)


def test_no_import_cycle_between_packages():
    assert {"policy", "kv", "engine", "runner", "sim", "bench", "server", "llm", "cli"} <= set(UNITS)
    found = cycles(UNITS)
    assert not found, "\n".join(f"cycle {c}: " + "; ".join(e for a in c for b in UNITS[a] if b in c
                                                          for e in UNITS[a][b]) for c in found)


def test_every_package_and_top_level_module_has_a_layer():
    layered = set().union(*LAYERS)
    assert set(UNITS) <= layered, f"put {sorted(set(UNITS) - layered)} in LAYERS"


def test_imports_run_downward():
    rank = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    bad = [e for a, targets in UNITS.items() for b, edges in targets.items()
           if rank.get(b, 0) >= rank.get(a, 0) for e in edges]
    assert not bad, "\n".join(bad)


def test_nothing_below_the_entry_points_imports_them():
    bad = [e for a, targets in UNITS.items() if a not in ENTRY_POINTS for b, edges in targets.items()
           if b in ENTRY_POINTS and not (b == "llm" and a in LLM_USERS) for e in edges]
    assert not bad, "\n".join(bad)


def test_cycle_finder_on_a_known_graph(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.a\n")
    (pkg / "d.py").write_text("import p.c\n")
    g = import_graph(tmp_path, "p")
    assert cycles(g) == [["p.a", "p.c", "p.sub.b"]]
    assert cycles(unit_graph(g)) == [["a", "c", "sub"]]


# --- torch ---

_IMPORT_ALL = textwrap.dedent("""
    import importlib, json, sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"import of {name} (torch is blocked in this check)")
            return None

    sys.meta_path.insert(0, NoTorch())
    failed = {}
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
        except BaseException as e:
            failed[name] = f"{type(e).__name__}: {e}"
    print(json.dumps({"failed": failed, "torch_loaded": "torch" in sys.modules}))
""")


def import_without_torch(modules: list[str], src: pathlib.Path = SRC) -> dict:
    """Import `modules` in order in one fresh interpreter where `import torch` fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *modules], capture_output=True, text=True,
                          env=env, timeout=300, cwd=src)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _torch_free_modules() -> list[str]:
    """The torch-free layers' modules; without Ray (the optional `cluster` extra), not those that import it."""
    import importlib.util

    ray_missing = importlib.util.find_spec("ray") is None
    out = []
    for layer in TORCH_FREE:
        files = [PKG / layer] if layer.endswith(".py") else sorted((PKG / layer).rglob("*.py"))
        assert files and files[0].exists(), f"layer {layer} has no modules"
        out += [_module_name(p) for p in files if not (ray_missing and _imports_ray(p))]
    return out


def _imports_ray(path: pathlib.Path, src: pathlib.Path = SRC) -> bool:
    return any(m == "ray" or m.startswith("ray.") for m, _ in _imported_names(_module_name(path, src), path))


def test_torch_free_layers_import_without_torch():
    mods = _torch_free_modules()
    assert len(mods) > 50
    res = import_without_torch(mods)
    assert not res["failed"], "\n".join(f"{m}: {e}" for m, e in res["failed"].items())
    assert not res["torch_loaded"]


def test_torch_free_check_catches_an_indirect_import(tmp_path):
    pkg = tmp_path / "indirect"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "uses_torch.py").write_text("import torch.nn\n")
    (pkg / "innocent.py").write_text("from indirect import uses_torch\n")
    (pkg / "lazy.py").write_text("def f():\n    import torch\n")
    res = import_without_torch(["indirect.lazy", "indirect.innocent"], tmp_path)
    assert list(res["failed"]) == ["indirect.innocent"] and "torch" in res["failed"]["indirect.innocent"]


def _files(layer):
    return [PKG / layer] if layer.endswith(".py") else sorted((PKG / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", TORCH_FREE)
def test_torch_free_layers_never_import_torch_even_lazily(layer):
    bad = [f"{p.relative_to(PKG)}:{line} imports {m}" for p in _files(layer)
           for m, line in _imported_names(_module_name(p), p) if m == "torch" or m.startswith("torch.")]
    assert not bad, bad


@pytest.mark.parametrize("layer", NO_CLOCK)
def test_no_wall_clock_below_the_server(layer):
    bad = []
    for p in _files(layer):
        src = p.read_text()
        for call in ("time.time(", "time.monotonic(", "time.perf_counter(", "datetime.now("):
            if call in src:
                bad.append(f"{p.relative_to(PKG)} calls {call}")
    assert not bad, bad



# --- the module map of the architecture page ---

def _map_rows() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    text = text[text.index("## The code, one sentence a module"):]
    return [line for line in text.splitlines() if line.startswith("| `")]


def test_module_map_lists_every_module_and_nothing_else():
    listed: set[pathlib.Path] = set()
    stale = []
    for row in _map_rows():
        first = row.split("|")[1]
        for entry in re.findall(r"`([^`]+)`", first):
            base = ROOT if entry.startswith(("examples/", "tests/", "benchmarks/")) else PKG
            hits = [p for p in base.glob(entry.rstrip("/")) if p.exists()]
            if not hits:
                stale.append(entry)
            for h in hits:
                listed |= set(h.rglob("*")) if h.is_dir() else {h}
    missing = []
    for p in sorted(PKG.rglob("*.py")) + sorted(BENCHMARKS.rglob("*.py")):
        body = ast.parse(p.read_text()).body
        if p.name == "__init__.py" and all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                                           for n in body):
            continue  # an empty package marker
        if p not in listed:
            missing.append(str(p.relative_to(PKG if PKG in p.parents else ROOT)))
    assert not missing, f"modules missing from docs/architecture.md's module map: {missing}"
    assert not stale, f"docs/architecture.md's module map lists what does not exist: {stale}"


# --- benchmarks/, outside the package ---

BENCHMARKS = ROOT / "benchmarks"


def test_nothing_in_agentserve_imports_benchmarks():
    bad = [f"{p.relative_to(SRC)}:{line} imports {m}" for m, p in _module_files().items()
           for name, line in _imported_names(m, p) if name == "benchmarks" or name.startswith("benchmarks.")]
    assert not bad, bad


def test_benchmarks_have_no_import_cycle():
    graph = import_graph(ROOT, "benchmarks")
    assert len(graph) > 15
    found = cycles(graph)
    assert not found, "\n".join(f"cycle {c}: " + "; ".join(_explain(c, graph)) for c in found)


def test_benchmarks_never_import_torch_and_import_without_it():
    files = _module_files(ROOT, "benchmarks")
    direct = [f"{p.relative_to(ROOT)}:{line} imports {m}" for name, p in files.items()
              for m, line in _imported_names(name, p) if m == "torch" or m.startswith("torch.")]
    assert not direct, direct
    import importlib.util

    ray_missing = importlib.util.find_spec("ray") is None
    mods = [m for m, p in files.items() if not (ray_missing and _imports_ray(p, ROOT))]
    res = import_without_torch(mods, ROOT)
    assert not res["failed"], "\n".join(f"{m}: {e}" for m, e in res["failed"].items())
    assert not res["torch_loaded"]


# --- module size ---

SIZED = ["engine", "kv", "policy", "server", "router"]
MAX_LINES = 420  # "about 400": split a module where its ideas end before it grows past this


def test_no_module_over_about_400_lines_in_the_core():
    big = [f"{p.relative_to(PKG)}: {n} lines" for layer in SIZED for p in _files(layer)
           if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, big

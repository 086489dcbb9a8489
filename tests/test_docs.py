"""The documentation: the site builds in strict mode (every internal link and
anchor resolves, the generated reference pages render), the README's links
point at pages that exist, and every example marked runnable runs.

An example is marked by a line `<!-- runnable -->` right before its fence.
Examples that talk to a server at 127.0.0.1:8000 run against a tiny test
server instead (its URL and its model name 'tiny' put in), and a line that
starts that server (`agentserve serve`) is left out; the others run as they
are."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from server_fixtures import start_tiny_server

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_RUNNABLE = re.compile(r"<!-- runnable -->\n```(\w+)\n(.*?)\n```", re.S)


def _examples() -> list[tuple[str, str, str]]:
    return [(f"{p.relative_to(ROOT)}#{i}", lang, code) for p in PAGES
            for i, (lang, code) in enumerate(_RUNNABLE.findall(p.read_text()))]


def test_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "agentserve serve" in cli and "--kv-cache-tokens" in cli  # generated from the parsers
    api = (tmp_path / "site" / "reference" / "http-api" / "index.html").read_text()
    assert "/v1/responses" in api and "/v1/messages" in api  # generated from the OpenAPI document


def test_readme_links_point_at_files_that_exist():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into the docs"
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert not missing, missing


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_examples_marked_runnable_are_found():
    langs = {lang for _, lang, _ in _examples()}
    assert {"bash", "python"} <= langs, "the README's first request is marked runnable in both forms"


@pytest.fixture(scope="module")
def server():
    srv, _, _ = start_tiny_server(api_key=None, positions=2048)
    yield srv
    srv.stop()


@pytest.mark.parametrize("name,lang,code", _examples(), ids=[e[0] for e in _examples()])
def test_runnable_example(name, lang, code, server, tmp_path):
    code = code.replace("http://127.0.0.1:8000", server.url).replace("SmolLM2-135M-Instruct", "tiny")
    if lang == "bash":
        code = "\n".join(line for line in code.splitlines() if not line.startswith("agentserve serve"))
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        cmd = [sys.executable, "-c", code]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{name} failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    assert '"error"' not in run.stdout, f"{name} got an error from the server:\n{run.stdout[-2000:]}"

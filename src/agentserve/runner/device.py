"""Choosing the device, the dtype and the KV capacity when the user says "auto"."""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}

CPU_DEFAULT_KV_TOKENS = 65536


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but CUDA is not available here")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported (cpu, cuda, auto)")
    return dev


def cpu_has_native_bf16() -> bool:
    """bfloat16 matmuls only pay off with AVX512-BF16 or AMX; elsewhere they are emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    try:
        dtype = DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported ({', '.join(sorted(DTYPES))}, auto)") from None
    if dtype is torch.float16 and device.type == "cpu":
        raise ValueError("float16 is not supported on the CPU; use bfloat16 or float32")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def auto_kv_tokens(device: torch.device, bytes_per_token: int, weight_bytes: int,
                   memory_fraction: float = 0.85) -> int:
    """KV capacity in tokens: on CUDA, what is left of `memory_fraction` of the GPU
    after the weights and an activation reserve; on the CPU, 65536 tokens or a
    quarter of the available memory, whichever is smaller."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = 2 * 1024**3
        budget = min(free, int(total * memory_fraction)) - weight_bytes - reserve
        return max(budget // bytes_per_token, 0)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 * 1024**3
    return int(min(CPU_DEFAULT_KV_TOKENS, avail // 4 // bytes_per_token))

"""Choosing the device, the dtype, the weight format and the KV capacity when
the user says "auto"."""

from __future__ import annotations

import logging
import os

import torch

from agentserve.runner.native import cpu_has_native_bf16

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}

CPU_DEFAULT_KV_TOKENS = 65536

# --weights: native = GGUF Q4_0/Q4_1/Q8_0, Q5_0/Q5_1 and K-quant tensors stay as
# stored where a kernel here takes them (see gguf_linear.codes_linear);
# bf16 / fp32 = everything dequantized to that dtype; auto = native where it works.
WEIGHT_FORMATS = ("auto", "native", "bf16", "fp32")
_FORMAT_DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}

log = logging.getLogger("agentserve")


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but CUDA is not available here")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported (cpu, cuda, auto)")
    return dev


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


def plan_weights(weights: str, dtype: str, device: torch.device) -> tuple[bool, torch.dtype]:
    """Before loading: whether to keep GGUF codes as stored, and the compute dtype.

    `bf16` and `fp32` fix the compute dtype, so an explicit `dtype` that contradicts
    them is an error. `native` computes in the dtype asked for (bfloat16 or
    float32); at `auto` in bfloat16 where the CPU has native bf16 and in float32
    where it has not (there bf16 is emulated: the float32 copy a prefill
    multiplies runs several times faster than a bf16 one). `native` on a device
    without a kernel for kept codes falls back to dequantized weights in that
    dtype with one log line. `auto` is native where a kernel for kept codes
    exists (agentserve's AVX512-VNNI or AVX2 one, or torch's int4), unless
    float32 was asked for by name: that is the path that matches transformers
    exactly. (Whether the model has such tensors is known after loading, see
    `settle_weights`.)"""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    if weights == "auto":
        dt = resolve_dtype(dtype, device)
        exact = dtype != "auto" and dt is torch.float32
        return dt in (torch.bfloat16, torch.float32) and not exact and _int4_unavailable(device) is None, dt
    if weights != "native":
        want = _FORMAT_DTYPE[weights]
        if dtype != "auto" and DTYPES.get(dtype) is not want:
            raise ValueError(f"weights {weights} compute in {dtype_name(want)}, but dtype {dtype} was asked for "
                             f"(leave dtype at auto)")
        return False, resolve_dtype(dtype_name(want), device)
    dt = resolve_dtype(dtype, device)
    why = _int4_unavailable(device)
    if why is not None:
        log.warning("weights native: %s; using dequantized %s weights", why, dtype_name(dt))
        return False, dt
    if dt not in (torch.bfloat16, torch.float32):
        raise ValueError(f"weights native compute in bfloat16 or float32, but dtype {dtype} was asked for")
    return True, dt


KV_DTYPES = ("auto", "bfloat16", "float32")


def resolve_kv_dtype(kv_dtype: str, compute: torch.dtype, native: bool) -> torch.dtype:
    """The KV cache's dtype. auto: the compute dtype, except float32 compute with
    native weights (a CPU without native bf16), where the cache is bfloat16 as
    llama.cpp keeps its f16 cache under float32 compute: half the bytes, so
    twice the tokens in the same memory, and the weights are approximate there
    anyway. Dequantized float32 weights keep a float32 cache: the exact path.
    float32 needs float32 compute (a cache finer than the compute adds nothing)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "auto":
        return torch.bfloat16 if compute is torch.float32 and native else compute
    want = DTYPES[kv_dtype]
    if want is torch.float32 and compute is not torch.float32:
        raise ValueError(f"a float32 KV cache needs float32 compute, but the model computes in "
                         f"{dtype_name(compute)} (pass --dtype float32, or leave --kv-dtype at auto)")
    return want


def settle_weights(weights: str, native: bool, loaded) -> bool:
    """After loading with `keep_quantized=native`: whether the model has tensors a
    kernel here runs natively (Q4_0/Q4_1 anywhere `plan_weights` said native;
    Q8_0 with the AVX512-VNNI or the AVX2 block kernel; Q5_0, Q5_1, Q4_K, Q5_K,
    Q6_K with the block kernel). An explicit `native` that cannot be honoured
    logs one line why."""
    if not native:
        return False
    from agentserve.runner.gguf_linear import block_available
    from agentserve.runner.linear import q8_available
    from agentserve.runner.quant import BLOCK_TYPES, Q4_TYPES, Q8_TYPES, BlockWeight, Q4Weight, Q8Weight

    cpu = torch.device("cpu")
    kinds: tuple[type, ...] = (Q4Weight,)
    types = dict(Q4_TYPES)
    if q8_available(cpu) or block_available(cpu):
        kinds, types = kinds + (Q8Weight,), dict(types, **Q8_TYPES)
    if block_available(cpu):
        kinds, types = kinds + (BlockWeight,), dict(types, **BLOCK_TYPES)
    if any(isinstance(w, kinds) for w in loaded.weights.values()):
        return True
    if weights == "native":
        found = loaded.tensor_types
        if not found:
            why = f"{loaded.source} is not a GGUF file (native weights are GGUF {'/'.join(types)} tensors)"
        elif not set(found) & set(types):
            why = (f"its GGUF tensor types ({', '.join(found)}) have no native kernel here "
                   f"(only {', '.join(types)} do)")
        else:
            why = "the loaded weights were dequantized already (load with keep_quantized=True)"
        log.warning("weights native: %s; using dequantized weights", why)
    return False


def _int4_unavailable(device: torch.device) -> str | None:
    from agentserve.runner.linear import int4_unavailable

    return int4_unavailable(device)

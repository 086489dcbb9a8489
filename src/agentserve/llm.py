"""The offline Python API: `LLM(model=...).generate(prompts, params)` and
`.chat(messages, tools=...)`. It assembles the same pieces the server runs
(loader, model, paged KV tensors, KV manager, scheduler with a policy, engine)
and drives the step loop until the given requests finish."""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from agentserve.clock import WallClock
from agentserve.engine.attention_shape import AttentionShape
from agentserve.engine.llm_engine import LLMEngine, RequestOutput
from agentserve.engine.sampling_params import SamplingParams
from agentserve.engine.scheduler import Scheduler, SchedulerConfig
from agentserve.engine.spec_decode import SpecConfig
from agentserve.kv.manager import KVCacheManager
from agentserve.policy.toolcalls import ToolCall, parse_tool_calls
from agentserve.runner import device as devices
from agentserve.runner.checkpoint import LoadedModel
from agentserve.runner.cuda_graphs import DecodeGraphs
from agentserve.runner.executor import ModelExecutor
from agentserve.runner.kv_cache import PagedKVCache, kv_layout_for
from agentserve.runner.gguf_linear import BLOCK_MAX_ROWS
from agentserve.runner.loader import load_model
from agentserve.runner.model import LlamaModel
from agentserve.runner.profiling import tier_costs_for
from agentserve.runner.shared_kv import SharedKVDir
from agentserve.runner.tokenizer import IncrementalDetokenizer
from agentserve.server.chat_template import ChatTemplate

log = logging.getLogger("agentserve")


@dataclass
class ChatOutput:
    text: str  # the reply with tool-call markup removed when calls were parsed
    tool_calls: list[ToolCall]
    output: RequestOutput
    prompt: str = field(repr=False, default="")


class LLM:
    def __init__(self, model: str | LoadedModel | None = None, *, dtype: str = "auto", device: str = "auto",
                 kv_cache_tokens: int | None = None, host_kv_tokens: int = 0, block_size: int = 16,
                 disk_kv_bytes: int = 0, disk_kv_dir: str | None = None, disk_kv_shared: bool = False,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 max_step_ms_with_decodes: float | None = 200.0,
                 policy: str = "agentserve", policy_options: dict | None = None, profile: str | None = None,
                 threads: int | None = None, pack_weights: bool | None = None, weights: str = "auto",
                 speculate: int = 8, group_prefill: bool = True, overlap_copies: bool = True,
                 protected_kv_share: float = 0.0, kv_layout: str = "auto", kv_dtype: str = "auto",
                 enforce_eager: bool = False) -> None:
        """`weights`: "native" keeps a GGUF's Q4_0/Q4_1 tensors 4-bit (int4 kernel for
        decode, bf16 compute), "bf16"/"fp32" dequantize everything to that dtype, "auto"
        is native where the model and machine allow it, else `dtype` decides.
        `speculate`: draft tokens a decode step may verify per request (prompt
        lookup, engine/spec_decode.py); 0 turns speculation off. `group_prefill`:
        a request waits for a running one's prefill of their shared prefix.
        `overlap_copies`: the KV tiers' copies run on a copy engine beside the
        forward pass (runner/copy_engine.py) instead of inside the step.
        `protected_kv_share`: the share of device blocks kept for multi-turn
        programs between turns (kv/protected_zone.py; 0: none). `kv_layout`:
        "hybrid" keeps a sliding-window layer's KV only while a token can read
        it (kv/window_parts.py), "full" every layer's, "auto" hybrid where the
        model has window and global layers and no tier is asked for. `kv_dtype`:
        the KV cache's dtype (`devices.resolve_kv_dtype`: auto is the compute
        dtype, bfloat16 under float32 compute with native weights). `enforce_eager`:
        on CUDA, no decode graphs (runner/cuda_graphs.py) are captured."""
        if speculate < 0:
            raise ValueError(f"speculate must be >= 0 (0: off), got {speculate}")
        if threads:
            torch.set_num_threads(threads)
        self.device = devices.resolve_device(device)
        native, self.dtype = devices.plan_weights(weights, dtype, self.device)
        loaded = model if isinstance(model, LoadedModel) else load_model(model, keep_quantized=native)
        native = devices.settle_weights(weights, native, loaded)
        self.model_source = loaded.source
        self.config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.model = LlamaModel(cfg, loaded.weights, self.dtype, self.device, self.max_model_len, pack_weights,
                                quantized=native)
        template = loaded.chat_template
        del loaded  # the float32 (or 4-bit) copies of the weights
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.kv_dtype = devices.resolve_kv_dtype(kv_dtype, self.dtype, self.model.weight_format == "native")
        per_token = cfg.kv_bytes_per_token(self.kv_dtype.itemsize)
        if kv_cache_tokens is None:
            kv_cache_tokens = devices.auto_kv_tokens(self.device, per_token, self.model.weight_bytes)
        layout = kv_layout_for(kv_layout, self.model.windows, disk=disk_kv_bytes > 0)
        slots = cfg.num_layers if layout is None else layout.slots  # layers a block holds: fewer, more blocks
        num_blocks = kv_cache_tokens * cfg.num_layers // (slots * block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_tokens {kv_cache_tokens} gives no block of {block_size} tokens")
        host_blocks = host_kv_tokens * cfg.num_layers // (slots * block_size)  # the same bytes, in either layout
        self.kv_cache = PagedKVCache(cfg, num_blocks, block_size, host_blocks, self.kv_dtype, self.device, layout)
        disk_blocks = 0 if disk_kv_shared else self._disk_tier(disk_kv_bytes, disk_kv_dir)
        if not 0.0 <= protected_kv_share <= 0.9:
            raise ValueError(f"protected_kv_share must be in [0, 0.9], got {protected_kv_share}")
        if self.device.type == "cuda" and not enforce_eager:
            self.model.graphs = DecodeGraphs.capture_for(self.model, self.kv_cache, max_num_seqs, self.max_model_len)
        self.kv = KVCacheManager(num_blocks, block_size, host_blocks=host_blocks, disk_blocks=disk_blocks,
                                 protected_blocks=int(protected_kv_share * num_blocks),
                                 window=layout and layout.window, window_pages=layout.pages if layout else 0)
        longest = self.kv.pages_for(self.max_model_len)
        if longest > num_blocks:
            log.warning("KV cache of %d tokens holds less than one request of max_model_len %d, which needs "
                        "--kv-cache-tokens %d: longer requests will be refused", kv_cache_tokens,
                        self.max_model_len, -(-longest * slots * block_size // cfg.num_layers))
        if layout is not None:
            log.info("hybrid KV cache: %d global and %d window layers (window %d): %d blocks of %d layers; a "
                     "block of tokens takes 1 block, its window part %d more while a token can read it",
                     layout.group.count(0), cfg.num_layers - layout.group.count(0), layout.window, num_blocks,
                     layout.slots, layout.pages)
        self.clock = WallClock()
        sconf = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                max_model_len=self.max_model_len, max_step_ms_with_decodes=max_step_ms_with_decodes,
                                group_prefill=group_prefill, speculation=SpecConfig(max_draft=speculate),
                                overlap_copies=overlap_copies, attention_shape=AttentionShape.of(self.model.windows))
        prefill_cost, tier_reload = tier_costs_for(profile, self)
        self.reload_cost = tier_reload["host"] if host_blocks > 0 else prefill_cost  # the paper's Prefill-Reload
        self.scheduler = Scheduler(sconf, self.kv, policy, self.clock, self.reload_cost, policy_options,
                                   prefill_cost=prefill_cost, tier_reload=tier_reload)
        self.executor = ModelExecutor(self.model, self.kv_cache, overlap_copies)
        tok = self.tokenizer
        self.engine = LLMEngine(self.scheduler, self.executor, self.clock,
                                detokenizer=lambda: IncrementalDetokenizer(tok),
                                eos_token_ids=cfg.eos_token_ids or tok.eos_token_ids)
        self.shared_kv = self._shared_kv(disk_kv_bytes, disk_kv_dir) if disk_kv_shared else None
        self.engine.kv_share = self.shared_kv
        self._tool_grammars = None
        self.chat_template = ChatTemplate(template, tok.bos_token or "", tok.eos_token or "")
        log.info("model %s on %s (%s, weights %s): %d layers, %.1fM parameters; KV cache %d tokens (%.1f MiB, %s) "
                 "in blocks of %d, host tier %d tokens; policy %s", self.model_source, self.device,
                 devices.dtype_name(self.dtype), self._weights_summary(), cfg.num_layers, cfg.num_params() / 1e6,
                 num_blocks * block_size, self.kv_cache.bytes / 2**20, devices.dtype_name(self.kv_dtype), block_size,
                 host_blocks * block_size, self.scheduler.policy.name)

    def _disk_tier(self, disk_kv_bytes: int, disk_kv_dir: str | None) -> int:
        """Set up the disk KV tier (below the host tier): its number of block files."""
        if not disk_kv_bytes:
            return 0
        if disk_kv_bytes < 0 or not disk_kv_dir:
            raise ValueError("the disk KV tier needs a byte budget > 0 and a directory")
        if self.kv_cache.host_kv is None:
            raise ValueError("the disk KV tier needs a host tier (set the host KV tokens too)")
        try:
            store = self.kv_cache.attach_disk(disk_kv_dir)
            probe = store.dir / ".agentserve-write-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"disk KV directory {disk_kv_dir!r} is not usable: {e.strerror or e}") from None
        blocks = disk_kv_bytes // store.file_bytes
        if blocks < 1:
            raise ValueError(f"disk KV budget of {disk_kv_bytes} bytes holds no block file ({store.file_bytes} bytes)")
        log.info("disk KV tier: %d blocks (%.1f MiB) in %s", blocks, blocks * store.file_bytes / 2**20, disk_kv_dir)
        return blocks

    def _shared_kv(self, disk_kv_bytes: int, disk_kv_dir: str | None) -> SharedKVDir:
        if disk_kv_bytes <= 0 or not disk_kv_dir:
            raise ValueError("the shared KV directory needs a byte budget > 0 and a directory")
        if self.kv_cache.host_kv is None:
            raise ValueError("the shared KV directory needs a host tier (set the host KV tokens too)")
        try:
            shared = SharedKVDir(self.kv_cache, self.kv, disk_kv_dir, disk_kv_bytes, self.model_source)
        except OSError as e:
            raise ValueError(f"disk KV directory {disk_kv_dir!r} is not usable: {e.strerror or e}") from None
        log.info("shared KV directory %s: this server writes up to %d block files (%.1f MiB)", disk_kv_dir,
                 shared.owned.capacity, shared.owned.capacity * shared.file_bytes / 2**20)
        return shared

    def _weights_summary(self) -> str:
        m = self.model
        if m.weight_format != "native":
            return m.weight_format
        parts = [f"{m.int4_linears} of {m.num_linears} projections int4 ({m.int4_kernel} kernel) "
                 f"up to {m.int4_max_rows} rows a step"] if m.int4_linears else []
        if m.q8_linears:
            parts.append(f"{m.q8_linears} Q8_0")
        if m.block_linears:
            parts.append(f"{m.block_linears} of {m.num_linears} on the GGUF block kernel up to "
                         f"{BLOCK_MAX_ROWS} rows a step")
        return (f"native: {', '.join(parts)}, "
                f"bf16 above; {m.weight_bytes / 2**20:.0f} MiB read a decode step, "
                f"{m.resident_weight_bytes / 2**20:.0f} MiB held")

    # --- generation ---

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 program_ids: list[str | None] | None = None) -> list[RequestOutput]:
        """Complete each prompt (text or token ids); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling parameter sets")
        pids = program_ids or [None] * len(prompts)
        rids = []
        for prompt, p, pid in zip(prompts, plist, pids):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rids.append(self.engine.add_request(ids, p, program_id=pid).request_id)
        return self._run(rids)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
             tools: list[dict[str, Any]] | None = None, program_id: str | None = None,
             end_program: bool = False, tool_choice: str | None = None) -> ChatOutput:
        """One chat turn. Reusing `program_id` across turns keeps the program's KV
        between them (the policy decides for how long). `tool_choice` "required"
        or a function name forces one valid call (constrained decoding)."""
        prompt = self.chat_template.render(messages, tools=tools)
        ids = self.tokenizer.encode(prompt)
        p = params or SamplingParams(max_tokens=256, temperature=0.0)
        if tool_choice not in (None, "auto", "none"):
            if not tools:
                raise ValueError("tool_choice needs tools")
            p = dataclasses.replace(p, constraint=self.tool_call_constraint(
                tools, None if tool_choice == "required" else tool_choice))
        req = self.engine.add_request(ids, p, program_id=program_id, is_last_turn=end_program)
        out = self._run([req.request_id])[0]
        calls = parse_tool_calls(out.text) if tools else []
        text = strip_tool_markup(out.text) if calls else out.text
        return ChatOutput(text, calls, out, prompt)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        want = set(request_ids)
        done: dict[str, RequestOutput] = {}
        while want - done.keys():
            for o in self.engine.step():
                if o.finished and o.request_id in want:
                    done[o.request_id] = o
        self.settle_copies()
        if self.shared_kv is not None:  # the turns written through, as `settle_copies` does for the tiers
            self.shared_kv.flush(timeout=60.0)
        return [done[r] for r in request_ids]

    def settle_copies(self) -> None:
        """Wait for the tier copies in flight and count them (the offline API
        returns with the tiers as they will be, not mid-copy)."""
        sched = self.scheduler
        while sched.copies_in_flight:
            sched.copies_done(self.executor.poll_copies(wait=1.0))

    def tool_call_constraint(self, tools: list[dict[str, Any]], name: str | None = None):
        """A constraint for SamplingParams.constraint that holds the output to one
        valid call of one of `tools` (or of the function `name`). Needs xgrammar."""
        return self._grammars().constraint(tools, name)

    def json_constraint(self, schema: dict[str, Any] | None, strict: bool = False,
                        tools: list[dict[str, Any]] | None = None):
        """A constraint for SamplingParams.constraint that holds the output to one JSON
        value following `schema` (None: any JSON object); `strict`: no property or item
        the schema does not declare. With `tools`, one valid call of one of them is
        allowed instead. A schema the grammar cannot use raises GrammarError (a
        ValueError naming the culprit in `param`). Needs xgrammar."""
        return self._grammars().json_constraint(schema, strict, tools)

    def _grammars(self):
        if self._tool_grammars is None:  # a benign race: two threads may both build one
            from agentserve.runner.structured import ToolGrammars

            eos = list(self.engine.eos_token_ids) or list(self.tokenizer.eos_token_ids)
            self._tool_grammars = ToolGrammars(self.tokenizer, self.config.vocab_size, eos)
        return self._tool_grammars

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


def strip_tool_markup(text: str) -> str:
    """The reply text without the Hermes `<tool_call>` blocks (they become `tool_calls`)."""
    return re.sub(r"<tool_call>.*?(</tool_call>|$)", "", text, flags=re.S).strip()

"""A Llama-family decoder (RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP, tied or untied embeddings) whose attention reads and writes the
paged KV cache, over a flattened mixed batch of prefill chunks and decode tokens.

Weights arrive in Hugging Face names; the q/k/v and gate/up projections are
fused into one matrix each, so a layer runs four matrix multiplies. With
`quantized`, projections whose weights came as GGUF Q4_0/Q4_1 (`quant.Q4Weight`)
stay 4-bit and run on an int4 kernel (`linear.Q4Linear`), Q8_0 ones (SmolLM2's
tied LM head) on the Q8_0 kernel where it is built (`linear.Q8Linear`);
everything else is
dequantized to the compute dtype. The norms
follow transformers exactly (statistics in float32, cast back before the weight
is applied), which is what makes the float32 path token-exact against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentserve.runner.attention import AttentionMetadata, attend_native, paged_attention
from agentserve.runner.config import ModelConfig
from agentserve.runner.kv_cache import PagedKVCache
from agentserve.runner.layer_ops import LayerOps
from agentserve.runner.linear import Linear, Q4Linear, Q8Linear, codes_linear, int4_unavailable, should_pack
from agentserve.runner.quant import QuantWeight, is_quantized
from agentserve.runner.rope import RotaryTable, apply_rotary


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear | Q4Linear | Q8Linear
    o: Linear | Q4Linear | Q8Linear
    post_norm: torch.Tensor
    gate_up: Linear | Q4Linear | Q8Linear
    down: Linear | Q4Linear | Q8Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor | QuantWeight], dtype: torch.dtype,
                 device: torch.device | str, max_positions: int | None = None,
                 pack_weights: bool | None = None, quantized: bool = False) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = cfg.head_dim ** -0.5
        if quantized:
            why = int4_unavailable(self.device)
            if why or dtype is not torch.bfloat16:
                raise ValueError(f"quantized weights need bfloat16 on a CPU with the int4 kernel "
                                 f"({why or f'dtype is {dtype}'})")
        self.quantized = quantized
        w = _Weights(weights, dtype, self.device)
        # None: pack where it is known to help and stay exact (bfloat16 on the CPU)
        self.pack = should_pack(dtype, self.device) if pack_weights is None else \
            pack_weights and should_pack(dtype, self.device)
        self.embed = w.take("model.embed_tokens.weight")
        if self.embed.shape[0] != cfg.vocab_size:
            raise ValueError(f"embedding has {self.embed.shape[0]} rows, config says vocab {cfg.vocab_size}")
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        self.norm = w.take("model.norm.weight")
        tied = cfg.tie_word_embeddings or not w.has("lm_head.weight")
        if tied:  # a Q4 embedding still needs its bf16 table for the gather: the head shares it
            dense = Linear(self.embed, pack=self.pack)
            self.lm_head = self._linear(w, ["model.embed_tokens.weight"], dense=dense)
        else:
            self.lm_head = self._linear(w, ["lm_head.weight"])
        self.rope = RotaryTable(cfg, max_positions or cfg.max_position_embeddings, dtype, self.device)
        # bfloat16 on the CPU: norms, rotary + KV write and SiLU as one native call each
        self.ops = LayerOps.create(dtype, self.device)
        linears = [self.lm_head] + [x for L in self.layers for x in (L.qkv, L.o, L.gate_up, L.down)]
        q4 = [x for x in linears if isinstance(x, Q4Linear)]
        self.int4_linears = len(q4)
        self.q8_linears = sum(isinstance(x, Q8Linear) for x in linears)
        self.int4_kernel = q4[0].kernel if q4 else None  # "agentserve" or "torch"
        self.int4_max_rows = q4[0].max_rows if q4 else 0
        self.num_linears = len(linears)
        # what `--weights` calls it: native when any projection runs on 4-bit codes
        self.weight_format = "native" if self.int4_linears or self.q8_linears else \
            {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))

    def _linear(self, w: "_Weights", names: list[str], bias: torch.Tensor | None = None,
                dense: Linear | None = None) -> Linear | Q4Linear | Q8Linear:
        """One projection from the row-concatenation of `names`: on a kernel for
        the weights' GGUF codes when quantized and one applies (`codes_linear`),
        else dense."""
        if self.quantized:
            kept = codes_linear([w.raw(n) for n in names], bias, self.pack, dense, self.device)
            if kept is not None:
                return kept
        if dense is not None:
            return dense
        weight = w.take(names[0]) if len(names) == 1 else torch.cat([w.take(n) for n in names])
        return Linear(weight, bias, self.pack)

    def _layer(self, w: "_Weights", i: int) -> _Layer:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        bias = None
        if w.has(a + "q_proj.bias"):
            bias = torch.cat([w.take(a + f"{n}_proj.bias") for n in "qkv"])
        return _Layer(
            input_norm=w.take(p + "input_layernorm.weight"),
            qkv=self._linear(w, [a + f"{n}_proj.weight" for n in "qkv"], bias),
            o=self._linear(w, [a + "o_proj.weight"]),
            post_norm=w.take(p + "post_attention_layernorm.weight"),
            gate_up=self._linear(w, [m + "gate_proj.weight", m + "up_proj.weight"]),
            down=self._linear(w, [m + "down_proj.weight"]),
        )

    @property
    def weight_bytes(self) -> int:
        """Bytes one decode step reads: every projection, the norms and the LM head
        (the embedding table itself is only gathered from). For an int4 projection
        that is its 4-bit codes and scales, not the bf16 copy prefill uses."""
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        total = self.lm_head.nbytes + size(self.norm)
        for L in self.layers:
            total += L.qkv.nbytes + L.o.nbytes + L.gate_up.nbytes + L.down.nbytes
            total += size(L.input_norm) + size(L.post_norm)
        return total

    @property
    def resident_weight_bytes(self) -> int:
        """Memory the weights hold: weight_bytes plus the bf16 copies int4
        projections keep for prefill, plus the embedding table."""
        linears = [self.lm_head] + [x for L in self.layers for x in (L.qkv, L.o, L.gate_up, L.down)]
        extra = sum(x.resident_bytes - x.nbytes for x in linears)
        return self.weight_bytes + extra + self.embed.numel() * self.embed.element_size()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: PagedKVCache, logit_rows: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T]; returns float32 logits [len(logit_rows), vocab]."""
        if self.ops is not None and meta.kernel and not meta.prefills:
            return self._forward_fused(input_ids, positions, meta, kv, logit_rows)
        cfg = self.cfg
        T = input_ids.shape[0]
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = H * D, KVH * D
        eps = cfg.rms_norm_eps
        cos, sin = self.rope.lookup(positions)
        h = F.embedding(input_ids, self.embed)
        for i, L in enumerate(self.layers):
            x = rms_norm(h, L.input_norm, eps)
            qkv = L.qkv(x)
            # q and k sit side by side in the fused projection: rotate them in one pass
            qk = apply_rotary(qkv[:, :q_size + kv_size].view(T, H + KVH, D), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, q_size + kv_size:].view(T, KVH, D)
            k_cache, v_cache = kv.layer(i)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            h = h + L.o(attn)
            x = rms_norm(h, L.post_norm, eps)
            gu = L.gate_up(x)
            g, u = gu.chunk(2, dim=-1)
            h = h + L.down(F.silu(g) * u)
        h = h[logit_rows]
        h = rms_norm(h, self.norm, eps)
        return self.lm_head(h).float()

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv: PagedKVCache, logit_rows: torch.Tensor) -> torch.Tensor:
        """forward() with the small operations as native calls (self.ops): each
        residual add is folded into the next norm; rotary, the KV write and the
        q copy are one pass over the fused projection."""
        cfg, ops = self.cfg, self.ops
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        positions = positions.to(torch.int64).contiguous()
        if positions.numel() and int(positions.max()) >= self.rope.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond the rotary table "
                             f"({self.rope.max_positions} positions)")
        slots = meta.slot_mapping
        h = F.embedding(input_ids, self.embed)
        x = torch.empty_like(h)
        ops.add_rms_norm(h, None, self.layers[0].input_norm, eps, x)
        for i, L in enumerate(self.layers):
            k_cache, v_cache = kv.layer(i)
            q = ops.rope_kv(L.qkv(x), H, KVH, D, self.rope.cos, self.rope.sin, positions, k_cache, v_cache, slots)
            attn = attend_native(q, None, None, k_cache, v_cache, meta, self.scale)
            ops.add_rms_norm(h, L.o(attn), L.post_norm, eps, x)
            down = L.down(ops.silu_mul(L.gate_up(x)))
            if i + 1 < len(self.layers):
                ops.add_rms_norm(h, down, self.layers[i + 1].input_norm, eps, x)
            else:
                h.add_(down)
        h = h[logit_rows].contiguous()
        return self.lm_head(ops.add_rms_norm(h, None, self.norm, eps, torch.empty_like(h))).float()


class _Weights:
    """The loader's tensors, converted to the compute dtype on the device as taken
    (or handed over raw, for the int4 kernel)."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        self.tensors = tensors
        self.dtype = dtype
        self.device = device

    def has(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> torch.Tensor | QuantWeight:
        try:
            return self.tensors[name]
        except KeyError:
            raise ValueError(f"the checkpoint has no tensor {name!r}") from None

    def take(self, name: str) -> torch.Tensor:
        """Dense, in the compute dtype (a Q4Weight or Q8Weight is dequantized first)."""
        t = self.raw(name)
        if is_quantized(t):
            t = t.dequantize()
        return t.to(device=self.device, dtype=self.dtype).contiguous()

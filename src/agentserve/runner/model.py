"""The decoder the runner serves - Llama, Mistral, Qwen2, Qwen3 and Gemma 3 as
one model with per-layer settings - whose attention reads and writes the
paged KV cache, over a flattened mixed batch of prefill chunks and decode tokens.

Every architecture is RMSNorm, rotary embeddings, grouped-query attention and a
gated MLP; they differ in a few switches, all read from `ModelConfig`:
* q/k norm (Qwen3, Gemma 3): a per-head RMSNorm on q and k before RoPE;
* Gemma 3's layer: RMSNorm as x * (1 + w) (the 1 + w is added once at load),
  the attention and MLP outputs normed before their residual adds, GeGLU with
  the tanh GELU, embeddings scaled by sqrt(hidden), the attention scale from
  query_pre_attn_scalar;
* a sliding window per layer (Mistral: every layer; Gemma 3: its sliding
  layers), which the attention kernel applies;
* a rotary table per layer kind (Gemma 3's sliding layers have their own base).

Weights arrive in Hugging Face names; the q/k/v and gate/up projections are
fused into one matrix each, so a layer runs four matrix multiplies. With
`quantized`, projections whose weights came as GGUF codes stay as stored and
run on a kernel for them for decode-sized steps (`gguf_linear.codes_linear`),
with a copy in the compute dtype (bfloat16 or float32) for prefill; everything
else is dequantized to the compute dtype. The norms
follow transformers exactly (statistics in float32, cast back before the weight
is applied), which is what makes the float32 path token-exact against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentserve.runner.attention import AttentionMetadata, attend_cached, paged_attention
from agentserve.runner.config import ModelConfig
from agentserve.runner.kv_cache import PagedKVCache
from agentserve.runner.layer_ops import LayerOps
from agentserve.runner.gguf_linear import BlockLinear, codes_linear
from agentserve.runner.linear import Linear, Q4Linear, Q8Linear, int4_unavailable, should_pack
from agentserve.runner.quant import QuantWeight, is_quantized
from agentserve.runner.rope import RotaryTable, apply_rotary
from agentserve.runner.triton_ops import TritonLayerOps


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear | Q4Linear | Q8Linear
    o: Linear | Q4Linear | Q8Linear
    post_norm: torch.Tensor  # the norm before the MLP (Gemma's pre_feedforward_layernorm)
    gate_up: Linear | Q4Linear | Q8Linear
    down: Linear | Q4Linear | Q8Linear
    rope: RotaryTable
    window: int | None = None  # sliding window of this layer's attention
    qk_norm: torch.Tensor | None = None  # [heads + kv_heads, head_dim]: q_norm rows then k_norm rows
    attn_out_norm: torch.Tensor | None = None  # Gemma: on the attention output before its residual add
    mlp_out_norm: torch.Tensor | None = None  # Gemma: on the MLP output before its residual add

    @property
    def norms(self) -> list[torch.Tensor]:
        return [t for t in (self.input_norm, self.post_norm, self.qk_norm, self.attn_out_norm, self.mlp_out_norm)
                if t is not None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gelu_tanh_mul(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return F.gelu(g, approximate="tanh") * u


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor | QuantWeight], dtype: torch.dtype,
                 device: torch.device | str, max_positions: int | None = None,
                 pack_weights: bool | None = None, quantized: bool = False) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = cfg.attention_scale
        if quantized:
            why = int4_unavailable(self.device)
            if why or dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"quantized weights need bfloat16 or float32 on a CPU with a kernel for them "
                                 f"({why or f'dtype is {dtype}'})")
        self.quantized = quantized
        max_positions = max_positions or cfg.max_position_embeddings
        # a window at least as long as the longest sequence never excludes a key
        self.windows = [w if w is not None and w < max_positions else None
                        for w in (cfg.layer_window(i) for i in range(cfg.num_layers))]
        w = _Weights(weights, dtype, self.device)
        # None: pack where it is known to help and stay exact (bfloat16 on the CPU)
        self.pack = should_pack(dtype, self.device) if pack_weights is None else \
            pack_weights and should_pack(dtype, self.device)
        self.embed = w.take("model.embed_tokens.weight")
        if self.embed.shape[0] != cfg.vocab_size:
            raise ValueError(f"embedding has {self.embed.shape[0]} rows, config says vocab {cfg.vocab_size}")
        # Gemma scales the gathered embeddings by sqrt(hidden), rounded to the compute dtype as transformers does
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(dtype) if cfg.gemma else None
        self.rope = RotaryTable(cfg, max_positions, dtype, self.device)
        self.local_rope = RotaryTable(cfg, max_positions, dtype, self.device, local=True) \
            if cfg.local_rope_theta is not None else self.rope
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        self.norm = self._norm(w, "model.norm.weight")
        tied = cfg.tie_word_embeddings or not w.has("lm_head.weight")
        if tied:  # a Q4 embedding still needs its bf16 table for the gather: the head shares it
            dense = Linear(self.embed, pack=self.pack)
            self.lm_head = self._linear(w, ["model.embed_tokens.weight"], dense=dense)
        else:
            self.lm_head = self._linear(w, ["lm_head.weight"])
        # on the CPU (bfloat16, or float32 on GGUF-kept weights): norms, rotary + KV write and the
        # activation as one native call each
        self.ops = LayerOps.create(dtype, self.device, quantized)
        if self.ops is None and self.device.type == "cuda":
            self.ops = TritonLayerOps.create(dtype, self.device)  # bfloat16/float16 on the Triton kernels
        self.graphs = None  # runner/cuda_graphs.py's DecodeGraphs, once captured
        self.act = gelu_tanh_mul if cfg.gemma else silu_mul
        if self.ops is not None:
            self.fused_act = self.ops.gelu_tanh_mul if cfg.gemma else self.ops.silu_mul
        linears = self.projections()
        q4 = [x for x in linears if isinstance(x, Q4Linear)]
        self.int4_linears = len(q4)
        self.q8_linears = sum(isinstance(x, Q8Linear) for x in linears)
        self.block_linears = sum(isinstance(x, BlockLinear) for x in linears)  # K-quants, Q5, AVX2 Q8_0
        self.int4_kernel = q4[0].kernel if q4 else None  # "agentserve" or "torch"
        self.int4_max_rows = q4[0].max_rows if q4 else 0
        self.num_linears = len(linears)
        # float32 takes the native small ops only on steps whose every projection runs on GGUF codes
        # (quantized activations): above, a step multiplies the dense float32 copies, exact against transformers
        self.codes_rows = min(getattr(x, "max_rows", 0) for x in linears)
        # what `--weights` calls it: native when any projection runs on GGUF codes
        self.weight_format = "native" if self.int4_linears or self.q8_linears or self.block_linears else \
            {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))

    def projections(self) -> list:
        """Every weight matrix product: the head, then each layer's qkv, o, gate_up, down."""
        return [self.lm_head] + [x for L in self.layers for x in (L.qkv, L.o, L.gate_up, L.down)]

    def _norm(self, w: "_Weights", name: str) -> torch.Tensor:
        """A norm weight as the model multiplies it: Gemma's x * (1 + w) as
        x * w', with w' = 1 + w added in float32 as transformers does."""
        if not self.cfg.gemma:
            return w.take(name)
        raw = w.raw(name)
        raw = raw.dequantize() if is_quantized(raw) else raw
        return (1.0 + raw.float()).to(device=self.device, dtype=self.dtype).contiguous()

    def _linear(self, w: "_Weights", names: list[str], bias: torch.Tensor | None = None,
                dense: Linear | None = None) -> Linear | Q4Linear | Q8Linear:
        """One projection from the row-concatenation of `names`: on a kernel for
        the weights' GGUF codes when quantized and one applies (`codes_linear`),
        else dense."""
        if self.quantized:
            kept = codes_linear([w.raw(n) for n in names], bias, self.pack, dense, self.device, self.dtype)
            if kept is not None:
                return kept
        if dense is not None:
            return dense
        weight = w.take(names[0]) if len(names) == 1 else torch.cat([w.take(n) for n in names])
        return Linear(weight, bias, self.pack)

    def _layer(self, w: "_Weights", i: int) -> _Layer:
        cfg = self.cfg
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        bias = None
        if w.has(a + "q_proj.bias"):
            bias = torch.cat([w.take(a + f"{n}_proj.bias") for n in "qkv"])
        qk_norm = None
        if cfg.qk_norm:
            qk_norm = torch.cat([self._norm(w, a + "q_norm.weight").expand(cfg.num_heads, -1),
                                 self._norm(w, a + "k_norm.weight").expand(cfg.num_kv_heads, -1)]).contiguous()
        gemma = cfg.gemma
        return _Layer(
            input_norm=self._norm(w, p + "input_layernorm.weight"),
            qkv=self._linear(w, [a + f"{n}_proj.weight" for n in "qkv"], bias),
            o=self._linear(w, [a + "o_proj.weight"]),
            post_norm=self._norm(w, p + ("pre_feedforward_layernorm.weight" if gemma
                                         else "post_attention_layernorm.weight")),
            gate_up=self._linear(w, [m + "gate_proj.weight", m + "up_proj.weight"]),
            down=self._linear(w, [m + "down_proj.weight"]),
            rope=self.local_rope if cfg.is_sliding(i) else self.rope,
            window=self.windows[i],
            qk_norm=qk_norm,
            attn_out_norm=self._norm(w, p + "post_attention_layernorm.weight") if gemma else None,
            mlp_out_norm=self._norm(w, p + "post_feedforward_layernorm.weight") if gemma else None,
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
            total += sum(size(t) for t in L.norms)
        return total

    @property
    def resident_weight_bytes(self) -> int:
        """Memory the weights hold: weight_bytes plus the bf16 copies int4
        projections keep for prefill, plus the embedding table."""
        linears = self.projections()
        extra = sum(x.resident_bytes - x.nbytes for x in linears)
        return self.weight_bytes + extra + self.embed.numel() * self.embed.element_size()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        return h if self.embed_scale is None else h * self.embed_scale

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: PagedKVCache, logit_rows: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T]; returns float32 logits [len(logit_rows), vocab]."""
        if self.graphs is not None and meta.gpu is not None and not meta.prefills and not meta.groups:
            out = self.graphs.replay(input_ids, positions, meta, logit_rows)
            if out is not None:
                return out
        return self.forward_eager(input_ids, positions, meta, kv, logit_rows)

    def forward_eager(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      kv: PagedKVCache, logit_rows: torch.Tensor) -> torch.Tensor:
        """forward() without a captured graph (what a graph captures)."""
        if self.ops is not None and (meta.kernel or meta.gpu is not None) and not meta.prefills and \
                (not self.ops.f32 or input_ids.shape[0] <= self.codes_rows):
            return self._forward_fused(input_ids, positions, meta, kv, logit_rows)
        cfg = self.cfg
        T = input_ids.shape[0]
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = H * D, KVH * D
        eps = cfg.rms_norm_eps
        tables = {id(self.rope): self.rope.lookup(positions)}
        if self.local_rope is not self.rope:
            tables[id(self.local_rope)] = self.local_rope.lookup(positions)
        h = self._embed(input_ids)
        for i, L in enumerate(self.layers):
            cos, sin = tables[id(L.rope)]
            x = rms_norm(h, L.input_norm, eps)
            qkv = L.qkv(x)
            # q and k sit side by side in the fused projection: norm and rotate them in one pass
            qk = qkv[:, :q_size + kv_size].view(T, H + KVH, D)
            if L.qk_norm is not None:
                qk = rms_norm(qk, L.qk_norm, eps)
            qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, q_size + kv_size:].view(T, KVH, D)
            k_cache, v_cache = kv.layer(i)
            m = meta.groups[kv.layout.group[i]] if meta.groups else meta
            attn = L.o(paged_attention(q, k, v, k_cache, v_cache, m, self.scale, window=L.window))
            if L.attn_out_norm is not None:
                attn = rms_norm(attn, L.attn_out_norm, eps)
            h = h + attn
            x = rms_norm(h, L.post_norm, eps)
            mlp = L.down(self.act(L.gate_up(x)))
            if L.mlp_out_norm is not None:
                mlp = rms_norm(mlp, L.mlp_out_norm, eps)
            h = h + mlp
        h = h[logit_rows]
        h = rms_norm(h, self.norm, eps)
        return self.lm_head(h).float()

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv: PagedKVCache, logit_rows: torch.Tensor) -> torch.Tensor:
        """forward() with the small operations as native calls (self.ops): each
        residual add is folded into the next norm (with Gemma's norm on the
        sublayer output before it); the q/k norm, rotary, the KV write and the q
        copy are one pass over the fused projection."""
        cfg, ops = self.cfg, self.ops
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        positions = positions.to(torch.int64).contiguous()
        # (on a GPU the scheduler's max_model_len bounds positions: reading one back would stall the step)
        if positions.device.type == "cpu" and positions.numel() and int(positions.max()) >= self.rope.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond the rotary table "
                             f"({self.rope.max_positions} positions)")
        groups = [meta.groups[g] for g in kv.layout.group] if meta.groups else [meta] * len(self.layers)
        h = self._embed(input_ids)
        x = torch.empty_like(h)
        ops.add_rms_norm(h, None, self.layers[0].input_norm, eps, x)
        for i, L in enumerate(self.layers):
            k_cache, v_cache = kv.layer(i)
            m = groups[i]
            q = ops.rope_kv(L.qkv(x), H, KVH, D, L.rope.cos, L.rope.sin, positions, k_cache, v_cache,
                            m.slot_mapping, L.qk_norm, eps)
            attn = attend_cached(q, k_cache, v_cache, m, self.scale, window=L.window)
            attn = L.o(attn if attn.dtype is h.dtype else attn.to(h.dtype))
            # Gemma's norm on the attention output, the residual add and the next norm: one call
            ops.add_rms_norm(h, attn, L.post_norm, eps, x, L.attn_out_norm)
            down = L.down(self.fused_act(L.gate_up(x)))
            last = i + 1 == len(self.layers)
            ops.add_rms_norm(h, down, self.norm if last else self.layers[i + 1].input_norm, eps, x,
                             L.mlp_out_norm)
        # the norm is per row: the final norm of every row, then the rows sampled
        return self.lm_head(x[logit_rows].contiguous()).float()


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

"""Triton kernels for a step on a CUDA device (launched by runner/triton_ops.py):

* `write_kv`: each new token's K and V into the paged cache at its slot; a
  negative slot is skipped (the padding rows of a captured decode graph);
* `paged_decode` and `decode_reduce`: one query row per sequence attends to
  its context where the block table says the blocks lie (no gather of whole
  contexts), all the query heads of a KV head in one program, with an online
  softmax over tiles of TOK tokens; the context can be split into SPLITS
  parts whose partial results `decode_reduce` merges by their log-sum-exps,
  so that a few long sequences still fill the card;
* `add_rms_norm`, `rope_kv`, `silu_mul`, `gelu_tanh_mul`: the small per-layer
  operations, one launch each, rounding as torch's expressions round in the
  compute dtype (runner/layer_ops.py's CPU kernels do the same on the CPU).

Addresses are computed in 64 bits where a cache can pass 2^31 elements. Under
Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) 16-bit dot products
are computed in float32 (UPCAST), which the interpreter computes exactly; on a
GPU they run on the tensor cores with float32 accumulation."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: runner/triton_ops.py reports it
    triton = None

if triton is not None:

    @triton.jit
    def write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, k_row, k_head, v_row, v_head, c_head, c_block, c_tok,
                 BS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if slot >= 0:
            d = tl.arange(0, DP)
            m = d < D
            dst = h * c_head + (slot // BS) * c_block + (slot % BS) * c_tok + d
            k = tl.load(k_ptr + t * k_row + h * k_head + d, mask=m)
            v = tl.load(v_ptr + t * v_row + h * v_head + d, mask=m)
            tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["window"])
    def paged_decode(q_ptr, kc_ptr, vc_ptr, tables_ptr, lens_ptr, out_ptr, po_ptr, pml_ptr, scale, window,
                     q_row, q_head, o_row, o_head, c_head, c_block, c_tok, table_row, num_heads,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                     TOK: tl.constexpr, SPLITS: tl.constexpr, UPCAST: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        n = tl.load(lens_ptr + row)  # context length, the new token included; 0: a padding row
        # transformers' window: keys p - W < j <= p for the query at p = n - 1
        lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
        per = tl.cdiv(tl.cdiv(n - lo, SPLITS), TOK) * TOK
        s0 = lo + split * per
        s1 = tl.minimum(s0 + per, n)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        gm = g < G
        dm = d < D
        head = kvh * G + g
        q = tl.load(q_ptr + row * q_row + head[:, None] * q_head + d[None, :], mask=gm[:, None] & dm[None, :],
                    other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        for start in range(s0, s1, TOK):
            t = start + tl.arange(0, TOK)
            tm = t < s1
            blk = tl.load(tables_ptr + row * table_row + t // BS, mask=tm, other=0).to(tl.int64)
            off = kvh * c_head + blk * c_block + (t % BS).to(tl.int64) * c_tok
            kvm = tm[:, None] & dm[None, :]
            k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=kvm, other=0.0)
            v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=kvm, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q.to(k.dtype), tl.trans(k))
            s = tl.where(tm[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if UPCAST:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLITS == 1:
            res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + row * o_row + head[:, None] * o_head + d[None, :],
                     res.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])
        else:
            part = (row * num_heads + head) * SPLITS + split
            tl.store(po_ptr + part[:, None] * DP + d[None, :], acc, mask=gm[:, None])
            tl.store(pml_ptr + part * 2, m_i, mask=gm)
            tl.store(pml_ptr + part * 2 + 1, l_i, mask=gm)

    @triton.jit
    def decode_reduce(po_ptr, pml_ptr, out_ptr, o_row, o_head, num_heads,
                      SPLITS: tl.constexpr, SP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        s = tl.arange(0, SP)
        d = tl.arange(0, DP)
        sm = s < SPLITS
        part = (row * num_heads + h) * SPLITS + s
        m = tl.load(pml_ptr + part * 2, mask=sm, other=float("-inf"))
        l_ = tl.load(pml_ptr + part * 2 + 1, mask=sm, other=0.0)
        top = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
        total = tl.sum(w * l_, 0)
        o = tl.load(po_ptr + part[:, None] * DP + d[None, :], mask=sm[:, None], other=0.0)
        res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + row * o_row + h * o_head + d, res.to(out_ptr.dtype.element_ty), mask=d < D)

    @triton.jit
    def add_rms_norm(h_ptr, delta_ptr, dw_ptr, w_ptr, out_ptr, dim, eps,
                     HAS_DELTA: tl.constexpr, HAS_DW: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < dim
        h = tl.load(h_ptr + row * dim + c, mask=m, other=0.0)
        if HAS_DELTA:
            x = tl.load(delta_ptr + row * dim + c, mask=m, other=0.0)
            if HAS_DW:  # Gemma: the sublayer's output normed before the residual add
                xf = x.to(tl.float32)
                r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / dim + eps)
                xn = (xf * r).to(h.dtype)
                x = (tl.load(dw_ptr + c, mask=m, other=0.0).to(tl.float32) * xn.to(tl.float32)).to(h.dtype)
            h = (h.to(tl.float32) + x.to(tl.float32)).to(h.dtype)
            tl.store(h_ptr + row * dim + c, h, mask=m)
        hf = h.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / dim + eps)
        hn = (hf * r).to(h.dtype)
        y = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32) * hn.to(tl.float32)
        tl.store(out_ptr + row * dim + c, y.to(h.dtype), mask=m)

    @triton.jit
    def rope_kv(qkv_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, norm_ptr, eps,
                qkv_row, c_head, c_block, c_tok, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                HALF: tl.constexpr, HP: tl.constexpr, BS: tl.constexpr, HAS_NORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)  # heads: q 0..H-1, k H..H+KVH-1, v H+KVH..
        c = tl.arange(0, HP)
        m = c < HALF
        src = qkv_ptr + t * qkv_row + j * D
        x1 = tl.load(src + c, mask=m, other=0.0)
        x2 = tl.load(src + HALF + c, mask=m, other=0.0)
        dt = x1.dtype
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if j < H + KVH:
            if HAS_NORM:
                f1 = x1.to(tl.float32)
                f2 = x2.to(tl.float32)
                r = 1.0 / tl.sqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) / D + eps)
                w1 = tl.load(norm_ptr + j * D + c, mask=m, other=0.0).to(tl.float32)
                w2 = tl.load(norm_ptr + j * D + HALF + c, mask=m, other=0.0).to(tl.float32)
                x1 = (w1 * (f1 * r).to(dt).to(tl.float32)).to(dt)
                x2 = (w2 * (f2 * r).to(dt).to(tl.float32)).to(dt)
            p = tl.load(pos_ptr + t).to(tl.int64)
            cos1 = tl.load(cos_ptr + p * D + c, mask=m, other=0.0).to(tl.float32)
            cos2 = tl.load(cos_ptr + p * D + HALF + c, mask=m, other=0.0).to(tl.float32)
            sin1 = tl.load(sin_ptr + p * D + c, mask=m, other=0.0).to(tl.float32)
            sin2 = tl.load(sin_ptr + p * D + HALF + c, mask=m, other=0.0).to(tl.float32)
            a1 = x1.to(tl.float32)
            a2 = x2.to(tl.float32)
            # x * cos + cat(-x2, x1) * sin, each product rounded to the compute dtype as torch rounds it
            y1 = ((a1 * cos1).to(dt).to(tl.float32) + (-a2 * sin1).to(dt).to(tl.float32)).to(dt)
            y2 = ((a2 * cos2).to(dt).to(tl.float32) + (a1 * sin2).to(dt).to(tl.float32)).to(dt)
            if j < H:
                dst = q_ptr + (t * H + j) * D
                tl.store(dst + c, y1.to(q_ptr.dtype.element_ty), mask=m)
                tl.store(dst + HALF + c, y2.to(q_ptr.dtype.element_ty), mask=m)
            elif slot >= 0:
                dst = kc_ptr + (j - H).to(tl.int64) * c_head + (slot // BS) * c_block + (slot % BS) * c_tok
                tl.store(dst + c, y1.to(kc_ptr.dtype.element_ty), mask=m)
                tl.store(dst + HALF + c, y2.to(kc_ptr.dtype.element_ty), mask=m)
        elif slot >= 0:
            dst = vc_ptr + (j - H - KVH).to(tl.int64) * c_head + (slot // BS) * c_block + (slot % BS) * c_tok
            tl.store(dst + c, x1.to(vc_ptr.dtype.element_ty), mask=m)
            tl.store(dst + HALF + c, x2.to(vc_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def gated_act(gu_ptr, out_ptr, inter, GELU: tl.constexpr, BLOCK: tl.constexpr):
        """out = act(gate) * up, gu = [gate | up] per row; act SiLU or tanh-GELU,
        its result rounded to the compute dtype before the product, as torch's
        two kernels round."""
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < inter
        g = tl.load(gu_ptr + t * 2 * inter + c, mask=m, other=0.0)
        u = tl.load(gu_ptr + t * 2 * inter + inter + c, mask=m, other=0.0)
        x = g.to(tl.float32)
        if GELU:
            y = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            th = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * y))  # tanh(y)
            a = 0.5 * x * (1.0 + th)
        else:
            a = x / (1.0 + tl.exp(-x))
        out = a.to(g.dtype).to(tl.float32) * u.to(tl.float32)
        tl.store(out_ptr + t * inter + c, out.to(g.dtype), mask=m)

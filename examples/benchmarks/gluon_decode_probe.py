"""Decode attention in Gluon (triton.experimental.gluon) with K/V loaded straight into MMA
registers: fewer joules per byte than the engine's Triton kernel, but slower, and slower in the
engine. Twenty-fourth session, RESULTS.md.

The engine's split kernel (`tl.dot`) stages K/V through shared memory (cp.async, ldmatrix)
and pads the GQA group to 16 MMA rows; its loop is ~28 SASS instructions a key. This probe's
kernel (~16.5 a key):
- loads each page's K/V with 16-byte vectors straight into the registers the MMA reads. A
  vector needs each lane's elements contiguous in memory, so the head dimension is relabelled:
  K's contraction index j reads stored d = _k_order(j) (Q is read in the same order, so
  Q K^T is unchanged) and O^T's row m is stored d = _v_order(m). The relabelling is a
  reshape/permute of the loaded tensor: no data moves between lanes;
- puts the keys on the MMAs' M side (S^T = K Q^T, O^T += V^T P^T), so the group of 4 q heads
  pads to 8 (m16n8k16's N), half the engine's MMAs;
- gives a (kv head, sequence) W warps: warp w takes pages w, w + W, ... with its own online
  softmax (batched [W, ...] MMAs), merged once at the end;
- STAGES > 0 instead copies the pages through a cp.async ring in shared memory (each lane
  reads back what it copied).
16-slot pages, head_dim 128, group <= 8, one split (the engine's choice from 33 rows on).

Usage (CUDA machine, repo root, PYTHONPATH=.:examples/benchmarks):
    python examples/benchmarks/gluon_decode_probe.py
Checks every variant against the torch reference (and the engine's kernel), then prints us,
W, MHz and pJ per K/V byte of 16 layers a CUDA graph (energy_probe.measure) at 256, 96 and
48 rows against the engine's kernel and a torch sum of the same bytes.
"""

from __future__ import annotations

import functools

import torch
from batchgen.kernels.decode_attention import _tiles as decode_tiles
from batchgen.kernels.decode_attention import launch_decode, paged_attention_decode_ref
from decode_tile_probe import HK, HQ, LAYERS, D, caches, nano_contexts
from energy_probe import Nvml, measure
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

_LOG2E = 1.4426950408889634
# (warps a program, cp.async stages; 0 = straight into registers).
VARIANTS = ((2, 0), (4, 0), (2, 2), (2, 3), (4, 2), (4, 3))


@functools.cache
def layouts(warps: int):
    """(MMA, K_LOAD, V_LOAD) for [warps, ...] tensors, one warp a slice of dim 0."""
    wb = [[1 << i, 0, 0] for i in range(warps.bit_length() - 1)]
    mma = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[warps, 1, 1], instr_shape=[1, 16, 8]
    )
    # K page [16 keys, 128 d] as stored: a lane holds 32 contiguous d of two keys.
    k_load = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16], [0, 8, 0]],
        lane_bases=[[0, 0, 32], [0, 0, 64], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=wb,
        block_bases=[],
        shape=[warps, 16, 128],
    )
    # V page as stored: a lane holds 16 contiguous d of four keys.
    v_load = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
        warp_bases=wb,
        block_bases=[],
        shape=[warps, 16, 128],
    )
    return mma, k_load, v_load


@gluon.jit
def _k_order(j):
    # Stored d read by K's contraction index j (and Q's): j's bits 0 | 3-6 | 1-2 become stored
    # bits 0 | 1-4 | 5-6, so a lane's A-operand elements (j bits 0, 3-6 its own) are 32
    # contiguous stored d.
    return (j & 1) | (((j >> 3) & 15) << 1) | (((j >> 1) & 3) << 5)


@gluon.jit
def _v_order(m):
    # Stored d of O^T's row m: a lane's A-operand rows of V^T (m bits 3-6 its own) are 16
    # contiguous stored d.
    return ((m & 7) << 4) | (m >> 3)


@gluon.jit
def _idx(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    # arange(n) along `dim` of a rank-3 layout, expanded back to rank 3.
    if dim == 0:
        return gl.expand_dims(
            gl.expand_dims(gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout))), 1),
            2,
        )
    elif dim == 1:
        return gl.expand_dims(
            gl.expand_dims(gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout))), 0),
            2,
        )
    else:
        return gl.expand_dims(
            gl.expand_dims(gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout))), 0),
            1,
        )


@gluon.jit
def _tile(k, v, s_ok, q_t, acc, m_i, l_i, qk_scale, W: gl.constexpr, MMA: gl.constexpr,
          MASKED: gl.constexpr):  # fmt: skip
    # One page per warp: online softmax over S^T = K Q^T [W, 16 keys, 8 heads], then
    # O^T += V^T P^T [W, 128 d, 8 heads].
    A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    k = gl.reshape(gl.permute(gl.reshape(k, [W, 16, 4, 16, 2]), (0, 1, 3, 2, 4)), [W, 16, 128])
    v = gl.reshape(gl.permute(gl.reshape(v, [W, 16, 8, 16]), (0, 1, 3, 2)), [W, 16, 128])
    k_a = gl.convert_layout(k, A_OP)
    v_a = gl.convert_layout(gl.permute(v, (0, 2, 1)), A_OP)
    s_t = mma_v2(k_a, q_t, gl.zeros([W, 16, 8], gl.float32, MMA)) * qk_scale
    if MASKED:
        s_t = gl.where(s_ok, s_t, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s_t, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a warp that has seen no key yet
    alpha = gl.exp2(m_i - m_use)
    p_t = gl.exp2(s_t - gl.expand_dims(m_use, 1))
    l_i = l_i * alpha + gl.sum(p_t, 1)
    p_b = gl.convert_layout(p_t.to(k.dtype), B_OP)
    acc = mma_v2(v_a, p_b, acc * gl.expand_dims(alpha, 1))
    return acc, m_new, l_i


@gluon.jit
def _issue(k_dst, v_dst, bt_row, page, kw, vw, k_base, v_base, k_offs, v_offs, stride_kb):
    # cp.async one round's pages (page + w for warp w) into a stage; each lane later reads
    # back exactly the bytes it copied.
    k_blk = gl.load(bt_row + page + kw).to(gl.int64)
    v_blk = gl.load(bt_row + page + vw).to(gl.int64)
    async_copy.async_copy_global_to_shared(k_dst, k_base + k_blk * stride_kb + k_offs)
    async_copy.async_copy_global_to_shared(v_dst, v_base + v_blk * stride_kb + v_offs)


@gluon.jit
def gl_decode_kernel(
    q_ptr, k_ptr, v_ptr, seq_lens_ptr, bt_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ob, stride_oh,
    qk_scale, GROUP: gl.constexpr, W: gl.constexpr, MMA: gl.constexpr,
    K_LOAD: gl.constexpr, V_LOAD: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    # Grid (Hk, B): one (kv head, sequence) a program, all its keys (one split).
    kvh = gl.program_id(0)
    b = gl.program_id(1)
    seq_len = gl.load(seq_lens_ptr + b)
    p_hi = gl.cdiv(seq_len, 16)  # pages
    rounds = (seq_len // 16) // W  # rounds in which every warp has a full page

    # Q^T [W, 128 d (MMA order), 8 heads], the same in every warp; heads past GROUP zero.
    qj = _idx(128, 1, B_OP)
    qh = _idx(8, 2, B_OP)
    q_ptrs = (q_ptr + b.to(gl.int64) * stride_qb + (kvh * GROUP + qh) * stride_qh
              + _k_order(qj) + 0 * _idx(W, 0, B_OP))  # fmt: skip
    q_t = gl.load(q_ptrs, mask=qh < GROUP, other=0.0)

    kw = _idx(W, 0, K_LOAD)
    kn = _idx(16, 1, K_LOAD)
    k_offs = kn * stride_ks + _idx(128, 2, K_LOAD)
    vw = _idx(W, 0, V_LOAD)
    vn = _idx(16, 1, V_LOAD)
    v_offs = vn * stride_ks + _idx(128, 2, V_LOAD)
    k_base = k_ptr + kvh.to(gl.int64) * stride_kh
    v_base = v_ptr + kvh.to(gl.int64) * stride_kh
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt
    sw = _idx(W, 0, MMA)
    sn = _idx(16, 1, MMA)

    acc = gl.zeros([W, 128, 8], gl.float32, MMA)
    m_i = gl.full([W, 8], float("-inf"), gl.float32, gl.SliceLayout(1, MMA))
    l_i = gl.zeros([W, 8], gl.float32, gl.SliceLayout(1, MMA))
    # Each index, block id and mask exists once per layout (K's, V's, the scores'): Gluon types a
    # tensor by its layout, and loading a block id twice is cheaper than moving it between lanes.
    if STAGES == 0:  # straight into registers
        for r in range(rounds):
            page = r * W
            k_blk = gl.load(bt_row + page + kw).to(gl.int64)
            v_blk = gl.load(bt_row + page + vw).to(gl.int64)
            k = gl.load(k_base + k_blk * stride_kb + k_offs)
            v = gl.load(v_base + v_blk * stride_kb + v_offs)
            acc, m_i, l_i = _tile(k, v, sn, q_t, acc, m_i, l_i, qk_scale, W, MMA, False)
    else:  # through a cp.async ring of STAGES rounds in shared memory
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0])
        k_smem = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [STAGES, W, 16, 128], SMEM)
        v_smem = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [STAGES, W, 16, 128], SMEM)
        for s in gl.static_range(STAGES - 1):
            if s < rounds:
                _issue(k_smem.index(s), v_smem.index(s), bt_row, s * W, kw, vw, k_base,
                       v_base, k_offs, v_offs, stride_kb)  # fmt: skip
            async_copy.commit_group()
        for r in range(rounds):
            nr = r + STAGES - 1
            if nr < rounds:
                _issue(k_smem.index(nr % STAGES), v_smem.index(nr % STAGES), bt_row, nr * W,
                       kw, vw, k_base, v_base, k_offs, v_offs, stride_kb)  # fmt: skip
            async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)
            k = k_smem.index(r % STAGES).load(K_LOAD)
            v = v_smem.index(r % STAGES).load(V_LOAD)
            acc, m_i, l_i = _tile(k, v, sn, q_t, acc, m_i, l_i, qk_scale, W, MMA, False)
    page = rounds * W
    if page < p_hi:
        # Last round: fewer pages than warps, or the sequence's partly filled last page.
        k_pg = page + kw
        v_pg = page + vw
        k_left = gl.where(k_pg < p_hi, seq_len - k_pg * 16, 0)
        v_left = gl.where(v_pg < p_hi, seq_len - v_pg * 16, 0)
        k_blk = gl.load(bt_row + k_pg, mask=k_left > 0, other=0).to(gl.int64)
        v_blk = gl.load(bt_row + v_pg, mask=v_left > 0, other=0).to(gl.int64)
        k = gl.load(k_base + k_blk * stride_kb + k_offs, mask=kn < k_left, other=0.0)
        v = gl.load(v_base + v_blk * stride_kb + v_offs, mask=vn < v_left, other=0.0)
        s_pg = page + sw
        s_ok = sn < gl.where(s_pg < p_hi, seq_len - s_pg * 16, 0)
        acc, m_i, l_i = _tile(k, v, s_ok, q_t, acc, m_i, l_i, qk_scale, W, MMA, True)

    # Merge the warps: [W, 8] maxima and sums, [W, 128, 8] accumulators.
    m_all = gl.max(m_i, 0)
    m_use = gl.where(m_all == float("-inf"), 0.0, m_all)
    scale = gl.exp2(m_i - gl.expand_dims(m_use, 0))
    l_all = gl.sum(l_i * scale, 0)
    o = gl.sum(acc * gl.expand_dims(scale, 1), 0)  # [128, 8]
    O_L: gl.constexpr = gl.SliceLayout(0, MMA)
    l_all = gl.convert_layout(l_all, gl.SliceLayout(0, O_L))
    o = o / gl.expand_dims(gl.where(l_all > 0, l_all, 1.0), 0)  # a padding row (seq_len 0): 0
    om = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(1, O_L)), 1)
    oh = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, O_L)), 0)
    o_ptrs = out_ptr + b.to(gl.int64) * stride_ob + (kvh * GROUP + oh) * stride_oh + _v_order(om)
    gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=oh < GROUP)


def launch_probe(q, k, v, lens, tables, out, warps: int, stages: int):
    """One split, out [B, Hq, D] in q's dtype."""
    mma, k_load, v_load = layouts(warps)
    gl_decode_kernel[(HK, q.shape[0])](
        q, k, v, lens, tables, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), tables.stride(0),
        out.stride(0), out.stride(1), D**-0.5 * _LOG2E,
        GROUP=HQ // HK, W=warps, MMA=mma, K_LOAD=k_load, V_LOAD=v_load, STAGES=stages,
        num_warps=warps,
    )  # fmt: skip
    return out


def check() -> None:
    """Every variant against the fp32 torch reference on ragged lengths (0 = padding row)."""
    lens_l = [0, 1, 15, 16, 17, 33, 100, 257, 1000]
    k, v, tables = caches([max(n, 1) for n in lens_l])
    lens = torch.tensor(lens_l, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens_l), HQ, D, device="cuda", dtype=torch.bfloat16)
    ref = paged_attention_decode_ref(q.float(), k.float(), v.float(), lens, tables, D**-0.5)
    engine = launch_decode(q, k, v, lens, tables, D**-0.5, 1, *decode_tiles())
    bound = (engine.float() - ref).abs().max().item()
    for warps, stages in VARIANTS:
        out = launch_probe(q, k, v, lens, tables, torch.empty_like(q), warps, stages)
        err = (out.float() - ref).abs().max().item()
        print(f"W{warps} stages {stages}: max abs error {err:.2e} (engine {bound:.2e})")
        assert err <= 2 * bound, (warps, stages, err, bound)


def measure_batch(nvml: Nvml, bsz: int) -> None:
    """The variants, the engine's kernel and a torch sum at bsz rows of nano contexts."""
    ctx = nano_contexts(bsz, torch.Generator().manual_seed(0))
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    layers = [caches(ctx) for _ in range(LAYERS)]
    q = torch.randn(bsz, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv = LAYERS * 2 * sum(ctx) * HK * D * 2
    read = torch.randn(kv // 2, device="cuda", dtype=torch.bfloat16)
    runs = {
        "engine": lambda: [
            launch_decode(q, k, v, lens, t, D**-0.5, 1, *decode_tiles(), out=out)
            for k, v, t in layers
        ]
    }
    for warps, stages in VARIANTS:
        runs[f"gluon W{warps} stages {stages}"] = lambda w=warps, s=stages: [
            launch_probe(q, k, v, lens, t, out, w, s) for k, v, t in layers
        ]
    runs["torch sum, same bytes"] = lambda: read.sum()
    for name, fn in runs.items():
        us, watts, mhz, mj = measure(nvml, fn)
        print(
            f"B={bsz} {name:22s} {us:8.1f} us {watts:5.0f} W {mhz} MHz "
            f"{mj * 1e9 / kv:6.1f} pJ/B {kv / us / 1e6:.2f} TB/s",
            flush=True,
        )


def main() -> None:
    print(torch.cuda.get_device_name())
    check()
    nvml = Nvml()
    for bsz in (256, 96, 48):
        measure_batch(nvml, bsz)


if __name__ == "__main__":
    main()

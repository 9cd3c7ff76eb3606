"""Where decode attention's joules go beyond reading K/V: the split kernel's loop with parts
removed, llama3.1-8b heads, B=256 nano contexts, 16 layers per CUDA graph (energy_probe.measure).

energy_probe.py found decode attention at about 207 pJ per K/V byte against 180 for a plain
read (torch sum) at the same 3.0 TB/s: the SM work of the loop (the GQA group's 4 q heads
padded to 16 MMA rows, the online softmax over [16, BLOCK_N] scores, address math, the staging
through shared memory) adds about 15%. This probe's kernel walks the keys as the engine's split
kernel does (one split, 128-key tiles, 2 stages, 4 warps) with MODE:
  0  full: QK^T, online softmax, PV (the engine's loop; its output is checked against it);
  1  no softmax: both MMAs, p = scores (no exp2, max or rescale);
  2  no MMA: the K and V tiles summed into the accumulator (loads and adds only);
  3  CUDA cores: QK^T and PV as broadcast products summed in fp32 over the GROUP real rows
     only (no MMA, no shared memory), CUDA_CORE_KEYS keys a loop step; a real alternative
     (its output is checked against the engine's kernel);
  4  transposed: S^T = K Q^T and O^T += V^T P^T, the K and V tiles as the MMAs' first operand
     (keys as M, the group padded to 16 as N), checked against the engine's kernel too.
Modes 1 and 2 compute nothing useful: they price parts of the loop. The engine's kernel is
timed too, as the reference for mode 0. "persistent N" runs mode 0 on a grid of N programs
that take the (kv head, sequence) items in turn: with fewer programs than the SMs' 396 slots
some SMs idle, which may cost less power for the same bytes.

Usage (CUDA machine, repo root): python examples/benchmarks/decode_energy_probe.py [B]
ONLY=engine,transposed (substrings of the names) times those only.
"""

from __future__ import annotations

import os
import re
import sys

import torch
import triton
import triton.language as tl
from batchgen.kernels import launch
from batchgen.kernels.decode_attention import _tiles as decode_tiles
from batchgen.kernels.decode_attention import launch_decode
from decode_tile_probe import HK, HQ, LAYERS, D, caches, nano_contexts
from energy_probe import Nvml, measure

_LOG2E = 1.4426950408889634
# Persistent grids of the full loop (programs; the SMs hold 3 each): fewer programs than slots
# leave SMs idle, which may draw less power for the same bytes.
PERSISTENT = (396, 264, 198, 132)
# Mode 3's key rows a loop step: [GROUP, keys, D] fp32 products live in registers.
CUDA_CORE_KEYS = (8, 16, 32)
# (mode, keys, warps) run with the group's real rows (BLOCK_G = GROUP) instead of 16.
NARROW = ((0, 128, 4), (4, 128, 4), (4, 64, 4), (4, 64, 2), (4, 128, 8))


@triton.jit
def _probe_kernel(
    q_ptr, k_ptr, v_ptr, seq_lens_ptr, bt_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ob, stride_oh,
    qk_scale, num_items,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, MODE: tl.constexpr, HK_: tl.constexpr,
):  # fmt: skip
    # Grid (P,): program p takes items p, p + P, ... of the Hk * B (kv head, sequence) items,
    # kv heads of a sequence side by side (the engine's split kernel with HEADS_FIRST, one
    # split, is P = Hk * B).
    zero = tl.full([], 0, tl.int64)  # the interpreter's loop index is a Python int
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        _probe_item(
            zero + item % HK_, zero + item // HK_, q_ptr, k_ptr, v_ptr, seq_lens_ptr, bt_ptr,
            out_ptr,
            stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ob,
            stride_oh, qk_scale, GROUP, BLOCK_G, D, BLOCK_N, PAGE, MODE,
        )  # fmt: skip


@triton.jit
def _kv_tile(
    k_base, v_base, bt_row, start_n, seq_len, offs_d, stride_kb, stride_ks,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    # Keys [start_n, start_n + BLOCK_N) of one kv head through its block table: K and V tiles
    # [BLOCK_N, D] (zeros past seq_len) and the key mask [BLOCK_N].
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_mask = offs_n < seq_len
    blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    rows = blk * stride_kb + (offs_n % PAGE) * stride_ks
    k = tl.load(k_base + rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    v = tl.load(v_base + rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    return k, v, n_mask


@triton.jit
def _probe_item(
    kvh, b, q_ptr, k_ptr, v_ptr, seq_lens_ptr, bt_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ob, stride_oh,
    qk_scale,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    seq_len = tl.load(seq_lens_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_kh
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    if MODE == 4:
        out = _probe_item_transposed(
            q, k_base, v_base, bt_row, seq_len, offs_d, stride_kb, stride_ks, qk_scale,
            BLOCK_G, D, BLOCK_N, PAGE,
        )  # fmt: skip
    else:
        out = _probe_item_rows(
            q, k_base, v_base, bt_row, seq_len, offs_d, stride_kb, stride_ks, qk_scale,
            BLOCK_G, D, BLOCK_N, PAGE, MODE,
        )  # fmt: skip
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _probe_item_rows(
    q, k_base, v_base, bt_row, seq_len, offs_d, stride_kb, stride_ks, qk_scale,
    BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    MODE: tl.constexpr,
):  # fmt: skip
    # Modes 0-3: the q heads as rows, [G, D] normalised output.
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    for start_n in range(0, seq_len, BLOCK_N):
        k, v, n_mask = _kv_tile(
            k_base, v_base, bt_row, start_n, seq_len, offs_d, stride_kb, stride_ks, BLOCK_N, PAGE
        )
        if MODE == 2:
            acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)[None, :]
        elif MODE == 3:
            # CUDA cores over the real rows only (BLOCK_G == GROUP): no MMA, no shared memory.
            qk = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2) * qk_scale
            qk = tl.where(n_mask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        else:
            qk = tl.dot(q, tl.trans(k)) * qk_scale
            if MODE == 0:
                qk = tl.where(n_mask[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            else:
                acc += tl.dot(qk.to(v.dtype), v)
                l_i += 1.0
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def _probe_item_transposed(
    q, k_base, v_base, bt_row, seq_len, offs_d, stride_kb, stride_ks, qk_scale,
    BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    # Mode 4: the same loop transposed, keys as the MMAs' M side: S^T = K Q^T [BLOCK_N, G] and
    # O^T += V^T P^T [D, G], so the K and V tiles are the MMAs' first operands.
    acc = tl.zeros([D, BLOCK_G], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    q_t = tl.trans(q)  # [D, G]
    for start_n in range(0, seq_len, BLOCK_N):
        k, v, n_mask = _kv_tile(
            k_base, v_base, bt_row, start_n, seq_len, offs_d, stride_kb, stride_ks, BLOCK_N, PAGE
        )
        s_t = tl.dot(k, q_t) * qk_scale  # [BLOCK_N, G]
        s_t = tl.where(n_mask[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        alpha = tl.exp2(m_i - m_new)
        p_t = tl.exp2(s_t - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p_t, 0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p_t.to(v.dtype))
        m_i = m_new
    return tl.trans(acc / tl.where(l_i > 0, l_i, 1.0)[None, :])  # [G, D]


def launch_probe(
    q,
    k,
    v,
    lens,
    tables,
    out,
    mode: int,
    programs: int | None = None,
    keys: int = 128,
    rows: int | None = None,
    warps: int = 4,
):
    """programs: the persistent grid's size; None gives every item its own program. keys: key
    rows a loop step. rows: the q-head tile (BLOCK_G); None gives mode 3 the group's real rows
    and the others 16. warps: num_warps. Returns the compiled kernel (its PTX names the MMA
    instructions Triton chose)."""
    items = HK * q.shape[0]
    if rows is None:
        rows = HQ // HK if mode == 3 else 16
    return _probe_kernel[(programs or items,)](
        q, k, v, lens, tables, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        tables.stride(0), out.stride(0), out.stride(1),
        D**-0.5 * _LOG2E, items,
        GROUP=HQ // HK, BLOCK_G=rows, D=D, BLOCK_N=keys, PAGE=k.shape[1], MODE=mode, HK_=HK,
        num_warps=warps, num_stages=2,
    )  # fmt: skip


def main() -> None:
    bsz = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    ctx = nano_contexts(bsz, torch.Generator().manual_seed(0))
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    layers = [caches(ctx) for _ in range(LAYERS)]
    q = torch.randn(bsz, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ref = torch.empty_like(q)
    k, v, tables = layers[0]
    launch_decode(q, k, v, lens, tables, D**-0.5, 1, *decode_tiles(), out=ref)
    launch_probe(q, k, v, lens, tables, out, 0)
    print(torch.cuda.get_device_name(), f"B={bsz}; mode 0 against the engine's kernel: max abs",
          f"{(out.float() - ref.float()).abs().max().item():.2e}")  # fmt: skip
    kv = LAYERS * 2 * sum(ctx) * HK * D * 2
    nvml = Nvml()
    runs = {"engine kernel": lambda: [
        launch_decode(q, k, v, lens, t, D**-0.5, 1, *decode_tiles(), out=out) for k, v, t in layers
    ]}  # fmt: skip

    def engine_no_pdl():
        launch.PDL = 0  # read at each launch: this replay's decode kernels launch plainly
        try:
            for k, v, t in layers:
                launch_decode(q, k, v, lens, t, D**-0.5, 1, *decode_tiles(), out=out)
        finally:
            launch.PDL = 1

    runs["engine kernel, PDL off"] = engine_no_pdl
    for mode, name in ((0, "probe full"), (1, "no softmax"), (2, "no MMA")):
        runs[name] = lambda m=mode: [launch_probe(q, k, v, lens, t, out, m) for k, v, t in layers]
    launch_probe(q, k, v, lens, tables, out, 4)
    err = (out.float() - ref.float()).abs().max().item()
    runs[f"transposed ({err:.0e})"] = lambda: [
        launch_probe(q, k, v, lens, t, out, 4) for k, v, t in layers
    ]
    # The group's real rows as the MMAs' M (rows) or N (transposed) side: Triton pads a dot
    # under the instruction's shape itself, m16n8k16 pads N only to 8.
    for mode, keys, warps in NARROW:
        kern = launch_probe(q, k, v, lens, tables, out, mode, keys=keys, rows=HQ // HK, warps=warps)
        err = (out.float() - ref.float()).abs().max().item()
        name = f"{'transposed' if mode == 4 else 'rows'} G={HQ // HK} {keys}x{warps}w ({err:.0e})"
        ptx = kern.asm["ptx"]
        print(name, "mma.sync:", ptx.count("mma.sync"), "wgmma:", ptx.count("wgmma.mma_async"),
              "shapes:", sorted(set(re.findall(r"mma\S*\.m(\d+n\d+k\d+)", ptx))))  # fmt: skip
        runs[name] = lambda m=mode, n=keys, w=warps: [
            launch_probe(q, k, v, lens, t, out, m, keys=n, rows=HQ // HK, warps=w)
            for k, v, t in layers
        ]
    for keys in CUDA_CORE_KEYS:
        launch_probe(q, k, v, lens, tables, out, 3, keys=keys)
        err = (out.float() - ref.float()).abs().max().item()
        runs[f"CUDA cores, {keys} keys ({err:.0e})"] = lambda n=keys: [
            launch_probe(q, k, v, lens, t, out, 3, keys=n) for k, v, t in layers
        ]
    for programs in PERSISTENT:
        runs[f"persistent {programs}"] = lambda n=programs: [
            launch_probe(q, k, v, lens, t, out, 0, n) for k, v, t in layers
        ]
    read = torch.randn(kv // 2, device="cuda", dtype=torch.bfloat16)
    runs["torch sum, same bytes"] = lambda: read.sum()
    only = [w for w in os.environ.get("ONLY", "").split(",") if w]  # e.g. ONLY=engine,transposed
    for name, fn in runs.items():
        if only and not any(w in name for w in only):
            continue
        us, watts, mhz, mj = measure(nvml, fn)
        print(
            f"{name:22s} {us:8.1f} us {watts:5.0f} W {mhz} MHz {mj:8.1f} mJ "
            f"{mj * 1e9 / kv:6.1f} pJ/B {kv / us / 1e6:.2f} TB/s",
            flush=True,
        )


if __name__ == "__main__":
    main()

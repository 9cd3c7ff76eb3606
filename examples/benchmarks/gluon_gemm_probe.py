"""A Hopper decode GEMM in Gluon (TMA ring, wgmma) against the tuned cuBLAS products, on
llama3.1-8b's four projections: time in bursts and joules back to back. Twenty-seventh
session, RESULTS.md: it does not beat cuBLAS, and its MMA-free twin shows why (the tensor
cores' own work is most of what the projections spend above a plain read).

The kernel swaps the operands (y^T = W x^T): the weight tile is the wgmma's M side (64 rows a
warpgroup) and the step's rows are its N side (padded to a power of 2, as a TMA box's sides
must be), so up to 256 rows share one read of each weight tile from shared memory. Each
program streams its [BN, K / SPLIT] slab of the weight through a STAGES-deep TMA ring (one
mbarrier a slot, loads issued STAGES - 1 tiles ahead, one async wgmma in flight). With
SPLIT > 1 the programs write fp32 partials [SPLIT, M, N] and a Triton kernel sums them (plus
the residual for o and down). With PDL the first STAGES - 1 weight tiles are requested before
`gdc_wait`: the weights do not depend on the kernel before, only the activations do. NO_MMA
streams the same tiles and multiplies nothing: the energy floor of this data movement.

Modes (CUDA machine, repo root, PYTHONPATH=.:examples/benchmarks):
    python examples/benchmarks/gluon_gemm_probe.py check [M ...]   # configs against fp32
    python examples/benchmarks/gluon_gemm_probe.py time [M ...]    # every config against cuBLAS
    python examples/benchmarks/gluon_gemm_probe.py energy [M ...]  # ... then the 4 x 32 chain, PDL
    python examples/benchmarks/gluon_gemm_probe.py floor [M ...]   # the chain with and without MMAs
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.constexpr_function
def _instr_n(mt):
    n = 256
    while n > mt or mt % n:
        n -= 8
    return n


@gluon.jit
def _issue(
    w_desc, x_desc, w_buf, x_buf, bar, kk, off_n, W_KMAJOR: gl.constexpr, WITH_X: gl.constexpr
):
    # One ring slot: the weight tile, and the activation tile unless it comes later (PDL).
    if W_KMAJOR:
        tma.async_copy_global_to_shared(w_desc, [kk, off_n], bar, w_buf)
    else:
        tma.async_copy_global_to_shared(w_desc, [off_n, kk], bar, w_buf)
    if WITH_X:
        tma.async_copy_global_to_shared(x_desc, [0, kk], bar, x_buf)


@gluon.jit
def gemm_swap_kernel(
    w_desc, x_desc, y_ptr, part_ptr, M, N, K_PER, stride_ym,
    W_KMAJOR: gl.constexpr, SPLIT: gl.constexpr, ACC: gl.constexpr, STAGES: gl.constexpr,
    USE_PDL: gl.constexpr, NO_MMA: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    # w: [N, K] (or its K-major storage [K, N]); x: [M, K]; y: [M, N] bf16 (+= when ACC).
    if W_KMAJOR:
        BK: gl.constexpr = w_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[1]
    else:
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = w_desc.block_type.shape[1]
    MT: gl.constexpr = x_desc.block_type.shape[0]
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    off_n = pid_n * BN
    iters = K_PER // BK
    k0 = pid_k * K_PER

    w_smem = gl.allocate_shared_memory(
        w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout
    )
    x_smem = gl.allocate_shared_memory(
        x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    nbytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes

    # Prologue: STAGES - 1 slots; with PDL the weight tiles go before the wait.
    for s in gl.static_range(STAGES - 1):
        if s < iters:
            mbarrier.expect(ready.index(s), nbytes)
            _issue(w_desc, x_desc, w_smem.index(s), x_smem.index(s), ready.index(s),
                   k0 + s * BK, off_n, W_KMAJOR, not USE_PDL)  # fmt: skip
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
        for s in gl.static_range(STAGES - 1):
            if s < iters:
                tma.async_copy_global_to_shared(
                    x_desc, [0, k0 + s * BK], ready.index(s), x_smem.index(s)
                )

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, _instr_n(MT), 16]
    )
    acc = gl.zeros([BN, MT], gl.float32, mma_layout)
    for i in range(iters):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        if W_KMAJOR:
            a = w_smem.index(slot).permute((1, 0))
        else:
            a = w_smem.index(slot)
        if not NO_MMA:  # NO_MMA: stream the same tiles, multiply nothing (the energy floor)
            acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
            # The wgmma before this one is done: its slot takes the tile STAGES - 1 ahead.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        j = i + STAGES - 1
        if j < iters:
            sj = j % STAGES
            mbarrier.expect(ready.index(sj), nbytes)
            _issue(w_desc, x_desc, w_smem.index(sj), x_smem.index(sj), ready.index(sj),
                   k0 + j * BK, off_n, W_KMAJOR, True)  # fmt: skip
    if not NO_MMA:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))

    offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_layout))
    offs_m = gl.arange(0, MT, layout=gl.SliceLayout(0, mma_layout))
    mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    if SPLIT == 1:
        ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        if ACC:
            acc = acc + gl.load(ptrs, mask=mask, other=0.0).to(gl.float32)
        gl.store(ptrs, acc.to(gl.bfloat16), mask=mask)
    else:
        ptrs = part_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None]
        gl.store(ptrs, acc, mask=mask)


@triton.jit
def split_sum_kernel(part_ptr, y_ptr, M, N, stride_ym, SPLIT: tl.constexpr, ACC: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    # y[m, n] (+)= sum over s of part[s, m, n], in split order (deterministic).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    m, n = offs // N, offs % N
    if ACC:
        total += tl.load(y_ptr + m * stride_ym + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + n, total.to(tl.bfloat16), mask=mask)


def _rows_tile(m: int) -> int:
    # The wgmma's N: the rows padded to a power of 2 (a TMA box's sides must be), at least 8.
    return max(8, triton.next_power_of_2(m))


class SwapGemm:
    """y (+)= x @ w.T for one weight (any of the engine's layouts) and one row count M."""

    def __init__(self, w: torch.Tensor, m: int, bn: int, bk: int, stages: int, split: int,
                 pdl: bool = False, no_mma: bool = False):  # fmt: skip
        self.n, self.k = w.shape
        self.kmajor = w.stride(0) == 1
        assert self.k % (bk * split) == 0 and self.n % bn == 0 and 1 <= m <= 256
        self.m, self.mt = m, _rows_tile(m)
        self.bn, self.bk, self.stages, self.split, self.pdl = bn, bk, stages, split, pdl
        self.no_mma = no_mma
        bf = gl.bfloat16
        if self.kmajor:
            wt = w.t()  # [K, N], contiguous
            lay = gl.NVMMASharedLayout.get_default_for([bk, bn], bf)
            self.w_desc = TensorDescriptor(wt, list(wt.shape), list(wt.stride()), [bk, bn], lay)
        else:
            lay = gl.NVMMASharedLayout.get_default_for([bn, bk], bf)
            self.w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, bk], lay)
        self.x_layout = gl.NVMMASharedLayout.get_default_for([self.mt, bk], bf)
        self.part = (
            torch.empty(split, m, self.n, device=w.device, dtype=torch.float32)
            if split > 1
            else torch.empty(1, device=w.device, dtype=torch.float32)
        )

    def __call__(self, x: torch.Tensor, y: torch.Tensor, accumulate: bool) -> None:
        assert x.shape == (self.m, self.k) and x.stride(1) == 1
        x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [self.mt, self.bk],
                                  self.x_layout)  # fmt: skip
        grid = (self.n // self.bn, self.split)
        gemm_swap_kernel[grid](
            self.w_desc, x_desc, y, self.part, self.m, self.n, self.k // self.split,
            y.stride(0), self.kmajor, self.split, accumulate and self.split == 1,
            self.stages, self.pdl, self.no_mma, num_warps=self.bn // 16, launch_pdl=self.pdl,
        )  # fmt: skip
        if self.split > 1:
            block = 1024
            split_sum_kernel[(triton.cdiv(self.m * self.n, block),)](
                self.part, y, self.m, self.n, y.stride(0), self.split, accumulate, block
            )


def configs(n: int, k: int, m: int):
    """(bn, bk, stages, split) choices for one weight and row count: 64- or 128-row weight
    tiles, K split 1-4 ways, and the deepest ring (at most 8) that fits two programs an SM or
    one."""
    mt = _rows_tile(m)
    for bn, bk, split in itertools.product((64, 128), (64,), (1, 2, 4)):
        if n % bn or k % (bk * split) or (n // bn) * split > 4 * 132:
            continue
        per_stage = 2 * bk * (bn + mt)  # bytes of one ring slot
        for stages in sorted({min(8, budget // per_stage) for budget in (110 << 10, 220 << 10)}):
            if stages >= 2:
                yield bn, bk, stages, split


def check(rows) -> None:
    """Three configs of each shape and row count (first, middle, last), with and without PDL,
    against fp32 products on the four llama projections' shapes."""
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    shapes = {"qkv": (6144, 4096, False), "o": (4096, 4096, False),
              "gate_up": (28672, 4096, True), "down": (4096, 14336, True)}  # fmt: skip
    worst = 0.0
    for name, (n, k, kmajor) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=bf) / k**0.5
        if kmajor:
            w = w.t().contiguous().t()  # same values, K-major storage
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=bf)
            res = torch.randn(m, n, device=dev, dtype=bf)
            acc = name in ("o", "down")  # as the engine adds them into the residual
            ref = (x.float() @ w.float().t()) + (res.float() if acc else 0.0)
            cfgs = list(configs(n, k, m))
            for cfg in {cfgs[0], cfgs[len(cfgs) // 2], cfgs[-1]}:
                for pdl in (False, True):
                    g = SwapGemm(w, m, *cfg, pdl=pdl)
                    y = res.clone()
                    g(x, y, acc)
                    err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                    worst = max(worst, err)
                    assert err < 2**-7, (name, m, cfg, pdl, err)
        print(f"{name}: ok for rows {rows}", flush=True)
    print(f"worst error against fp32, relative to max |y|: {worst:.2e} (bf16 step 2^-8)")


def llama_groups(rows):
    """llama3.1-8b's projection groups with random weights as the engine lays them out (the
    weights are the model's), tuned for these row counts."""
    from batchgen.bench.random_model import build_random_model
    from batchgen.layers import gemm_tuning

    model, _ = build_random_model("llama3.1-8b", torch.bfloat16, torch.device("cuda"), seed=0)
    model.kn_weights_()
    groups = model.projection_groups()
    report = gemm_tuning.tune_projections(groups, rows)
    print(torch.cuda.get_device_name(), f"tuned {report.tuned} of {report.shapes} shapes",
          flush=True)  # fmt: skip
    return groups


NAMES = ("qkv", "o", "gate_up", "down")


def engine_call(ws, acc, x, y):
    """32 layers of one projection the engine's way (tuned cuBLAS / cuBLASLt)."""
    from batchgen.layers import linear

    for w in ws:
        if acc:
            linear.add_linear_(y, x, w)
        else:
            y = linear.linear(x, w)  # the engine uses the product as it is: no copy
    return y


def best_configs(groups, rows, reps=20):
    """Per (projection, M): us of 32 layers, tuned cuBLAS against each Gluon config; returns
    {(name, m): (cfg, us)} of the fastest Gluon config whose output matched cuBLAS's."""
    from batchgen.bench.timing import graph_median_us

    best = {}
    for (ws, acc), name in zip(groups, NAMES):
        n, k = ws[0].shape
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            ref = engine_call(ws[:1], acc, x, y.clone())
            base = graph_median_us(lambda ws=ws, a=acc, x=x, y=y: engine_call(ws, a, x, y), reps)
            line = [f"{name:7s} M={m:<4} cuBLAS {base:7.1f}"]
            for cfg in configs(n, k, m):
                gs = [SwapGemm(w, m, *cfg) for w in ws]
                out = y.clone()
                gs[0](x, out, acc)
                err = (out.float() - ref.float()).abs().max().item() / ref.abs().max().item()
                if err > 2**-7:
                    line.append(f"{cfg} BAD {err:.3f}")
                    continue
                us = graph_median_us(lambda gs=gs, a=acc, x=x, y=y: [g(x, y, a) for g in gs], reps)
                line.append(f"{cfg} {us:.1f}")
                if (name, m) not in best or us < best[name, m][1]:
                    best[name, m] = (cfg, us)
            cfg, us = best.get((name, m), (None, float("nan")))
            mb = len(ws) * ws[0].numel() * 2 / 1e6  # MB / us = TB/s
            print(" | ".join(line), flush=True)
            print(
                f"  -> {name} M={m}: cuBLAS {base:.1f} us ({mb / base:.2f} TB/s), Gluon {cfg} "
                f"{us:.1f} us ({mb / us:.2f} TB/s), {us / base - 1:+.1%}",
                flush=True,
            )
    return best


def chain(groups, rows, cfg_of, variants):
    """All four projections x 32 layers in one graph: tuned cuBLAS against the Gluon kernel in
    each variant (SwapGemm keyword arguments) with config cfg_of[name, m]; burst us (graph
    median) and back-to-back joules."""
    from energy_probe import Nvml, measure

    from batchgen.bench.timing import graph_median_us

    nvml = Nvml()
    for m in rows:
        xs = [
            torch.randn(m, ws[0].shape[1], device="cuda", dtype=torch.bfloat16) for ws, _ in groups
        ]
        ys = [
            torch.randn(m, ws[0].shape[0], device="cuda", dtype=torch.bfloat16) for ws, _ in groups
        ]
        layers = len(groups[0][0])
        nbytes = sum(len(ws) * ws[0].numel() * 2 for ws, _ in groups)

        def cublas(xs=xs, ys=ys, layers=layers):
            for layer in range(layers):
                for (ws, acc), x, y in zip(groups, xs, ys):
                    engine_call(ws[layer : layer + 1], acc, x, y)

        fns = {"cuBLAS": cublas}
        for label, kwargs in variants.items():
            gs = [[SwapGemm(w, m, *cfg_of[name, m], **kwargs) for w in ws]
                  for (ws, _), name in zip(groups, NAMES)]  # fmt: skip

            def gluon_fn(gs=gs, xs=xs, ys=ys, layers=layers):
                for layer in range(layers):
                    for (_, acc), g, x, y in zip(groups, gs, xs, ys):
                        g[layer](x, y, acc)

            fns[label] = gluon_fn
        cells = []
        for name, fn in fns.items():
            burst = graph_median_us(fn, 20)
            us, watts, mhz, mj = measure(nvml, fn)
            cells.append(
                f"{name} burst {burst:6.0f} us, sustained {us:6.0f} us {watts:4.0f} W "
                f"{mhz} MHz {mj:6.2f} mJ ({mj * 1e9 / nbytes:.0f} pJ/B)"
            )
        print(f"M={m:<4} " + " | ".join(cells), flush=True)


def read_floor(groups) -> None:
    """The same 32 layers of weights read by torch sums (no MMA, no TMA), back to back."""
    from energy_probe import Nvml, measure

    ws = [w for g, _ in groups for w in g]
    nbytes = sum(w.numel() * 2 for w in ws)
    us, watts, mhz, mj = measure(Nvml(), lambda: [w.sum() for w in ws])
    print(f"torch sums of the same weights: {us:6.0f} us {watts:4.0f} W {mhz} MHz {mj:6.2f} mJ "
          f"({nbytes / us / 1e6:.2f} TB/s, {mj * 1e9 / nbytes:.0f} pJ/B)", flush=True)  # fmt: skip


# The fastest config of each projection and row count in the twenty-seventh session's first
# call (`time` mode), for the `floor` mode.
BEST = {
    **{("qkv", m): (64, 64, 8, 1) for m in (16, 64, 128)},
    ("qkv", 256): (64, 64, 5, 1),
    **{("o", m): (64, 64, 8, 1) for m in (16, 64, 128)},
    ("o", 256): (64, 64, 5, 2),
    ("gate_up", 16): (128, 64, 6, 1),
    ("gate_up", 64): (128, 64, 4, 1),
    ("gate_up", 128): (128, 64, 3, 1),
    ("gate_up", 256): (128, 64, 4, 1),
    ("down", 16): (128, 64, 6, 2),
    ("down", 64): (64, 64, 8, 1),
    ("down", 128): (64, 64, 8, 1),
    ("down", 256): (64, 64, 5, 1),
}


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "check"
    rows = [int(a) for a in sys.argv[2:]] or [1, 16, 64, 128, 200, 256]
    if mode == "check":
        check(rows)
    else:
        groups = llama_groups(rows)
        if mode == "floor":  # the same tiles streamed with and without the MMAs
            chain(groups, rows, BEST, {"Gluon": {}, "Gluon no MMA": {"no_mma": True}})
            read_floor(groups)
        else:
            best = {key: cfg for key, (cfg, _) in best_configs(groups, rows).items()}
            if mode == "energy":
                chain(groups, rows, best, {"Gluon": {}, "Gluon PDL": {"pdl": True}})

"""fused_moe: kernels vs the expert-loop reference over tokens, experts, top-k and shapes
(experts with no tokens included), reference vs transformers' own MoE blocks, and the op inside
a CUDA graph whose routing changes between replays."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.fused_moe import fused_moe, fused_moe_ref
from batchgen.kernels.fused_moe_tiles import (
    TOKEN_BUCKETS,
    TUNED,
    GemmTile,
    MoeTiles,
    default_tiles,
    tile_config,
    token_bucket,
)
from batchgen.kernels.moe_router import topk_softmax_ref


def moe_inputs(T, E, K, H, I, dtype, device, seed=0, experts=None):
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], routing weights and ids [T, K] (each token
    routed among `experts`, default all)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype).to(device)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype).to(device)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype).to(device)
    logits = torch.randn(T, E, generator=g)
    if experts is not None:
        logits[:, [e for e in range(E) if e not in experts]] = -1e4
    weights, ids = topk_softmax_ref(logits, K, True, torch.float32)
    return hidden, w13, w2, weights.to(device), ids.to(device)


SMALL = MoeTiles(16, GemmTile(32, 32, 2, 4, 1), GemmTile(32, 32, 1, 4, 1))

# (T, E, K, H, I): one token; fewer pairs than experts; K and N remainders (H 40, I 24);
# top-8; a long run per expert.
CASES = [(1, 4, 1, 32, 16), (3, 16, 2, 64, 32), (21, 8, 3, 40, 24), (9, 8, 8, 32, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, E, K, H, I", CASES)
def test_fused_moe_equals_reference(device, close, T, E, K, H, I, dtype):
    # bf16 tl.dot is wrong under Triton's interpreter (kernels/README.md): bf16 is covered by
    # the gpu tests.
    args = moe_inputs(T, E, K, H, I, dtype, device, seed=T)
    out = fused_moe(*args, tiles=SMALL)
    assert out.shape == (T, H) and out.dtype == dtype
    close(out, fused_moe_ref(*args), dtype)


def test_experts_without_tokens_and_weights_rounded(device, close):
    # Tokens reach experts 1 and 6 of 8 only; routing weights in the activations' dtype
    # (Qwen3-MoE) rather than float32 (Mixtral).
    hidden, w13, w2, weights, ids = moe_inputs(12, 8, 2, 32, 16, torch.float16, device, 3, [1, 6])
    assert set(ids.unique().tolist()) == {1, 6}
    weights = weights.to(torch.float16)
    out = fused_moe(hidden, w13, w2, weights, ids, tiles=SMALL)
    close(out, fused_moe_ref(hidden, w13, w2, weights, ids), torch.float16)


def test_fused_activation_equals_the_separate_kernel(device):
    # SiLU-and-mul in gate_up's epilogue rounds as the separate silu_and_mul kernel does.
    args = moe_inputs(10, 4, 2, 32, 48, torch.float32, device, seed=5)
    fused = fused_moe(*args, tiles=SMALL)
    separate = fused_moe(*args, tiles=SMALL._replace(fuse_activation=False))
    assert torch.equal(fused, separate)


def test_bigger_row_blocks_and_counting(device, close):
    # 64-row blocks over 40 tokens (most rows padding); the expert-use counter sees the
    # experts of real tokens only (token_slots < 0 marks padding).
    args = moe_inputs(40, 4, 2, 32, 16, torch.float32, device, seed=8)
    tiles = MoeTiles(64, GemmTile(16, 16, 4, 4, 1), GemmTile(32, 16, 4, 4, 1))
    touched = torch.zeros(1, dtype=torch.int64, device=device)
    slots = torch.full((40,), -1, device=device)
    slots[0] = 7
    out = fused_moe(*args, tiles=tiles, touched=touched, token_slots=slots)
    close(out, fused_moe_ref(*args), torch.float32)
    assert int(touched) == 2  # token 0's two experts


def test_expert_slices_sum_to_the_whole(device, close):
    # Tensor parallel splits each expert's intermediate rows across ranks: the outputs over the
    # two halves (gate / up rows and down columns alike) sum to the output over all of them.
    # Outputs are contiguous [T, H] (a collective reads them as one block).
    hidden, w13, w2, weights, ids = moe_inputs(14, 4, 2, 32, 32, torch.float32, device, seed=6)
    whole_ref = fused_moe_ref(hidden, w13, w2, weights, ids)
    halves = [slice(0, 16), slice(16, 32)]
    for run in (fused_moe_ref, lambda *a: fused_moe(*a, tiles=SMALL)):
        parts = []
        for h in halves:
            w13_h = torch.cat([w13[:, h], w13[:, 32:][:, h]], dim=1).contiguous()  # [E, 2I/2, H]
            parts.append(run(hidden, w13_h, w2[:, :, h].contiguous(), weights, ids))
        assert all(p.is_contiguous() for p in parts)
        close(parts[0] + parts[1], whole_ref, torch.float32)


def test_reference_equals_transformers_moe_blocks():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    for config, block in (
        (
            transformers.Qwen3MoeConfig(
                hidden_size=32, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3,
                norm_topk_prob=False,
            ),
            transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
        ),
        (
            transformers.MixtralConfig(
                hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2
            ),
            transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock,
        ),
    ):  # fmt: skip
        config._experts_implementation = "eager"  # the expert loop
        hf = block(config).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(torch.randn(p.shape) * 0.3)
            hidden = torch.randn(1, 17, 32)
            want = hf(hidden)[0]
            logits = torch.nn.functional.linear(hidden[0], hf.gate.weight)
            renorm = not isinstance(config, transformers.Qwen3MoeConfig)
            weights, ids = topk_softmax_ref(
                logits, config.num_experts_per_tok, renorm, hidden.dtype
            )
            got = fused_moe_ref(
                hidden[0], hf.experts.gate_up_proj, hf.experts.down_proj, weights, ids
            )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tile_choice():
    assert (
        token_bucket(1) == 1 and token_bucket(3) == 4 and token_bucket(10**6) == TOKEN_BUCKETS[-1]
    )
    # Row blocks about twice the pairs an expert gets on average (at least 16).
    assert default_tiles(64, 128, 8).block_m == 16  # 4 pairs per expert
    assert default_tiles(256, 128, 8).block_m == 32  # 16
    assert default_tiles(4096, 8, 2).block_m == 128  # 1024
    # fp32 doubles the operands' bytes: fewer stages fit in shared memory.
    bf16 = tile_config(8, 128, 2048, 768, 8, "bfloat16", 2)
    fp32 = tile_config(8, 128, 2048, 768, 8, "float32", 4)
    assert fp32.gate_up.num_stages < bf16.gate_up.num_stages
    for tiles in (bf16, fp32):
        for tile, b_tiles in ((tiles.gate_up, 2), (tiles.down, 1)):
            per_stage = (tiles.block_m + b_tiles * tile.block_n) * tile.block_k
            itemsize = 4 if tiles is fp32 else 2
            assert per_stage * itemsize * tile.num_stages <= 200 * 1024


def test_tuned_tiles_are_looked_up_by_bucket_and_fit_as_measured():
    # Every token count of a tuned bucket takes its measured tiles, in bf16 unchanged (they ran
    # so on the GPU); fp32 and FP8 weights are other keys and keep the rule of thumb.
    assert TUNED
    for (bucket, E, H, inter, K, dtype), tuned in TUNED.items():
        lowest = max(b for b in (0, *TOKEN_BUCKETS) if b < bucket) + 1
        for tokens in (lowest, bucket):
            assert tile_config(tokens, E, H, inter, K, dtype, 2) == tuned
        rule = default_tiles(bucket, E, K)
        assert tuned[1:] != rule[1:]  # a winner differs from the rule in its GEMM tiles
        for other, itemsize in (("float32", 4), ("float8_e4m3fn", 1)):
            got = tile_config(bucket, E, H, inter, K, other, itemsize)
            assert (got.gate_up.block_n, got.down.block_k) == (
                rule.gate_up.block_n,
                rule.down.block_k,
            )


def test_bad_shapes():
    hidden, w13, w2, weights, ids = moe_inputs(4, 4, 2, 32, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_ref(hidden, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match=r"\[4, K\]"):
        fused_moe_ref(hidden, w13, w2, weights[:3], ids[:3])


# Real shapes: Qwen3-30B-A3B's layer (128 experts, top-8, 2048 -> 768) and Mixtral-8x7B's
# (8 experts, top-2, 4096 -> 14336), tokens 1 to 4096, with the tiles the launcher picks.
REAL = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 5, 16, 64, 100, 256, 512, 1024, 4096])
@pytest.mark.parametrize("shape", list(REAL))
def test_fused_moe_real_shapes(close, shape, T):
    E, K, H, I = REAL[shape]
    args = moe_inputs(T, E, K, H, I, torch.bfloat16, "cuda", seed=T)
    close(fused_moe(*args), fused_moe_ref(*args), torch.bfloat16, scale=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("bucket", TOKEN_BUCKETS)
def test_every_default_tile_on_qwen3_shape(close, bucket):
    E, K, H, I = REAL["qwen3-30b-a3b"]
    T = max(1, bucket - 1)
    args = moe_inputs(T, E, K, H, I, torch.bfloat16, "cuda", seed=bucket, experts=[3, 50, 127])
    for fuse in (True, False):
        tiles = tile_config(T, E, H, I, K, "bfloat16", 2)._replace(fuse_activation=fuse)
        close(fused_moe(*args, tiles=tiles), fused_moe_ref(*args), torch.bfloat16, scale=2.0)


@pytest.mark.gpu
def test_fused_moe_in_a_cuda_graph_follows_the_routing():
    E, K, H, I = REAL["qwen3-30b-a3b"]
    hidden, w13, w2, weights, ids = moe_inputs(48, E, K, H, I, torch.bfloat16, "cuda", seed=1)
    touched = torch.zeros(1, dtype=torch.int64, device="cuda")
    fused_moe(hidden, w13, w2, weights, ids, touched=touched)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(hidden, w13, w2, weights, ids, touched=touched)
    for seed, experts in ((2, None), (3, [0, 1, 2, 3, 4, 5, 6, 7]), (4, list(range(0, E, 3)))):
        new = moe_inputs(48, E, K, H, I, torch.bfloat16, "cuda", seed, experts)
        for static, value in zip((hidden, w13, w2, weights, ids), new):
            if static is not w13 and static is not w2:
                static.copy_(value)
        touched.zero_()
        graph.replay()
        torch.testing.assert_close(
            out.float(), fused_moe_ref(hidden, w13, w2, weights, ids).float(), atol=4e-2, rtol=4e-2
        )
        assert int(touched) == len(ids.unique())


def _variants(kernel) -> int:
    """Compiled variants of a Triton kernel on the current GPU (its in-memory cache)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no device_caches")
    return len(caches[torch.cuda.current_device()][0])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(REAL))
def test_warm_up_compiles_every_token_count(shape):
    # After warm_up no batch size compiles a kernel (a compile mid-run costs about a second).
    from batchgen.kernels import fused_moe as module
    from batchgen.kernels import moe_align

    E, K, H, I = REAL[shape]
    _, w13, w2, _, _ = moe_inputs(1, E, K, H, I, torch.bfloat16, "cuda")
    assert module.warm_up(w13, w2, K, torch.bfloat16) >= 2
    kernels = (module._expert_gemm_kernel, module._moe_sum_kernel, moe_align._moe_align_kernel)
    before = [_variants(k) for k in kernels]
    touched = torch.zeros(1, dtype=torch.int64, device="cuda")
    for i, T in enumerate((1, 3, 17, 100, 255, 777, 1500, 5000, 9000)):
        args = moe_inputs(T, E, K, H, I, torch.bfloat16, "cuda", seed=T)
        weights = args[3].to(torch.bfloat16)
        slots = torch.arange(T, device="cuda") if i % 3 == 2 else None
        counting = dict(touched=touched, token_slots=slots) if i % 3 else {}
        fused_moe(*args[:3], weights, args[4], **counting)  # as the model calls it
    assert [_variants(k) for k in kernels] == before

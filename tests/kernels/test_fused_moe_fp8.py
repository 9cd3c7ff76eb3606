"""fused_moe_fp8: the FP8-weight grouped GEMMs against the expert-loop reference for each scheme
(channel weights with per-token or no activation quantization, block weights with per-group or
none), the reference against its definition, and the argument checks."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.fp8 import FP8_DTYPE
from batchgen.kernels.fused_moe import fused_moe_ref
from batchgen.kernels.fused_moe_fp8 import (
    dequantize_experts_ref,
    fused_moe_fp8,
    fused_moe_fp8_ref,
)
from batchgen.kernels.fused_moe_tiles import GemmTile, MoeTiles
from batchgen.kernels.moe_router import topk_softmax_ref

from batchgen.layers.fp8_linear import Fp8Scheme

SCHEMES = {
    "channel-token": Fp8Scheme("channel", "token"),
    "channel-weight-only": Fp8Scheme("channel", None),
    "block-group": Fp8Scheme("block", "group", (16, 16)),
    "block-weight-only": Fp8Scheme("block", None, (16, 16)),
}
# Tiles no wider than the 16 x 16 weight blocks (the launcher caps them there anyway).
SMALL = MoeTiles(16, GemmTile(16, 16, 2, 4, 1), GemmTile(16, 16, 1, 4, 1))


def e4m3(shape, g) -> torch.Tensor:
    """Random e4m3 values over most of the format's range (|q| up to 448)."""
    return (torch.randn(shape, generator=g) * 60).clamp(-448, 448).to(FP8_DTYPE)


def scales(shape, fan_in: int, g) -> torch.Tensor:
    """Positive scales that give dequantized weights of about 1 / sqrt(fan_in)."""
    return (torch.rand(shape, generator=g) + 0.5) / (60 * fan_in**0.5)


def fp8_moe_inputs(T, E, K, H, I, scheme, dtype, device, seed=0, experts=None):
    """hidden, w13, w13_scale, w2, w2_scale, routing weights and ids, on `device`."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    w13, w2 = e4m3((E, 2 * I, H), g), e4m3((E, H, I), g)
    if scheme.block is None:
        s13, s2 = scales((E, 2 * I), H, g), scales((E, H), I, g)
    else:
        bn, bk = scheme.block
        s13 = scales((E, 2 * -(-I // bn), -(-H // bk)), H, g)
        s2 = scales((E, -(-H // bn), -(-I // bk)), I, g)
    logits = torch.randn(T, E, generator=g)
    if experts is not None:
        logits[:, [e for e in range(E) if e not in experts]] = -1e4
    weights, ids = topk_softmax_ref(logits, K, True, torch.float32)
    tensors = (hidden, w13, s13, w2, s2, weights, ids)
    return tuple(t.to(device) for t in tensors)


# (T, E, K, H, I): one token; I not a multiple of the 16-row blocks (gate and up blocks apart);
# K and N remainders; top-8.
CASES = [(1, 4, 1, 32, 16), (7, 8, 2, 48, 24), (21, 8, 3, 40, 40), (9, 8, 8, 32, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("T, E, K, H, I", CASES)
def test_fused_moe_fp8_equals_reference(device, close, T, E, K, H, I, scheme, dtype):
    args = fp8_moe_inputs(T, E, K, H, I, SCHEMES[scheme], dtype, device, seed=T + I)
    out = fused_moe_fp8(*args, SCHEMES[scheme], tiles=SMALL)
    assert out.shape == (T, H) and out.dtype == dtype
    want = fused_moe_fp8_ref(*args, SCHEMES[scheme])
    assert want.abs().max() > 0.1  # a real, non-degenerate product
    close(out, want, dtype, scale=4)


def test_experts_without_tokens_and_the_counter(device, close):
    scheme = SCHEMES["block-group"]
    args = fp8_moe_inputs(12, 8, 2, 32, 32, scheme, torch.float16, device, 3, [1, 6])
    assert set(args[-1].unique().tolist()) == {1, 6}
    touched = torch.zeros(1, dtype=torch.int64, device=device)
    out = fused_moe_fp8(*args, scheme, tiles=SMALL, touched=touched)
    close(out, fused_moe_fp8_ref(*args, scheme), torch.float16, scale=4)
    assert int(touched) == 2


@pytest.mark.parametrize("scheme", ["channel-weight-only", "block-weight-only"])
def test_weight_only_reference_is_the_16_bit_moe_of_the_dequantized_weights(scheme):
    # No activation quantization: the reference is fused_moe_ref over float(q) * scale.
    s = SCHEMES[scheme]
    hidden, w13, s13, w2, s2, weights, ids = fp8_moe_inputs(9, 4, 2, 48, 24, s, torch.float32,
                                                            "cpu", seed=4)  # fmt: skip
    w13f = dequantize_experts_ref(w13, s13, s, 24)
    w2f = dequantize_experts_ref(w2, s2, s)
    want = fused_moe_ref(hidden, w13f, w2f, weights, ids)
    torch.testing.assert_close(fused_moe_fp8_ref(hidden, w13, s13, w2, s2, weights, ids, s), want)


def test_block_dequantization_keeps_gate_and_up_blocks_apart():
    # I = 24 rows of gate, then 24 of up, 16-row blocks: scale rows 0-1 for the gate, 2-3 for up.
    s = SCHEMES["block-weight-only"]
    q = torch.ones(1, 48, 16).to(FP8_DTYPE)
    scale = torch.tensor([[[1.0], [2.0], [3.0], [4.0]]])
    w = dequantize_experts_ref(q, scale, s, 24)[0, :, 0]
    assert w.tolist() == [1.0] * 16 + [2.0] * 8 + [3.0] * 16 + [4.0] * 8


def test_activation_quantization_changes_the_product(device):
    # The token scheme really quantizes the activations: not the weight-only result.
    token, none = SCHEMES["channel-token"], SCHEMES["channel-weight-only"]
    args = fp8_moe_inputs(7, 8, 2, 48, 24, token, torch.float32, device, seed=1)
    a = fused_moe_fp8(*args, token, tiles=SMALL)
    b = fused_moe_fp8(*args, none, tiles=SMALL)
    assert not torch.allclose(a, b, atol=1e-5)


def test_bad_arguments():
    s = SCHEMES["channel-token"]
    hidden, w13, s13, w2, s2, weights, ids = fp8_moe_inputs(3, 4, 2, 32, 16, s, torch.float32,
                                                            "cpu")  # fmt: skip
    with pytest.raises(ValueError, match=r"w13_scale must be \[4, 32\] float32"):
        fused_moe_fp8_ref(hidden, w13, s13[:, :16], w2, s2, weights, ids, s)
    with pytest.raises(ValueError, match="activation 'tensor' is not supported for experts"):
        fused_moe_fp8_ref(hidden, w13, s13, w2, s2, weights, ids, Fp8Scheme("channel", "tensor"))
    with pytest.raises(ValueError, match="weights .* must be torch.float8_e4m3fn"):
        fused_moe_fp8_ref(hidden, w13.float(), s13, w2, s2, weights, ids, s)
    blocks = SCHEMES["block-group"]
    with pytest.raises(ValueError, match=r"w2_scale must be \[4, 2, 1\]"):
        fused_moe_fp8_ref(hidden, w13, torch.ones(4, 2, 2), w2, s2, weights, ids, blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["channel-token", "block-group"])
@pytest.mark.parametrize("T", [1, 64, 512])
def test_fused_moe_fp8_qwen3_30b_shape(scheme, T):
    # Qwen3-30B-A3B's sparse layer (128 experts, top-8, hidden 2048, intermediate 768) in bf16
    # with 128 x 128 blocks, default tiles: within bf16 rounding of the fp32 reference.
    s = SCHEMES[scheme]
    if s.block is not None:
        s = Fp8Scheme("block", "group", (128, 128))
    args = fp8_moe_inputs(T, 128, 8, 2048, 768, s, torch.bfloat16, "cuda", seed=T)
    got = fused_moe_fp8(*args, s)
    want = fused_moe_fp8_ref(*args, s)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)

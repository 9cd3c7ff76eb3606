"""topk_softmax: kernel vs reference, reference vs transformers' Qwen3-MoE and Mixtral routers."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.launch import KERNEL_DTYPES
from batchgen.kernels.moe_router import topk_softmax, topk_softmax_ref


def logits(T: int, E: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(T, E, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", list(KERNEL_DTYPES))
@pytest.mark.parametrize(
    "T, E, K, renormalize",
    [(1, 4, 1, False), (5, 8, 2, True), (19, 60, 4, True), (33, 128, 8, False), (3, 6, 6, True)],
)
def test_topk_softmax_equals_reference(device, close, T, E, K, renormalize, dtype):
    x = logits(T, E, dtype, seed=T).to(device)
    for weights_dtype in (torch.float32, dtype):
        w, ids = topk_softmax(x, K, renormalize, weights_dtype)
        w_ref, ids_ref = topk_softmax_ref(x, K, renormalize, weights_dtype)
        assert w.dtype == weights_dtype and ids.dtype == torch.int32 and w.shape == (T, K)
        # Rounded logits can tie (fp16 / bf16 over 128 experts): compare the chosen
        # probabilities, and the ids of rows whose top K + 1 probabilities all differ.
        close(w, w_ref, weights_dtype)
        probs = torch.softmax(x.float(), dim=-1).topk(min(K + 1, E)).values
        distinct = (probs[:, 1:] != probs[:, :-1]).all(dim=1)
        assert torch.equal(ids[distinct], ids_ref[distinct])
        assert distinct.float().mean() > 0.5


def test_ties_go_to_the_lower_expert(device):
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]], device=device)
    w, ids = topk_softmax(x, 2, False, torch.float32)
    assert ids.tolist() == [[1, 2]]


def test_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        topk_softmax_ref(torch.zeros(2, 4), 5, True, torch.float32)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_reference_equals_transformers_router(arch):
    transformers = pytest.importorskip("transformers")
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True
        )
        router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
        dtype = torch.bfloat16  # Qwen3-MoE rounds the weights to the model's dtype
    else:
        config = transformers.MixtralConfig(
            hidden_size=32, num_local_experts=8, num_experts_per_tok=2
        )
        router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(config)
        dtype = torch.float32  # Mixtral keeps them in float32
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router = router.to(torch.bfloat16)
        hidden = torch.randn(40, 32, generator=g).to(torch.bfloat16)
        router_logits, ref_weights, ref_ids = router(hidden)
    k, renorm = config.num_experts_per_tok, arch == "mixtral" or config.norm_topk_prob
    w, ids = topk_softmax_ref(router_logits, k, renorm, dtype)
    assert torch.equal(ids, ref_ids.to(torch.int32))
    assert w.dtype == ref_weights.dtype and torch.equal(w, ref_weights)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 256, 4096])
@pytest.mark.parametrize("E, K", [(128, 8), (8, 2)])
def test_topk_softmax_real_shapes(close, T, E, K):
    x = logits(T, E, torch.bfloat16, seed=T).cuda()
    w, ids = topk_softmax(x, K, True, torch.bfloat16)
    w_ref, ids_ref = topk_softmax_ref(x, K, True, torch.bfloat16)
    close(w, w_ref, torch.bfloat16)
    chosen = torch.gather(torch.softmax(x.float(), -1), 1, ids.long())
    chosen_ref = torch.gather(torch.softmax(x.float(), -1), 1, ids_ref.long())
    torch.testing.assert_close(chosen, chosen_ref)  # same probabilities, even across ties

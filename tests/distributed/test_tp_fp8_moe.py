"""Online FP8 experts (quantization: fp8) of MoE models under tensor parallel on CPU (gloo, two
processes): each rank quantizes its slice, so the row-parallel projections (o, the dense down,
each expert's down) quantize each rank's block of input columns apart; the log-probs equal
transformers' model doing exactly that split math."""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import fake_quant, write_compressed_tensors

from batchgen import LLM

OPTIONS = dict(
    dtype="float32", max_model_len=96, num_kv_blocks=96, block_size=8, max_num_batched_tokens=32
)


def _split_fp8_reference(path: str, ranks: int):
    """transformers' model of `path` doing online FP8 as `ranks` ranks do: every projection's
    weight per row and input per token, except that the row-parallel ones (o, the dense down
    and each expert's down) take each rank's block of input columns apart (quantized apart,
    partial products summed); the routers stay 16-bit."""
    import types

    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def split(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # x [n, K] @ w [N, K]^T
        pairs = zip(x.chunk(ranks, dim=-1), w.chunk(ranks, dim=-1))
        return sum(fake_quant(p) @ fake_quant(b).t() for p, b in pairs)

    def row_parallel(w: torch.Tensor):
        def forward(x: torch.Tensor) -> torch.Tensor:
            return split(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], -1)

        return forward

    def experts_forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            gate, up = (fake_quant(hidden[token]) @ fake_quant(self.gate_up_proj[e]).t()).chunk(
                2, -1
            )
            y = split(torch.nn.functional.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out

    for name, module in hf.named_modules():
        leaf = name.rpartition(".")[2]
        if hasattr(module, "gate_up_proj") and isinstance(module.gate_up_proj, torch.Tensor):
            module.forward = types.MethodType(experts_forward, module)
        elif isinstance(module, torch.nn.Linear) and leaf in ("o_proj", "down_proj"):
            module.forward = row_parallel(module.weight.detach())
        elif isinstance(module, torch.nn.Linear) and leaf in ("q_proj", "k_proj", "v_proj",
                                                              "gate_proj", "up_proj"):  # fmt: skip
            with torch.no_grad():
                module.weight.copy_(fake_quant(module.weight))
            module.register_forward_pre_hook(lambda m, a: (fake_quant(a[0]),))
    return hf


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_online_fp8_experts_two_ranks_equal_their_split_math(tiny_moe_dir, variant):
    path = tiny_moe_dir(variant)
    prompts, cands = [[0, 17, 42, 99, 5], [0, 250, 3, 3]], [[[301, 12, 7, 250]], [[77, 140, 2]]]
    parallel = LLM(path, tensor_parallel_size=2, quantization="fp8", **OPTIONS)
    try:
        out = parallel.score(prompts, cands, return_token_logprobs=True, use_tqdm=False)
    finally:
        parallel.shutdown()
    got = [lp for row in out for r in row for lp in r.token_logprobs]
    hf = _split_fp8_reference(path, 2)
    ref = []
    with torch.no_grad():
        for prompt, (c,) in zip(prompts, cands):
            logprobs = torch.log_softmax(hf(torch.tensor([prompt + c])).logits[0].float(), -1)
            ref += [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(c)]
    assert len(got) == len(ref) == 7
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-4


@pytest.mark.parametrize("weights", ["channel", "tensor"])
def test_weight_only_fp8_moe_checkpoint_two_ranks_equal_one(tiny_moe_dir, tmp_path, weights):
    # Each rank reads its rows of every expert's gate / up weights and their scales (the down
    # projections' scales whole); without activation quantization the split is exact in fp32.
    ckpt = write_compressed_tensors(tiny_moe_dir("qwen3_moe"), tmp_path / "ckpt", weights, None)
    prompts, cands = [[0, 17, 42, 99, 5], [0, 250, 3, 3]], [[[301, 12, 7, 250]], [[77, 140, 2]]]

    def logprobs(**extra) -> list[float]:
        llm = LLM(ckpt, **OPTIONS, **extra)
        try:
            out = llm.score(prompts, cands, return_token_logprobs=True, use_tqdm=False)
        finally:
            llm.shutdown()
        return [lp for row in out for r in row for lp in r.token_logprobs]

    one, two = logprobs(), logprobs(tensor_parallel_size=2)
    assert len(one) == len(two) == 7
    assert max(abs(a - b) for a, b in zip(one, two)) <= 1e-4

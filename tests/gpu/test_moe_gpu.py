"""On a CUDA device: mixture-of-experts models through the GPU path (Triton router, alignment and
grouped GEMMs, decode and mixed-step CUDA graphs) equal the CPU path and transformers."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MIXED_STEPS = dict(
    max_model_len=512, num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=256,
    mixed_chunk_tokens=48,
)  # fmt: skip


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, 500) for _ in range(rng.randrange(3, 300))] for _ in range(n)]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen3_moe_step2", "mixtral"])
def test_tiny_moe_greedy_gpu_equals_cpu(tiny_moe_dir, variant, enforce_eager):
    path = tiny_moe_dir(variant)
    batch = prompts(24)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    common = dict(dtype="float32", max_model_len=512, num_kv_blocks=1024, max_num_seqs=16)
    cpu = LLM(path, device="cpu", **common).generate(batch, params, use_tqdm=False)
    gpu = LLM(path, device="cuda", enforce_eager=enforce_eager, **common)
    out = gpu.generate(batch, params, use_tqdm=False)
    assert [o.token_ids for o in out] == [o.token_ids for o in cpu]


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_moe_mixed_chunk_graphs_equal_eager_steps_and_cpu(tiny_moe_dir, variant):
    """Prompts riding in decode steps as mixed-step CUDA graphs (padding rows routed to experts
    too) give the eager steps' tokens and the CPU's, and count the same experts as the eager
    steps (graph padding rows are not counted)."""
    path = tiny_moe_dir(variant)
    batch = prompts(40, seed=2)
    params = [SamplingParams(max_tokens=20 + 3 * i, temperature=0.0) for i in range(len(batch))]
    common = dict(dtype="float32", **MIXED_STEPS)
    eager_llm = LLM(path, device="cuda", **common)
    engine = eager_llm.engine
    engine.scheduler.mixed_chunk_room = engine.runner.mixed_graphs.riding_rows
    engine.runner.mixed_graphs = None
    engine.runner.graphs = None  # decode steps eager too
    eager, eager_touched = generate_counting(eager_llm, batch, params)
    gpu_llm = LLM(path, device="cuda", **common)
    mixed = gpu_llm.engine.runner.mixed_graphs
    chunks = []
    run = mixed.run

    def spy(step, patch=None):
        chunks.append(len(step.seq_lens) - step.num_decode_rows)
        return run(step, patch)

    mixed.run = spy
    gpu, gpu_touched = generate_counting(gpu_llm, batch, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in eager]
    assert len(chunks) > 10 and max(chunks) > 1
    assert gpu_touched == eager_touched > 0
    cpu = LLM(path, device="cpu", **common).generate(batch, params, use_tqdm=False)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


def generate_counting(llm: LLM, batch, params):
    """(outputs, experts the run's steps reached, from the model's device counter)."""
    counter = llm.engine.runner.model.expert_counter
    before = counter.read()
    outs = llm.generate(batch, params, use_tqdm=False)
    return outs, counter.read() - before


def test_qwen3_30b_a3b_layers_bf16_logits_match_transformers():
    """Four layers of Qwen3-30B-A3B's shape (128 experts, top-8) in bf16: our logits are as
    close to an fp32 transformers reference as transformers' own bf16 logits are."""
    transformers = pytest.importorskip("transformers")
    from batchgen.layers.context import AttentionContext
    from batchgen.models.config import ModelConfig
    from batchgen.models.hf_export import to_hf_state_dict
    from batchgen.models.loader import build_model
    from batchgen.models.presets import BENCH_PRESETS

    preset = {**BENCH_PRESETS["qwen3-30b-a3b"], "num_hidden_layers": 4, "mlp_only_layers": [2]}
    config = ModelConfig.from_dict(preset)
    device = torch.device("cuda")
    model = build_model(config, torch.bfloat16, device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=gen)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5, generator=gen)  # decisive routing
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.kn_weights_()  # as the engine runs it (the dense layer's MLP K-major)
    state = {k: v.float() for k, v in to_hf_state_dict(model).items()}
    batch = prompts(3, seed=1)
    ids = torch.tensor([t for p in batch for t in p], device=device)
    pos = torch.cat([torch.arange(len(p), device=device) for p in batch])
    with torch.no_grad():
        ctx = AttentionContext.for_prompts([len(p) for p in batch], device)
        ours = model.compute_logits(model(ids, pos, ctx)).float()
    del model
    torch.cuda.empty_cache()
    hf_config = transformers.Qwen3MoeConfig(
        **{k: v for k, v in preset.items() if k not in ("torch_dtype", "architectures")},
        experts_implementation="eager",  # transformers' loop over experts
    )
    with torch.device(device):
        hf = transformers.Qwen3MoeForCausalLM(hf_config).float().eval()
    loaded = hf.load_state_dict(state, strict=False)
    del state
    assert not loaded.unexpected_keys
    assert all("rotary" in k for k in loaded.missing_keys), loaded.missing_keys

    def hf_logits() -> torch.Tensor:
        with torch.no_grad():
            return torch.cat(
                [hf(torch.tensor([p], device=device)).logits[0].float() for p in batch]
            )

    ref = hf_logits()
    hf.to(torch.bfloat16)
    hf_bf16 = hf_logits()
    ours_err = (ours - ref).abs().max().item()
    hf_err = (hf_bf16 - ref).abs().max().item()
    assert ours_err <= 1.5 * hf_err + 1e-3, (ours_err, hf_err)
    # And the greedy choice: ours agrees with the fp32 reference's argmax about as often as
    # transformers' bf16 does. (Near-ties are everywhere: random weights give a median top-2
    # gap of ~0.14 against a max bf16 error of ~2, so no token is "clearly" decided.)
    a = ref.argmax(-1)
    ours_agree = (ours.argmax(-1) == a).float().mean().item()
    hf_agree = (hf_bf16.argmax(-1) == a).float().mean().item()
    ours_mean, hf_mean = (ours - ref).abs().mean().item(), (hf_bf16 - ref).abs().mean().item()
    print(
        f"max |err| ours {ours_err:.3f} hf bf16 {hf_err:.3f}; mean {ours_mean:.4f} vs "
        f"{hf_mean:.4f}; argmax agreement {ours_agree:.3f} vs {hf_agree:.3f} of {len(a)}"
    )
    assert ours_mean <= 1.5 * hf_mean, (ours_mean, hf_mean)
    assert ours_agree >= hf_agree - 0.03, (ours_agree, hf_agree)


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_fp8_experts_on_the_gpu(tiny_moe_dir, variant):
    """Online FP8 experts (quantization: fp8) on the GPU: a sparse block of the loaded model
    equals fused_moe_fp8_ref on its own routing (the FP8 MMA's partial sums aside), and greedy
    generation gives the same tokens with CUDA graphs (fp8 kernels captured) as eager."""
    from batchgen.kernels.fused_moe_fp8 import fused_moe_fp8_ref

    from batchgen.layers.moe import Fp8FusedExperts, SparseMoeBlock

    path = tiny_moe_dir(variant)
    common = dict(max_model_len=512, num_kv_blocks=256, max_num_seqs=16, quantization="fp8")
    llm = LLM(path, device="cuda", dtype="float32", **common)
    block = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock))
    experts = block.experts
    assert isinstance(experts, Fp8FusedExperts)
    hidden = torch.randn(37, experts.gate_up_proj.shape[2], device="cuda")
    with torch.no_grad():
        got = block(hidden)
        weights, ids = block.route(hidden)
        want = fused_moe_fp8_ref(
            hidden, experts.gate_up_proj, experts.gate_up_scale, experts.down_proj,
            experts.down_scale, weights, ids, experts.scheme,
        )  # fmt: skip
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * scale)
    batch = prompts(16, seed=4)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs = [
        LLM(path, device="cuda", dtype="float32", enforce_eager=eager, **common).generate(
            batch, params, use_tqdm=False
        )
        for eager in (False, True)
    ]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert all(len(o.token_ids) == 24 and o.error is None for o in outs[0])

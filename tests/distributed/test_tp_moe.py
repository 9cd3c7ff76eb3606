"""Mixture-of-experts models under tensor parallel on CPU (gloo, two processes, fp32): each rank
reads its slice of every expert (never a whole expert), and TP=2 equals TP=1 on the tiny
Qwen3-MoE (a dense layer beside the sparse one) and Mixtral: logits, greedy tokens, seeded
samples, logprobs and scores.

The engine tests share one two-rank engine per model (a worker process costs a few seconds);
the reference is the same model at tensor_parallel_size 1 in this process.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from tp_compare import assert_same_generations, assert_same_scores, mixed_params, random_prompts

from batchgen import LLM
from batchgen.config import ConfigError, EngineConfig
from batchgen.distributed.group import TensorParallel
from batchgen.engine.tensor_parallel import check_tensor_parallel
from batchgen.layers.context import AttentionContext
from batchgen.models import weights
from batchgen.models.config import ModelConfig
from batchgen.models.loader import load_model
from batchgen.models.make_model import make_model
from batchgen.models.moe_config import CHECKPOINT_NAMES
from batchgen.models.presets import TINY_PRESETS

ARCHS = ["qwen3_moe", "mixtral"]  # tiny qwen3_moe: layer 0 sparse, layer 1 dense
OPTIONS = dict(
    dtype="float32", max_model_len=96, num_kv_blocks=96, block_size=8, max_num_batched_tokens=32
)
MAX_TOKENS = 10
LENGTHS = [7, 1, 23, 12]  # the ragged batch of the logits check


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    out = {}
    for arch in ARCHS:
        path = str(tmp_path_factory.mktemp(arch))
        make_model(path, arch, seed=4)
        out[arch] = path
    return out


def ragged_batch() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(5, 300) for _ in range(n)] for n in LENGTHS]


# ---- loading: every rank its slice of each expert --------------------------------------------


def expected_expert_slices(hf: dict[str, torch.Tensor], arch: str, rank: int, size: int):
    """Our stacked expert parameters on `rank`, cut from the per-expert HF tensors by plain
    arithmetic: each expert's gate and up rows [r I/N, (r+1) I/N), its down columns alike."""
    block, (gate, up, down) = CHECKPOINT_NAMES[TINY_PRESETS[arch]["architectures"][0]]
    out = {}
    for name in hf:
        prefix = f".{block}.experts.0.{gate}.weight"
        if not name.endswith(prefix):
            continue
        layer = name[: -len(prefix)]
        per = hf[name].shape[0] // size
        rows = slice(rank * per, (rank + 1) * per)
        experts = {
            k.split(".experts.")[1].split(".")[0] for k in hf if f"{layer}.{block}.experts." in k
        }
        expert = [f"{layer}.{block}.experts.{e}." for e in range(len(experts))]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat([hf[p + f"{gate}.weight"][rows], hf[p + f"{up}.weight"][rows]])
                for p in expert
            ]
        )  # [E, 2 I/N, H]
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack(
            [hf[p + f"{down}.weight"][:, rows] for p in expert]
        )  # [E, H, I/N]
        out[f"{layer}.mlp.gate.weight"] = hf[f"{layer}.{block}.gate.weight"]  # router: whole
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rank", [0, 1])
def test_rank_reads_its_slice_of_every_expert(model_dirs, arch, rank, monkeypatch):
    path = model_dirs[arch]
    hf = load_file(os.path.join(path, "model.safetensors"))
    read_sliced: dict[str, tuple[int, int, int]] = {}
    real = weights._read_slice

    def spy(f, file, name, dim, block):
        read_sliced[name] = (dim, block.start, block.length)
        return real(f, file, name, dim, block)

    monkeypatch.setattr(weights, "_read_slice", spy)
    tp = TensorParallel(rank, 2, torch.device("cpu"))  # no process group: loading needs none
    model, config = load_model(path, "float32", "cpu", tp=tp)
    got = dict(model.named_parameters())
    want = expected_expert_slices(hf, arch, rank, 2)
    assert want  # the checkpoint has sparse layers
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    # Every expert tensor was read as a slice of the file, never whole; routers whole.
    block, (gate, up, down) = CHECKPOINT_NAMES[config.architecture]
    per = config.moe.intermediate_size // 2
    experts = [n for n in hf if f".{block}.experts." in n]
    assert len(experts) == 3 * config.moe.num_experts * config.moe.num_sparse_layers
    for name in experts:
        dim = 1 if name.endswith(f".{down}.weight") else 0
        assert read_sliced[name] == (dim, rank * per, per), name
    assert not any(n.endswith(f"{block}.gate.weight") for n in read_sliced)
    if arch == "qwen3_moe":  # the dense layer splits by the model's intermediate_size
        dense = config.intermediate_size // 2
        assert read_sliced["model.layers.1.mlp.gate_proj.weight"] == (0, rank * dense, dense)
        assert got["model.layers.1.mlp.down_proj.weight"].shape == (config.hidden_size, dense)


def test_expert_size_that_cannot_split_is_refused_before_start():
    raw = {**TINY_PRESETS["qwen3_moe"], "vocab_size": 512, "moe_intermediate_size": 33}
    engine = EngineConfig(model="m", tensor_parallel_size=2, device="cpu")
    split = r"tensor_parallel_size=2 does not divide.*moe_intermediate_size=33 \(config.json\)"
    with pytest.raises(ConfigError, match=split + r"; sizes that split this model: 1$"):
        check_tensor_parallel(engine, ModelConfig.from_dict(raw))
    # Mixtral's experts are sized by intermediate_size; named so.
    raw = {**TINY_PRESETS["mixtral"], "vocab_size": 512, "intermediate_size": 175}
    with pytest.raises(ConfigError, match=r"intermediate_size=175 \(config.json\)"):
        check_tensor_parallel(engine, ModelConfig.from_dict(raw))
    # A dense intermediate_size no layer uses (every Qwen3-MoE layer sparse) does not matter.
    raw = {**TINY_PRESETS["qwen3_moe"], "vocab_size": 512, "mlp_only_layers": []}
    check_tensor_parallel(engine, ModelConfig.from_dict({**raw, "intermediate_size": 175}))


# ---- logits: two gloo ranks in their own processes ------------------------------------------

_RANK_SCRIPT = """
import json, sys, torch
import torch.distributed as dist
from batchgen.distributed.group import TensorParallel
from batchgen.layers.context import AttentionContext
from batchgen.models.loader import load_model

rank, store_path, spec = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
torch.set_num_threads(1)
tp = TensorParallel.start(rank, 2, torch.device("cpu"), dist.FileStore(store_path, 2))
try:
    prompts = spec["prompts"]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    ctx = AttentionContext.for_prompts([len(p) for p in prompts])
    for name, path in spec["models"].items():
        model, _ = load_model(path, "float32", "cpu", tp=tp)
        with torch.no_grad():
            logits = model.compute_logits(model(ids, positions, ctx))
        if rank == 0:
            torch.save(logits, f"{spec['out']}/{name}.pt")
finally:
    tp.close()
"""


def single_rank_logits(path: str, prompts: list[list[int]]) -> torch.Tensor:
    model, _ = load_model(path, "float32", "cpu")
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        hidden = model(ids, positions, AttentionContext.for_prompts([len(p) for p in prompts]))
        return model.compute_logits(hidden)


def test_logits_equal_one_rank_on_a_ragged_batch(model_dirs, tmp_path):
    prompts = ragged_batch()
    spec = json.dumps({"prompts": prompts, "models": model_dirs, "out": str(tmp_path)})
    store = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, str(rank), store, spec],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for arch, path in model_dirs.items():
        want = single_rank_logits(path, prompts)
        got = torch.load(tmp_path / f"{arch}.pt")
        assert got.shape == want.shape == (sum(LENGTHS), want.shape[1])
        assert (got - want).abs().max().item() <= 1e-4, arch
        assert want.std().item() > 0.1  # a real, non-degenerate reference


# ---- the engine: generate and score ---------------------------------------------------------


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts()


@pytest.fixture(scope="module", params=ARCHS)
def engines(request, model_dirs):
    """(tensor_parallel_size 1 LLM, tensor_parallel_size 2 LLM) over one tiny MoE model."""
    path = model_dirs[request.param]
    single = LLM(path, **OPTIONS)
    parallel = LLM(path, tensor_parallel_size=2, **OPTIONS)
    yield single, parallel
    parallel.shutdown()


def test_generate_equals_one_rank(engines, prompts):
    single, parallel = engines
    counters = [llm.engine.runner.model.expert_counter for llm in (single, parallel)]
    before = [c.read() for c in counters]
    want = single.generate(prompts, mixed_params(MAX_TOKENS, 5), use_tqdm=False)
    got = parallel.generate(prompts, mixed_params(MAX_TOKENS, 5), use_tqdm=False)
    assert_same_generations(got, want)
    # The replicated router sends rank 0's tokens to the experts one rank's model picks.
    touched = [c.read() - b for c, b in zip(counters, before)]
    assert touched[0] == touched[1] > 0


def test_scores_within_1e4(engines, prompts):
    assert_same_scores(*engines, prompts)

"""The trained-tiny recipe: its training model is transformers' Llama, its text and manifest are
what the shipped copy records, and the shipped model's perplexity moves by under 1% with FP8."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from batchgen.models import stdlib_text, trained_tiny
from batchgen.models.train_tiny import TrainableLlama, TrainConfig, heldout_loss, train

SHIPPED = Path(__file__).resolve().parents[2] / "examples" / "trained-tiny"
SMALL = {**trained_tiny.CONFIG, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "head_dim": 16, "vocab_size": 300}  # fmt: skip


def test_trainable_llama_equals_transformers():
    transformers = pytest.importorskip("transformers")
    model = TrainableLlama(SMALL)
    model.init_weights_(seed=3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    missing = hf.load_state_dict(model.state_dict(), strict=False)
    assert missing.unexpected_keys == [] and set(missing.missing_keys) <= {"lm_head.weight"}
    hf.tie_weights()
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_training_lowers_the_loss_and_is_seeded():
    tokens = torch.arange(4000) % 37  # a periodic stream: learnable from context

    def run(steps: int) -> tuple[TrainableLlama, list[float]]:
        cfg = TrainConfig(steps=steps, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=2,
                          weight_decay=0.0, seed=1)  # fmt: skip
        model = TrainableLlama(SMALL)
        model.init_weights_(seed=1)
        return model, [h["loss"] for h in train(model, tokens, cfg, log=lambda m: None)]

    model, losses = run(10)
    assert losses[-1] < losses[0] / 2
    assert heldout_loss(model, tokens[:500], 32) < math.log(37)
    (a, _), (b, _) = run(3), run(3)  # the same seeds, the same weights
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_text_files_exist_and_are_disjoint():
    train, held_out = stdlib_text.read_split("train"), stdlib_text.read_split("eval")
    assert not {f.name for f in train} & {f.name for f in held_out}
    record = stdlib_text.manifest(held_out)
    assert record["text_bytes"] == len(stdlib_text.joined_text(held_out).encode())
    assert [f["name"] for f in record["files"]] == list(stdlib_text.EVAL_FILES)


@pytest.mark.skipif(not SHIPPED.is_dir(), reason="examples/trained-tiny is not in this checkout")
def test_shipped_model_records_its_recipe():
    manifest = json.loads((SHIPPED / trained_tiny.MANIFEST_FILE).read_text())
    for split, files in stdlib_text.SPLITS.items():
        assert [f["name"] for f in manifest["text"][split]["files"]] == list(files)
    assert manifest["train_config"] == trained_tiny.TRAIN.__dict__
    config = json.loads((SHIPPED / "config.json").read_text())
    assert {k: config[k] for k in trained_tiny.CONFIG} == trained_tiny.CONFIG
    # Clearly better than a unigram model of the training text (6.41 nats on the held-out
    # text, perplexity 605, add-one smoothed counts; the shipped model: 4.96).
    assert manifest["heldout_loss_fp32"] < 5.5


COMMON = dict(dtype="bfloat16", device="cpu", max_model_len=512)


@pytest.fixture(scope="module")
def bf16_perplexity():
    """The shipped model's bf16 perplexity on the held-out text's first 1,800 tokens."""
    from batchgen import LLM

    text = stdlib_text.joined_text(stdlib_text.read_split("eval"))[:5000]
    base = LLM(str(SHIPPED), **COMMON).perplexity([text], 512, 256, use_tqdm=False)[0]
    assert base.perplexity < 300  # the trained model, not noise (a unigram model: 605)
    return text, base


@pytest.mark.skipif(not SHIPPED.is_dir(), reason="examples/trained-tiny is not in this checkout")
@pytest.mark.parametrize(
    "options",
    [
        {"quantization": "fp8"},
        {"kv_cache_dtype": "fp8"},
        {"quantization": "fp8", "kv_cache_dtype": "fp8", "calibrate_kv_scales": 4},
    ],
    ids=["fp8-weights", "fp8-kv", "both"],
)
def test_fp8_perplexity_within_one_percent_of_bf16(bf16_perplexity, options):
    from batchgen import LLM

    text, base = bf16_perplexity
    fp8 = LLM(str(SHIPPED), **COMMON, **options).perplexity([text], 512, 256, use_tqdm=False)[0]
    assert fp8.num_tokens == base.num_tokens > 1000
    assert fp8.perplexity != base.perplexity  # FP8 changed the numbers ...
    assert fp8.perplexity <= base.perplexity * 1.01  # ... by under 1%


@pytest.mark.slow
def test_recipe_end_to_end(tmp_path):
    record = trained_tiny.build(str(tmp_path / "m"), steps=2, log=lambda m: None)
    assert record["train_tokens"] > 100_000 and (tmp_path / "m" / "model.safetensors").exists()
    assert json.loads((tmp_path / "m" / "config.json").read_text())["vocab_size"] == 2048

"""The `trained-tiny` preset of `batchgen make-model`: a tiny Llama trained on CPU on the Python
standard library's own source, so that quantization changes a perplexity that means something.

Recipe: a byte-level BPE of 2,048 tokens (the tiny models' tokenizer recipe) trained on the
TRAIN_FILES text of batchgen.models.stdlib_text; a Llama of hidden 256, 4 layers, 4 heads of
64 (2 KV heads), MLP 512, tied embeddings (every projection dimension a multiple of 128, so
block-wise FP8 applies); TrainConfig below (seeded); weights saved in bfloat16. The directory
gets `training_manifest.json`: both splits' file lists and sha256, the Python read, the settings
and the loss log. The shipped copy (examples/trained-tiny) was built by this recipe.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from batchgen.models.make_model import write_json, write_model_dir
from batchgen.models.stdlib_text import joined_text, manifest, read_split
from batchgen.models.tiny_tokenizer import train_tokenizer
from batchgen.models.train_tiny import TrainableLlama, TrainConfig, heldout_loss, train

VOCAB_SIZE = 2048
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,  # the length it is trained at
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "vocab_size": VOCAB_SIZE,
    "torch_dtype": "bfloat16",
}
TRAIN = TrainConfig(
    steps=250, batch_size=8, seq_len=512, lr=3e-3, warmup_steps=20, weight_decay=0.1, seed=0
)
MANIFEST_FILE = "training_manifest.json"


def build(
    out_dir: str, steps: int | None = None, seed: int = 0, log: Callable[[str], None] = print
) -> dict:
    """Train the model and write it with its manifest into out_dir.

    Args:
        steps: training steps (default TRAIN.steps; fewer for a quick check of the recipe).
        seed: seeds the weights' initialisation and the batches.

    Returns:
        The manifest written.
    """
    cfg = TrainConfig(**{**TRAIN.__dict__, "steps": steps or TRAIN.steps, "seed": seed})
    torch.manual_seed(seed)
    train_files, eval_files = read_split("train"), read_split("eval")
    started = time.monotonic()
    tokenizer = train_tokenizer(VOCAB_SIZE, texts=[f.text for f in train_files])
    if tokenizer.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens > {VOCAB_SIZE}")
    # Each file a document starting with BOS (the tokenizer adds it), all in one stream.
    stream = [i for f in train_files for i in tokenizer.encode(f.text).ids]
    heldout = tokenizer.encode(joined_text(eval_files)).ids
    config = {
        **CONFIG,
        "bos_token_id": tokenizer.token_to_id("<s>"),
        "eos_token_id": tokenizer.token_to_id("</s>"),
    }
    model = TrainableLlama(config)
    model.init_weights_(seed)
    log(f"training on {len(stream)} tokens ({len(train_files)} files), {cfg.steps} steps ...")
    history = train(model, torch.tensor(stream), cfg, log)
    loss = heldout_loss(model, torch.tensor(heldout), cfg.seq_len)
    log(f"held-out loss {loss:.4f} over {len(heldout) - 1} tokens")
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    write_model_dir(out_dir, config, tensors, tokenizer)
    record = {
        "recipe": "batchgen make-model --arch llama --preset trained-tiny",
        "text": {"train": manifest(train_files), "eval": manifest(eval_files)},
        "train_tokens": len(stream),
        "eval_tokens": len(heldout),
        "train_config": cfg.__dict__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "seconds": round(time.monotonic() - started, 1),
        "loss_log": history,
        # fp32 weights, before the bf16 rounding of the saved copy.
        "heldout_loss_fp32": round(loss, 4),
    }
    write_json(os.path.join(out_dir, MANIFEST_FILE), record)
    return record

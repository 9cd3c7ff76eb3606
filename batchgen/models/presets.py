"""Architecture presets: the tiny models tests and demos build, and real shapes for benchmarks."""

from __future__ import annotations

from typing import Any

# Shared by every tiny preset; the vocabulary size is filled in from the trained tokenizer.
_TINY = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
}

TINY_PRESETS: dict[str, dict[str, Any]] = {
    "llama": {
        **_TINY,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mistral": {
        **_TINY,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "tie_word_embeddings": False,
        "sliding_window": None,
    },
    "qwen2": {
        **_TINY,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
    },
    "qwen3": {
        **_TINY,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "tie_word_embeddings": True,
        "head_dim": 32,  # explicit and != hidden / heads, as in real Qwen3 checkpoints
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    },
    # Mixtures of experts: layer 0 sparse, layer 1 dense (mlp_only_layers), as Qwen3-MoE allows.
    "qwen3_moe": {
        **_TINY,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "tie_word_embeddings": False,
        "head_dim": 32,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    },
    "mixtral": {
        **_TINY,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "tie_word_embeddings": False,
        "sliding_window": None,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
}

# Real architectures (examples/benchmarks/README.md) for random-weight benchmarks; built
# directly on the device.
# Llama 3.1's shared config (llama3 rope scaling, 128k vocabulary and context); the presets
# below differ only in size.
_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}

BENCH_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
        "eos_token_id": 151645,
    },
    "llama3.1-8b": {
        **_LLAMA31,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    # 140 GB in bf16: more than one GPU holds; run with --tensor-parallel-size (each rank builds
    # only its share).
    "llama3.1-70b": {
        **_LLAMA31,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    # 30.5B parameters (61 GB in bf16), 3.3B active: 8 of 128 experts per token.
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # 46.7B parameters (93 GB in bf16: one H200, or tensor parallel), 12.9B active: top-2 of 8.
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}

# Names `batchgen bench --model-preset` takes: the benchmark architectures, and `tiny` /
# `tiny-moe` (the tiny Llama / Qwen3-MoE shapes with a small vocabulary, for CPU smoke runs;
# built in bench/random_model.py).
PRESET_NAMES = (*BENCH_PRESETS, "tiny", "tiny-moe")

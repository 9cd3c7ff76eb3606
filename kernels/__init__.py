"""batchgen.kernels: Triton kernels with torch references; models call the ops re-exported here.

The package attributes `rms_norm` and `paged_attention` are the ops (the dispatchers in ops.py);
their kernel modules of the same names are reached with `from batchgen.kernels.rms_norm import
...`. Importing this package never requires Triton.
"""

# With the repository root on sys.path this directory is also importable as a top-level
# `kernels`, the name of Hugging Face's package, which transformers probes (and imports when it
# finds no metadata). Stay empty and inert under that name; export the ops only as
# batchgen.kernels.
if __name__ == "batchgen.kernels":
    from .ops import (
        build_cos_sin_cache,
        fused_add_rms_norm,
        paged_attention,
        paged_attention_decode,
        rms_norm,
        rope_and_store_kv,
        rotary_embedding,
        sample_gumbel,
        sample_top_k_top_p,
        silu_and_mul,
        store_kvcache,
        token_logprobs,
        use_triton,
        varlen_attention,
    )

__all__ = [
    "build_cos_sin_cache",
    "fused_add_rms_norm",
    "paged_attention",
    "paged_attention_decode",
    "rms_norm",
    "rope_and_store_kv",
    "rotary_embedding",
    "sample_gumbel",
    "sample_top_k_top_p",
    "silu_and_mul",
    "store_kvcache",
    "token_logprobs",
    "use_triton",
    "varlen_attention",
]

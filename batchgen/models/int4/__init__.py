"""4-bit weight checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized): their quantization
configs, their tensor layouts converted into batchgen's packed layout, and the load plan that
puts Int4Linear layers in the model. batchgen/models/int4/README.md describes the formats."""

"""The Hugging Face transformers continuous-batching peer, on the same weights and requests.

transformers is a bench/test-only dependency: this module is the only one that imports it, and
only when `--peer hf` is given. Random presets are rebuilt in transformers from the same
config dict and our weights copied in (qkv_proj / gate_up_proj split back into q/k/v and
gate/up), so both engines run identical weights. Requests go through
`continuous_batching_context_manager` + `add_request(max_new_tokens=...)` (per-request output
lengths); EOS is disabled (eos_token_id -1) and sampling is pure temperature (top_k/top_p off).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchgen.bench.timing import peak_memory_bytes, reset_peak_memory, synchronize
from batchgen.bench.workloads import Workload

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}


class PeerUnavailable(RuntimeError):
    """The installed transformers cannot run this peer; the message says why."""


@dataclass
class PeerResult:
    wall_s: float
    requests: int
    output_tokens: int
    errors: int
    peak_gpu_memory_bytes: int | None
    api: str  # how requests were submitted
    attn_implementation: str | None
    transformers_version: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise PeerUnavailable("--peer hf needs transformers (pip install 'batchgen[test]')") from e
    return transformers


def hf_config(raw: dict[str, Any]):
    """A transformers config object from a preset's HF-style config dict."""
    tf = _transformers()
    arch = raw["architectures"][0]
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "torch_dtype", "dtype")}
    return tf.AutoConfig.for_model(raw.get("model_type") or _MODEL_TYPES[arch], **kwargs)


@torch.no_grad()
def build_hf_model(
    raw: dict[str, Any] | None,
    state: dict[str, torch.Tensor] | None,
    model_path: str | None,
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """The transformers model: `model_path` loaded, or `raw` built with `state`, our weights
    under HF names (`batchgen.models.hf_export.to_hf_state_dict`, possibly moved to CPU so our
    own model can be freed first)."""
    tf = _transformers()
    if model_path is not None:
        model = tf.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        return model.to(device).eval()
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(hf_config(raw), dtype=dtype)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("rotary_emb.inv_freq")]
    if raw.get("tie_word_embeddings"):
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise PeerUnavailable(
            f"weight copy into transformers failed: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    if raw.get("tie_word_embeddings"):
        model.tie_weights()
    return model.eval()


def _generation_config(tf, max_new_tokens: int, temperature: float):
    return tf.GenerationConfig(
        do_sample=temperature > 0,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=-1,  # disabled: output lengths are fixed, as ignore_eos on our side
        pad_token_id=0,
    )


def _cb_config(tf, w: Workload, device: torch.device):
    """On CPU, size the cache explicitly (auto-sizing probes GPU memory and stalls ~20 s)."""
    cls = getattr(tf, "ContinuousBatchingConfig", None)
    if cls is None or device.type == "cuda":
        return None
    page = 16
    blocks = sum(-(-(len(p) + m) // page) for p, m in zip(w.prompts, w.max_tokens)) + 16
    wanted = {"page_size": page, "num_blocks": blocks, "max_batch_tokens": 512}
    known = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if not known:
        known = set(inspect.signature(cls).parameters)
    return cls(**{k: v for k, v in wanted.items() if k in known})


def _manager(model, gen_config, cb_config):
    cm = getattr(model, "continuous_batching_context_manager", None)
    if cm is None:
        raise PeerUnavailable(
            f"transformers {_transformers().__version__} has no continuous batching "
            "(continuous_batching_context_manager is missing)"
        )
    params = inspect.signature(cm).parameters
    kwargs: dict[str, Any] = {"generation_config": gen_config, "block": True}
    if "timeout" in params:
        kwargs["timeout"] = 30
    if cb_config is not None and "continuous_batching_config" in params:
        kwargs["continuous_batching_config"] = cb_config
    return cm(**kwargs)


def _submit(manager, w: Workload, prefix: str) -> str:
    params = inspect.signature(manager.add_request).parameters
    if "max_new_tokens" not in params:
        raise PeerUnavailable("ContinuousBatchingManager.add_request takes no max_new_tokens")
    for i, (prompt, m) in enumerate(zip(w.prompts, w.max_tokens)):
        manager.add_request(list(prompt), request_id=f"{prefix}{i}", max_new_tokens=m)
    return "continuous_batching_context_manager + add_request(max_new_tokens=...)"


def _collect(manager, count: int, timeout_s: float) -> tuple[int, int]:
    """Wait for `count` finished requests; returns (generated tokens, errors)."""
    done, tokens, errors = 0, 0, 0
    deadline = time.monotonic() + timeout_s
    while done < count:
        result = manager.get_result(timeout=0.5)
        if result is None:
            if not manager.is_running():
                raise PeerUnavailable(f"transformers' generation thread died after {done} results")
            if time.monotonic() > deadline:
                raise PeerUnavailable(f"transformers peer timed out after {done}/{count} results")
            continue
        if not result.is_finished():
            continue
        done += 1
        tokens += len(result.generated_tokens)
        errors += result.error is not None
    return tokens, errors


def run_peer(
    model: nn.Module,
    w: Workload,
    warmup: Workload | None,
    device: torch.device,
    timeout_s: float = 3600.0,
) -> PeerResult:
    """Warm up, then time `w` through transformers continuous batching."""
    tf = _transformers()
    if w.is_score:
        raise PeerUnavailable("transformers continuous batching has no scoring API")
    gen_config = _generation_config(tf, max(w.max_tokens), w.temperature)
    reset_peak_memory(device)
    with _manager(model, gen_config, _cb_config(tf, w, device)) as manager:
        if warmup is not None and warmup.num_requests:
            _submit(manager, warmup, "warmup-")
            _collect(manager, warmup.num_requests, timeout_s)
        synchronize(device)
        start = time.perf_counter()
        api = _submit(manager, w, "r")
        tokens, errors = _collect(manager, w.num_requests, timeout_s)
        synchronize(device)
        wall = time.perf_counter() - start
    return PeerResult(
        wall_s=wall,
        requests=w.num_requests,
        output_tokens=tokens,
        errors=errors,
        peak_gpu_memory_bytes=peak_memory_bytes(device),
        api=api,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        transformers_version=tf.__version__,
    )

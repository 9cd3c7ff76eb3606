"""LLM.perplexity equals Hugging Face's strided sliding-window recipe run on transformers."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen import LLM
from batchgen.plan.perplexity import PerplexityOutput

transformers = pytest.importorskip("transformers")

TEXT = (
    "The committee measured the annual budget after a long debate. Our team reviewed the "
    "survey results before the deadline. The river delayed the harbor project on Monday. "
    "A small town approved three new bridges by a wide margin, and the weather station "
    "explained a rainfall record in great detail. Every student questioned the price of bread."
)


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    path = tiny_model_dir("llama")
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_model_len=64, num_kv_blocks=128, block_size=8)
    return llm, hf


def hf_strided_nll(hf, ids: list[int], max_length: int, stride: int) -> tuple[float, int]:
    """The loop of Hugging Face's "perplexity of fixed-length models" guide: labels -100
    outside each window's new tokens, the model's own shifted mean loss. The guide weights each
    window's mean by (labels != -100) - 1, which is the count only for the first window (later
    windows' labels all survive the shift); here the mean is weighted by the labels it was
    taken over."""
    encodings = torch.tensor([ids])
    seq_len = encodings.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = encodings[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf(input_ids, labels=target_ids).loss
        num_loss_tokens = (target_ids[:, 1:] != -100).sum().item()
        nll_sum += loss.item() * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return nll_sum, n_tokens


@pytest.mark.parametrize(("context", "stride"), [(32, 8), (24, 24), (40, 17)])
def test_perplexity_equals_transformers(setup, context, stride):
    llm, hf = setup
    ids = llm.tokenizer.encode(TEXT)
    assert len(ids) > 2 * context  # several windows
    ref_nll, ref_tokens = hf_strided_nll(hf, ids, context, stride)
    (out,) = llm.perplexity([TEXT], context=context, stride=stride, use_tqdm=False)
    assert out.error is None
    assert out.num_tokens == ref_tokens
    assert abs(out.nll - ref_nll) <= 1e-4 * ref_tokens
    assert abs(math.log(out.perplexity) - ref_nll / ref_tokens) <= 1e-5


def test_texts_in_order_pooled_and_errors(setup):
    llm, hf = setup
    texts = [TEXT, "Hi", TEXT[:120], [llm.tokenizer.bos_token_id]]
    outs = llm.perplexity(texts, context=32, stride=16, use_tqdm=False)
    for i in (0, 2):
        ids = llm.tokenizer.encode(texts[i])
        nll, n = hf_strided_nll(hf, ids, 32, 16)
        assert outs[i].num_tokens == n and abs(outs[i].nll - nll) <= 1e-4 * n
    assert outs[1].error is None and outs[1].num_tokens == len(llm.tokenizer.encode("Hi")) - 1
    assert outs[3].error_code == "too_short" and math.isnan(outs[3].perplexity)
    pooled = PerplexityOutput.pool(outs)
    assert pooled.num_tokens == sum(o.num_tokens for o in outs[:3])
    assert pooled.perplexity == pytest.approx(
        math.exp(sum(o.nll for o in outs[:3]) / pooled.num_tokens)
    )


def test_bad_arguments(setup):
    llm, _ = setup
    with pytest.raises(ValueError, match="stride=40"):
        llm.perplexity([TEXT], context=32, stride=40)
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.perplexity([TEXT], context=128, stride=16)
    (out,) = llm.perplexity([[5, 6, 10**6]], context=32, stride=16, use_tqdm=False)
    assert out.error_code == "invalid_token_id" and out.num_tokens == 0

"""penalise_logits: the Triton kernel against its torch reference (exact under the interpreter),
the reference against the engine's per-row host reference, scratch kept zero, bad ids and
arguments."""

from __future__ import annotations

import random

import pytest
import torch
from batchgen.kernels.penalties import penalise_logits, penalise_logits_ref, scratch_rows

from batchgen.engine.penalties import History, apply_penalties_ref
from batchgen.sampling_params import SamplingParams


def _case(rows: int, vocab: int, seed: int, max_len: int = 40, n_logits: int | None = None):
    """Random penalised rows over a shared id buffer: (logits [N, V], ids [R, W] int32,
    ints [4, P], floats [3, P], histories as (prompt, outputs) lists). Ids repeat within and
    across prompt and outputs; some rows have neutral penalties, some logits rows none."""
    rng = random.Random(seed)
    n_logits = n_logits or rows + 3
    logit_rows = rng.sample(range(n_logits), rows)
    width = max_len + 5
    ids = torch.zeros(rows + 2, width, dtype=torch.int32)
    buf_rows = rng.sample(range(rows + 2), rows)
    hist, lengths, prompts, pens = [], [], [], []
    small = max(3, vocab // 8)  # a narrow id range so ids repeat
    for p in range(rows):
        n = rng.randrange(1, max_len + 1)
        k = rng.randrange(1, n + 1)  # prompt length (prompts are never empty)
        seq = [rng.randrange(small if rng.random() < 0.7 else vocab) for _ in range(n)]
        ids[buf_rows[p], :n] = torch.tensor(seq, dtype=torch.int32)
        hist.append((seq[:k], seq[k:]))
        lengths.append(n)
        prompts.append(k)
        pens.append(
            rng.choice(
                [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.25, 0.0), (1.0, 0.0, -0.5),
                 (1.1, 0.1, 0.2), (1.0, 0.0, 0.0)]
            )
        )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n_logits, vocab, generator=gen)
    ints = torch.tensor([logit_rows, buf_rows, lengths, prompts], dtype=torch.int64)
    floats = torch.tensor(list(zip(*pens)), dtype=torch.float32)
    return logits, ids, ints, floats, hist


@pytest.mark.parametrize(
    "rows, vocab, scratch", [(1, 16, 1), (7, 50, 2), (12, 300, 5), (5, 3000, 8)]
)
def test_kernel_equals_reference(device, rows, vocab, scratch):
    # scratch < rows: several launches, each reusing the counters the last one left zero.
    logits, ids, ints, floats, _ = _case(rows, vocab, seed=rows + vocab)
    want = penalise_logits_ref(logits.clone(), ids, ints, floats)
    counts = torch.zeros(scratch, vocab + 3, dtype=torch.int32, device=device)
    got = penalise_logits(
        logits.clone().to(device), ids.to(device), ints.to(device), floats.to(device), counts
    )
    if device == "cpu":
        assert torch.equal(got, want)
    else:  # CUDA may round x / r differently
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(want, logits)  # the case penalises something
    assert int(counts.abs().sum()) == 0  # left zero for the next launch


def test_long_histories_span_several_blocks(device):
    logits, ids, ints, floats, _ = _case(3, 200, seed=3, max_len=2500)
    want = penalise_logits_ref(logits.clone(), ids, ints, floats)
    counts = torch.zeros(scratch_rows(200), 200, dtype=torch.int32, device=device)
    got = penalise_logits(
        logits.clone().to(device), ids.to(device), ints.to(device), floats.to(device), counts
    )
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    assert int(ints[2].max()) > 1024


def test_reference_equals_the_engines_per_row_reference():
    logits, ids, ints, floats, hist = _case(9, 60, seed=11)
    got = penalise_logits_ref(logits.clone(), ids, ints, floats)
    # The engine's per-row reference over host-side histories, one History per logits row.
    histories: list = [None] * logits.shape[0]
    params = [SamplingParams()] * logits.shape[0]
    for p, (prompt, outputs) in enumerate(hist):
        row = int(ints[0, p])
        histories[row] = History(p, prompt + outputs, len(prompt))
        rep, freq, pres = (float(x) for x in floats[:, p])
        params[row] = SamplingParams(
            repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres
        )
    want = apply_penalties_ref(logits.clone(), histories, params)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_ids_past_the_vocabulary_are_never_written(device):
    # The engine refuses such ids; the kernel still must not write past a row.
    vocab = 20
    wide = torch.zeros(2, vocab + 8)
    logits = wide[:, :vocab]  # rows strided, guard columns after each
    logits.copy_(torch.arange(1.0, 2 * vocab + 1).view(2, vocab))
    ids = torch.tensor([[3, vocab + 2, 3, -1, 5]], dtype=torch.int32)
    ints = torch.tensor([[0], [0], [5], [1]])
    floats = torch.tensor([[2.0], [0.5], [0.0]])
    counts = torch.zeros(1, vocab, dtype=torch.int32, device=device)
    wide_d = wide.to(device)
    penalise_logits(wide_d[:, :vocab], ids.to(device), ints.to(device), floats.to(device), counts)
    got = wide_d.cpu()
    assert torch.equal(got[:, vocab:], torch.zeros(2, 8))
    expected = logits.clone()
    expected[0, 3] = 4.0 / 2 - 0.5  # in the prompt, and once among the outputs
    expected[0, 5] = 6.0 / 2 - 0.5
    assert torch.equal(got[:, :vocab], expected)
    assert int(counts.abs().sum()) == 0


def test_bad_arguments_are_refused(device):
    logits = torch.zeros(2, 10, device=device)
    ids = torch.zeros(1, 4, dtype=torch.int32, device=device)
    ints = torch.zeros(4, 1, dtype=torch.int64, device=device)
    floats = torch.ones(3, 1, device=device)
    counts = torch.zeros(1, 10, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="penalise_logits: logits must be"):
        penalise_logits(logits.half(), ids, ints, floats, counts)
    with pytest.raises(ValueError, match="ids must be"):
        penalise_logits(logits, ids.long(), ints, floats, counts)
    with pytest.raises(ValueError, match=r"ints must be \[4, P\]"):
        penalise_logits(logits, ids, ints[:3], floats, counts)
    with pytest.raises(ValueError, match=r"floats must be \[3, P\]"):
        penalise_logits(logits, ids, ints, floats.double(), counts)
    with pytest.raises(ValueError, match=r"counts must be \[C, >= 10\]"):
        penalise_logits(logits, ids, ints, floats, counts[:, :5])


@pytest.mark.gpu
def test_kernel_equals_reference_at_nano_scale():
    # 256 rows of a 151,936-id vocabulary, histories up to 2,048 ids: several launches.
    rows, vocab = 256, 151_936
    logits, ids, ints, floats, _ = _case(rows, vocab, seed=7, max_len=2048)
    logits, ids, ints, floats = (t.cuda() for t in (logits, ids, ints, floats))
    want = penalise_logits_ref(logits.clone(), ids, ints, floats)
    counts = torch.zeros(scratch_rows(vocab), vocab, dtype=torch.int32, device="cuda")
    assert counts.shape[0] < rows
    got = penalise_logits(logits, ids, ints, floats, counts)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert int(counts.abs().sum()) == 0

"""Penalties from device-resident histories: PenaltyHistory against the host-side reference
over growing, in-flight and reused histories; the engine's penalised runs against transformers
and a reference decode loop, with async scheduling kept."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine import penalties as penalties_mod
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.penalties import History, PenaltyHistory, apply_penalties_ref
from batchgen.engine.sampler import Sampler, SamplingBatch
from batchgen.engine.sequence import PENDING_TOKEN

transformers = pytest.importorskip("transformers")

VOCAB = 50
PARAMS = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8),
    SamplingParams(frequency_penalty=0.25),
    SamplingParams(presence_penalty=-0.5),
    SamplingParams(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.2),
]


def _check_steps(device: str, steps: int = 6, exact: bool = True) -> PenaltyHistory:
    """Sequences join, draw, go in flight and leave over several steps; each step's penalised
    logits equal the reference's over the host-side history with every drawn id filled in."""
    rng = random.Random(5)
    state = PenaltyHistory()
    known: dict[int, list[int]] = {}  # key -> full history (the reference's view)
    live: dict[int, History] = {}  # key -> the engine's view: drawn ids still in flight unknown
    next_key = 0
    for _ in range(steps):
        for _ in range(rng.randrange(3, 9)):  # sequences joining
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
            known[next_key] = list(prompt)
            live[next_key] = History(next_key, list(prompt), len(prompt))
            next_key += 1
        keys = rng.sample(sorted(live), k=max(1, len(live) - 2))  # some sit this step out
        params = [PARAMS[k % len(PARAMS)] for k in keys]
        gen = torch.Generator().manual_seed(rng.randrange(1000))
        logits = 3 * torch.randn(len(keys) + 2, VOCAB, generator=gen)
        rows = list(range(1, len(keys) + 1))  # row 0 and the last one take no penalty
        want, got = logits.clone(), logits.clone().to(device)
        # A step's views, as the engine builds them each step (length fixed at scheduling).
        views = [History(k, live[k].token_ids, live[k].num_prompt) for k in keys]
        buf_rows = state.apply(got, rows, views, params)
        apply_penalties_ref(
            want, [None] + [History(k, known[k], live[k].num_prompt) for k in keys] + [None],
            [SamplingParams()] + params + [SamplingParams()],
        )  # fmt: skip
        if exact:
            assert torch.equal(got.cpu(), want)
        else:
            torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
        # Draw, record on the device; the host learns the ids one step later, as async does.
        tokens = torch.tensor([rng.randrange(VOCAB) for _ in range(len(keys) + 2)])
        state.record(tokens.to(device), rows, buf_rows, views)
        for row, k in zip(rows, keys):
            known[k].append(int(tokens[row]))
            ids = live[k].token_ids
            ids[:] = [t if t != PENDING_TOKEN else known[k][i] for i, t in enumerate(ids)]
            ids.append(PENDING_TOKEN)
        for k in rng.sample(sorted(live), k=2):  # two finish
            state.release([k])
            del live[k], known[k]
    # Rows held: exactly the live sequences that have drawn (the others never sampled).
    assert set(state.row_of) == {k for k, h in live.items() if len(h.token_ids) > h.num_prompt}
    return state


def test_device_histories_equal_the_host_reference(monkeypatch):
    monkeypatch.setattr(penalties_mod, "CHUNK_POSITIONS", 200)  # several passes a step
    monkeypatch.setattr(penalties_mod, "_MIN_ROWS", 2)  # the buffer grows and rows are reused
    monkeypatch.setattr(penalties_mod, "_MIN_WIDTH", 8)
    state = _check_steps("cpu")
    assert state.ids.shape[0] > 2 and state.ids.shape[1] > 8  # grew on the way


@pytest.mark.gpu
def test_device_histories_equal_the_host_reference_on_cuda(monkeypatch):
    monkeypatch.setattr(penalties_mod, "CHUNK_POSITIONS", 200)
    _check_steps("cuda", exact=False)  # CUDA divides by a scalar as a reciprocal multiply


def test_an_id_not_drawn_yet_is_refused_with_the_sequence_named():
    state = PenaltyHistory()
    logits = torch.zeros(1, VOCAB)
    with pytest.raises(RuntimeError, match=r"sequence 7: .* index 3"):
        state.apply(logits, [0], [History(7, [1, 2, 3, PENDING_TOKEN], 2)], [PARAMS[0]])


def test_a_penalised_row_without_a_history_is_refused():
    params = [SamplingParams(temperature=0.0), SamplingParams(frequency_penalty=0.2)]
    batch = SamplingBatch(params, [0, 0], [0, 0], [None, None], [[], []])
    with pytest.raises(ValueError, match="sampling row 1 has a penalty but no token history"):
        Sampler().sample(torch.zeros(2, VOCAB), batch)


def test_reset_forgets_an_earlier_engines_sequences():
    state = PenaltyHistory()
    logits = torch.zeros(1, VOCAB)
    state.apply(logits, [0], [History(0, [4, 4, 4], 1)], [PARAMS[2]])
    state.reset()
    fresh = torch.zeros(1, VOCAB)
    state.apply(fresh, [0], [History(0, [9, 9], 1)], [PARAMS[2]])  # same key, other history
    assert fresh[0, 9] == -0.25 and fresh[0, 4] == 0


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(9)
    return [[0] + [rng.randrange(5, 60) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


def test_greedy_repetition_penalty_equals_transformers(model_path):
    prompts = _prompts(12)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        want = [
            hf.generate(
                torch.tensor([p]), max_new_tokens=20, do_sample=False, repetition_penalty=1.5
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    params = SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.5)
    llm = LLM(model_path, dtype="float32", max_model_len=128, num_kv_blocks=256)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    plain = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in plain] != got  # the penalty changed something


def _reference_decode(hf, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding with the reference penalties, one token at a time."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = hf(torch.tensor([ids])).logits[:, -1].float()
            apply_penalties_ref(logits, [History(0, ids, len(prompt))], [params])
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    "options",
    [{"num_kv_blocks": 256}, {"num_kv_blocks": 24, "block_size": 8}],
    ids=["plain", "preemption"],
)
def test_frequency_and_presence_equal_a_reference_loop_and_stay_async(
    model_path, options, monkeypatch
):
    prompts = _prompts(10)
    params = [
        SamplingParams(
            max_tokens=16,
            temperature=0.0,
            frequency_penalty=0.4 + 0.1 * (i % 3),
            presence_penalty=0.3 * (i % 2),
            repetition_penalty=1.0 + 0.2 * (i % 4 == 3),
        )  # fmt: skip
        for i in range(len(prompts))
    ]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    want = [_reference_decode(hf, p, sp) for p, sp in zip(prompts, params)]
    patches = []
    pending_patch = ModelRunner._pending_patch

    def spy(self, rows, sources, tokens):
        patches.append(len(rows))
        return pending_patch(self, rows, sources, tokens)

    monkeypatch.setattr(ModelRunner, "_pending_patch", spy)
    llm = LLM(model_path, dtype="float32", max_model_len=128, **options)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    # Penalised steps took the step in flight's tokens on the device (no settling first), and
    # every finished sequence gave its history row back.
    assert sum(patches) > 0
    assert llm.engine.runner.sampler.penalties.row_of == {}
    if options["num_kv_blocks"] == 24:
        assert llm.stats.num_preemptions > 0

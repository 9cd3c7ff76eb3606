"""Scheduler: driven by a fake model that checks every KV slot it reads was written right."""

import random

import pytest

from batchgen.engine import prompt_allowance
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from batchgen.sampling_params import SamplingParams

VOCAB = 100
EOS = 99


def next_token(tokens):
    """The fake model: a deterministic function of the context."""
    return (tokens[-1] + 1) % VOCAB


class FakeRunner:
    """Plays the model runner: writes each computed token into its KV slot, and before that
    checks that every earlier position of the sequence reads back its own token, so a wrong
    prefix hit, a bad fork or a lost block shows up as a mismatch."""

    def __init__(self, sched):
        self.sched = sched
        self.bm = sched.block_manager
        self.kv = {}  # (block_id, offset) -> token id
        self.steps = []  # per step: [(seq_id, start, num_new, samples)]

    def slot(self, seq, pos):
        bs = self.bm.block_size
        return seq.block_table[pos // bs], pos % bs

    def step(self, out, device=None):
        """device: the step in flight's sampled tokens (seq_id -> token), which stand in for
        PENDING_TOKEN inputs as they would on a GPU under async scheduling."""
        sampled = {}
        for s in out.scheduled:
            seq = s.seq
            tokens = seq.token_ids
            if tokens[s.start] == PENDING_TOKEN:
                assert s.num_new_tokens == 1 and s.start == seq.num_tokens - 1
                tokens = tokens[:-1] + [device[seq.seq_id]]
            assert s.start == seq.num_computed_tokens and s.num_new_tokens >= 1
            assert s.start + s.num_new_tokens <= seq.num_tokens
            assert len(seq.block_table) * self.bm.block_size >= s.start + s.num_new_tokens
            for pos in range(s.start):
                assert self.kv.get(self.slot(seq, pos)) == tokens[pos], (seq, pos)
            for pos in range(s.start, s.start + s.num_new_tokens):
                block = self.bm.blocks[self.slot(seq, pos)[0]]
                # Never write into a shared or prefix-cached block.
                assert block.ref_count == 1 and block.block_hash is None, (seq, pos, block)
                self.kv[self.slot(seq, pos)] = tokens[pos]
            assert s.samples == (not seq.is_score and s.start + s.num_new_tokens == seq.num_tokens)
            if s.samples:
                sampled[seq.seq_id] = next_token(tokens)
        self.steps.append(
            [(s.seq.seq_id, s.start, s.num_new_tokens, s.samples) for s in out.scheduled]
        )
        return sampled


def check_invariants(sched, seqs):
    bm = sched.block_manager
    holders = {}
    for seq in seqs:
        assert seq.num_computed_tokens <= seq.num_tokens
        if seq.status is not SequenceStatus.RUNNING:
            assert seq.block_table == [] and seq.num_computed_tokens == 0 or seq.is_finished
        assert len(seq.block_table) == len(set(seq.block_table))
        for b in seq.block_table:
            holders[b] = holders.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), block
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue), block
    assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
    assert sched.num_running <= sched.max_num_seqs
    assert set(map(id, sched.running)).isdisjoint(map(id, sched.waiting))


def run_to_completion(sched, seqs, runner=None, max_steps=10_000):
    """Add seqs, step until done; return the runner (pass it on to keep its KV). Fails on a hang."""
    for seq in seqs:
        assert sched.add(seq) is None
    runner = runner or FakeRunner(sched)
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
        finished += sched.postprocess(out, runner.step(out))
        check_invariants(sched, seqs)
    else:
        pytest.fail("sequences did not finish")
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
    assert all(s.is_finished for s in seqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return runner


def expected_output(prompt, params, max_model_len=10_000):
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
        if len(out) >= params.min_tokens and t in stops:
            return out, "stop"
        if len(out) == params.max_tokens or len(tokens) == max_model_len:
            return out, "length"


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=512, **kw):
    bm = BlockManager(num_blocks, block_size, kw.pop("enable_prefix_caching", True))
    return Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        eos_token_ids=frozenset({EOS}),
        admission_interval=kw.pop("admission_interval", 1),
        admission_batch=kw.pop("admission_batch", None),
        mixed_chunk_tokens=kw.pop("mixed_chunk_tokens", 0),
        mixed_chunk_room=kw.pop("mixed_chunk_room", None),
    )


def gen(seq_id, prompt, **params):
    return Sequence(seq_id, f"r{seq_id}", list(prompt), SamplingParams(**params))


def assert_expected(seqs, max_model_len=10_000):
    for seq in seqs:
        out, reason = expected_output(seq.prompt_token_ids, seq.params, max_model_len)
        assert (seq.output_token_ids, seq.finish_reason) == (out, reason), seq


def test_all_sequences_finish_with_expected_tokens():
    sched = make_sched()
    seqs = [
        gen(i, [(7 * i + j) % 90 for j in range(3 + 5 * i)], max_tokens=4 + 3 * i) for i in range(8)
    ]
    run_to_completion(sched, seqs)
    assert_expected(seqs)
    assert any(s.finish_reason == "stop" for s in seqs)  # some reach EOS (99) on the way
    assert any(s.finish_reason == "length" for s in seqs)


def test_chunked_prefill_alongside_decodes():
    sched = make_sched(budget=8)
    short = [gen(i, [i], max_tokens=20) for i in range(3)]
    long = gen(9, [j % 50 for j in range(40)], max_tokens=3)
    for seq in short:
        sched.add(seq)
    runner = FakeRunner(sched)
    sched.postprocess(out := sched.schedule(), runner.step(out))  # 3 short prompts prefilled
    sched.add(long)
    mixed_steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_batched_tokens <= 8
        entries = {s.seq.seq_id: s for s in out.scheduled}
        if 9 in entries and not entries[9].samples and len(entries) > 1:
            mixed_steps += 1
            assert entries[9].num_new_tokens == 8 - (len(entries) - 1)
            assert all(entries[i].num_new_tokens == 1 for i in entries if i != 9)
        sched.postprocess(out, runner.step(out))
    assert mixed_steps >= 4  # 40-token prompt over >= 5 chunks, decodes running beside it
    assert_expected(short + [long])


def test_budget_exhausted_by_running_blocks_admission():
    sched = make_sched(budget=4)
    a = gen(0, range(10), max_tokens=2)
    b = gen(1, range(3), max_tokens=2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.start, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        (0, 0, 4, False)
    ]
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_gives_same_outputs(caching):
    def workload():
        rng = random.Random(3)
        return [
            gen(
                i,
                [rng.randrange(90) for _ in range(rng.randint(1, 20))],
                max_tokens=rng.randint(1, 30),
            )
            for i in range(12)
        ]

    roomy = workload()
    run_to_completion(make_sched(num_blocks=256, enable_prefix_caching=caching), roomy)
    tight = workload()
    sched = make_sched(num_blocks=14, enable_prefix_caching=caching)
    run_to_completion(sched, tight)
    assert sched.num_preemptions > 0
    assert any(s.num_preemptions > 0 for s in tight)
    for a, b in zip(roomy, tight):
        assert (a.output_token_ids, a.finish_reason) == (b.output_token_ids, b.finish_reason)
    assert_expected(tight)


def test_sequence_that_must_preempt_itself():
    # Two sequences each needing all blocks at the end: the newer one is preempted, then the
    # older one outgrows the rest and runs alone; both finish.
    sched = make_sched(num_blocks=4, block_size=4, budget=64)
    seqs = [
        gen(0, [1] * 6, max_tokens=10, ignore_eos=True),
        gen(1, [2] * 6, max_tokens=10, ignore_eos=True),
    ]
    run_to_completion(sched, seqs)
    assert sched.num_preemptions >= 1
    assert_expected(seqs)


def test_add_rejects_prompt_too_long_and_cannot_fit():
    sched = make_sched(num_blocks=4, block_size=4, max_model_len=20)
    err = sched.add(gen(0, range(15), max_tokens=6))
    assert err.code == "prompt_too_long"
    assert "15" in err.message and "max_model_len=20" in err.message and "max_tokens" in err.message
    err = sched.add(gen(1, range(10), max_tokens=8))  # 17 KV tokens > 4 blocks x 4
    assert err.code == "cannot_fit" and "num_kv_blocks" in err.message and "4" in err.message
    assert sched.add(gen(2, range(10), max_tokens=7)) is None  # 16 KV tokens: exactly fits
    score = Sequence(3, "s", list(range(21)), SamplingParams(), score_from=10)
    assert sched.add(score) == (
        "prompt_too_long",
        "prompt + candidate has 21 tokens, more than max_model_len=20; shorten the input, or "
        "raise max_model_len if the model supports it",
    )
    assert sched.num_waiting == 1
    assert sched.add(gen(4, range(15), max_tokens=6)).message == (
        "prompt has 15 tokens + max_tokens 6 = 21, more than max_model_len=20; shorten the "
        "prompt or lower max_tokens, or raise max_model_len if the model supports it"
    )


@pytest.mark.parametrize("caching", [True, False])
def test_n4_siblings_fork_parent_prompt_blocks(caching):
    sched = make_sched(block_size=4, enable_prefix_caching=caching)
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks + 2 tokens
    parent = gen(0, prompt, max_tokens=5, ignore_eos=True)
    siblings = [
        Sequence(i, "r0", prompt, parent.params, sample_index=i, parent=parent) for i in range(1, 4)
    ]
    for seq in [parent, *siblings]:
        assert sched.add(seq) is None
    runner = FakeRunner(sched)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [parent]  # siblings wait for the parent's prompt
    sched.postprocess(out, runner.step(out))
    out = sched.schedule()
    bm = sched.block_manager
    assert bm.num_used_blocks == 3 + 3  # parent's 3 blocks + one own block per sibling
    for sib in siblings:
        assert sib.block_table[:2] == parent.block_table[:2]
        assert sib.num_cached_tokens == 8 and sib.parent is None
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [4, 4, 1]
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(10, 1)] + [(8, 2)] * 3
    sched.postprocess(out, runner.step(out))
    while sched.has_unfinished():
        out = sched.schedule()
        sched.postprocess(out, runner.step(out))
        check_invariants(sched, [parent, *siblings])
    assert_expected([parent, *siblings])
    assert bm.num_cache_hit_tokens == 3 * 8 and bm.num_cache_queries_tokens == 4 * 10


def test_siblings_served_when_parent_aborted_or_preempted():
    sched = make_sched(num_blocks=6, block_size=4, budget=4)
    prompt = list(range(20, 30))
    parent = gen(0, prompt, max_tokens=4)
    sibs = [Sequence(i, "r0", prompt, parent.params, sample_index=i, parent=parent) for i in (1, 2)]
    for seq in [parent, *sibs]:
        sched.add(seq)
    runner = FakeRunner(sched)
    out = sched.schedule()  # first chunk of the parent's prompt
    sched.postprocess(out, runner.step(out))
    sched.finish(parent, "abort")
    assert parent.finish_reason == "abort" and sched.block_manager.num_free_blocks == 6
    while sched.has_unfinished():
        out = sched.schedule()
        sched.postprocess(out, runner.step(out))
        check_invariants(sched, [parent, *sibs])
    assert_expected(sibs)


def test_min_tokens_suppresses_stop():
    prompt = [96]  # next tokens: 97, 98, 99 (EOS), 0, 1, ...
    plain, held = gen(0, prompt, max_tokens=10), gen(1, prompt, max_tokens=10, min_tokens=5)
    run_to_completion(make_sched(), [plain, held])
    assert plain.output_token_ids == [97, 98, 99] and plain.finish_reason == "stop"
    assert held.output_token_ids == [97, 98, 99, 0, 1, 2, 3, 4, 5, 6]
    assert held.finish_reason == "length"


def test_ignore_eos_and_stop_token_ids():
    a = gen(0, [96], max_tokens=6, ignore_eos=True)
    b = gen(1, [96], max_tokens=6, ignore_eos=True, stop_token_ids=[1])
    c = gen(2, [10], max_tokens=6, stop_token_ids=[12], min_tokens=2)
    run_to_completion(make_sched(), [a, b, c])
    assert a.output_token_ids == [97, 98, 99, 0, 1, 2] and a.finish_reason == "length"
    assert b.output_token_ids == [97, 98, 99, 0, 1] and b.finish_reason == "stop"
    assert c.output_token_ids == [11, 12] and c.finish_reason == "stop"


def test_max_model_len_stop():
    sched = make_sched(max_model_len=12)
    seq = gen(0, range(4), max_tokens=8, ignore_eos=True)
    run_to_completion(sched, [seq])
    assert seq.num_tokens == 12 and seq.finish_reason == "length"


def test_score_sequences_finish_without_sampling():
    sched = make_sched(block_size=4, budget=6)
    prompt = list(range(30, 43))  # 13 tokens
    scores = [
        Sequence(i, "s", prompt + [50 + i] * (i + 2), SamplingParams(), score_from=len(prompt))
        for i in range(3)
    ]
    runner = run_to_completion(sched, scores[:1])
    run_to_completion(sched, scores[1:], runner)
    for step in runner.steps:
        assert not any(samples for *_, samples in step)
    for seq in scores:
        assert seq.finish_reason == "score" and seq.num_output_tokens == 0
    # Later candidates reuse the prompt's blocks, but at most score_from - 1 = 12 tokens:
    # the logits at position 12 (predicting the first candidate token) must be recomputed.
    assert [s.num_cached_tokens for s in scores] == [0, 12, 12]
    starts = {}
    for step in runner.steps:
        for seq_id, start, _, _ in step:
            starts.setdefault(seq_id, start)
    assert starts == {0: 0, 1: 12, 2: 12}


def test_max_num_seqs():
    sched = make_sched(max_num_seqs=2, budget=64)
    seqs = [gen(i, [i], max_tokens=3, ignore_eos=True) for i in range(5)]
    runner = run_to_completion(sched, seqs)
    assert max(len(step) for step in runner.steps) == 2
    assert_expected(seqs)


def _admission_steps(runner):
    """Indices of the steps that admitted a sequence (a row starting at position 0)."""
    return [i for i, step in enumerate(runner.steps) if any(start == 0 for _, start, _, _ in step)]


def test_admission_interval_admits_freed_room_together():
    # Four slots, twelve requests of different lengths: with interval 1 a prompt is admitted
    # whenever a sequence finishes; with interval 6 (and no early end: a batch of 4) the
    # prompts that room freed up for wait and go in together, at most every 6 steps.
    def run(interval):
        sched = make_sched(max_num_seqs=4, budget=64, admission_interval=interval,
                           admission_batch=4)  # fmt: skip
        seqs = [gen(i, [i, i + 1], max_tokens=3 + (5 * i) % 11, ignore_eos=True) for i in range(12)]
        runner = run_to_completion(sched, seqs)
        assert_expected(seqs)
        return _admission_steps(runner)

    eager, batched = run(1), run(6)
    assert len(batched) < len(eager)
    # After the first admission fills the batch, admissions are >= 6 steps apart.
    assert all(b - a >= 6 for a, b in zip(batched, batched[1:]))


def test_a_burst_of_finished_sequences_ends_the_wait():
    # Eight slots: two long requests keep running while short ones of one length finish in
    # bursts of 6. With a batch of 4 the freed slots are refilled in the step after each
    # burst, not 50 steps later.
    sched = make_sched(max_num_seqs=8, budget=64, admission_interval=50, admission_batch=4)
    seqs = [gen(i, [i], max_tokens=60 if i < 2 else 5, ignore_eos=True) for i in range(24)]
    runner = run_to_completion(sched, seqs)
    assert_expected(seqs)
    # Step 0 admits 2 long + 6 short; the short ones take steps 0-4; the next 6 come in at 5.
    assert _admission_steps(runner) == [0, 5, 10, 15]


def test_admission_interval_does_not_hold_back_room_that_is_free():
    # The batch never fills (max_num_seqs 8, three requests arriving one by one): every
    # prompt is admitted in the step after it arrives, whatever the interval.
    sched = make_sched(max_num_seqs=8, budget=64, admission_interval=50)
    runner = FakeRunner(sched)
    seqs = []
    for i in range(3):
        seq = gen(i, [i], max_tokens=20, ignore_eos=True)
        assert sched.add(seq) is None
        seqs.append(seq)
        out = sched.schedule()
        assert any(s.seq is seq and s.start == 0 for s in out.scheduled)
        sched.postprocess(out, runner.step(out))
    while sched.has_unfinished():
        out = sched.schedule()
        sched.postprocess(out, runner.step(out))
    assert_expected(seqs)


def test_prefix_cache_hits_across_requests():
    sched = make_sched(block_size=4, budget=64)
    system = list(range(40, 56))  # 16 tokens: 4 full blocks
    first = gen(0, system + [1, 2], max_tokens=2)
    runner = run_to_completion(sched, [first])
    later = [gen(i, system + [i, 3], max_tokens=2) for i in range(1, 4)]
    run_to_completion(sched, later, runner)
    assert [s.num_cached_tokens for s in later] == [16, 16, 16]
    assert_expected([first, *later])


def resolve(sched, out, placeholders, sampled):
    """What the engine does once a launched step's tokens are read (async scheduling)."""
    for _, seq, index in placeholders:
        sched.resolve_token(seq, index, sampled[seq.seq_id])
    for item in out.scheduled:
        item.seq.num_inflight -= 1


@pytest.mark.parametrize("async_steps", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(50))
def test_randomized_invariants(seed, async_steps):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_model_len = rng.randint(16, 80)
    num_blocks = rng.randint(-(-max_model_len // block_size), 3 * max_model_len // block_size + 2)
    sched = make_sched(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(1, 8),
        budget=rng.randint(1, 40),
        max_model_len=max_model_len,
        enable_prefix_caching=rng.random() < 0.7,
        admission_interval=rng.choice([1, 1, 2, 5]),
        mixed_chunk_tokens=rng.choice([0, 0, 1, 3, 8]),
        mixed_chunk_room=rng.choice([None, lambda d: -d % 4]),
    )
    shared = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))]  # common prefixes
    seqs, seq_id = [], 0
    for _ in range(rng.randint(1, 14)):
        plen = rng.randint(1, max_model_len - 1)
        prompt = (
            shared[: rng.randint(0, len(shared))] + [rng.randrange(VOCAB) for _ in range(plen)]
        )[:plen]
        if rng.random() < 0.2 and plen >= 2:
            seqs.append(
                Sequence(seq_id, "s", prompt, SamplingParams(), score_from=rng.randint(1, plen - 1))
            )
            seq_id += 1
            continue
        params = SamplingParams(
            max_tokens=rng.randint(1, max(1, max_model_len - plen)), ignore_eos=rng.random() < 0.5
        )
        first = Sequence(seq_id, f"r{seq_id}", prompt, params)
        seqs.append(first)
        seq_id += 1
        for k in range(1, rng.choice([1, 1, 2, 4])):
            seqs.append(
                Sequence(seq_id, first.request_id, prompt, params, sample_index=k, parent=first)
            )
            seq_id += 1
    accepted = [s for s in seqs if sched.add(s) is None]
    assert accepted
    runner = FakeRunner(sched)
    inflight = None  # async: (schedule, placeholders, sampled) of the unresolved step
    for _ in range(20_000):
        if not sched.has_unfinished() and inflight is None:
            break
        if rng.random() < 0.01 and sched.has_unfinished():  # occasional abort
            victim = rng.choice(list(sched.running) + list(sched.waiting))
            sched.finish(victim, "abort")
        if not sched.has_unfinished():
            if inflight is not None:
                resolve(sched, *inflight)
                inflight = None
            continue
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        if not async_steps:
            sched.postprocess(out, runner.step(out))
        else:
            sampled = runner.step(out, inflight[2] if inflight else None)
            launched = (out, sched.advance(out), sampled)
            if inflight is not None:
                resolve(sched, *inflight)
            inflight = launched
        check_invariants(sched, accepted)
    else:
        pytest.fail("hang")
    assert all(s.is_finished for s in accepted)
    for seq in accepted:
        if seq.finish_reason in ("stop", "length"):
            out, reason = expected_output(seq.prompt_token_ids, seq.params, max_model_len)
            assert (seq.output_token_ids, seq.finish_reason) == (out, reason)
        elif seq.finish_reason == "score":
            assert seq.num_output_tokens == 0
    assert sched.block_manager.num_free_blocks == num_blocks


def test_same_step_admissions_sharing_a_prefix_wait_one_step_and_hit_the_cache():
    bs = 4
    sched = make_sched(num_blocks=64, block_size=bs, budget=64, max_model_len=64)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    shared = list(range(1, 13))  # three full blocks
    a = Sequence(0, "a", shared + [20, 21], params)
    b = Sequence(1, "b", shared + [30], params)
    c = Sequence(2, "c", [50, 51, 52, 53, 54], params)  # another prefix: admitted at once
    for seq in (a, b, c):
        assert sched.add(seq) is None
    first = sched.schedule()
    assert [s.seq.seq_id for s in first.scheduled] == [0, 2]
    sched.postprocess(first, {0: 7, 2: 7})
    second = sched.schedule()
    admitted = next(s for s in second.scheduled if s.seq is b)
    assert b.num_cached_tokens == 12 and admitted.start == 12 and admitted.num_new_tokens == 1


def test_waiting_sequence_waits_for_a_running_prefill_of_its_prefix():
    # Budget 8 tokens per step: `a` computes its 16-token shared prefix over two steps; `b`,
    # which shares it, is held back until the blocks are cached, then computes only its tail.
    bs = 4
    sched = make_sched(num_blocks=64, block_size=bs, budget=8, max_model_len=64)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    shared = list(range(1, 17))
    a = Sequence(0, "a", shared + [20], params)
    b = Sequence(1, "b", shared + [30], params)
    assert sched.add(a) is None and sched.add(b) is None
    while not b.is_finished:
        out = sched.schedule()
        assert all(s.seq is a for s in out.scheduled) or a.num_computed_tokens >= 16
        sched.postprocess(out, {s.seq.seq_id: 7 for s in out.scheduled if s.samples})
    assert b.num_cached_tokens == 16


def test_admission_keeps_blocks_for_running_growth():
    # 100 blocks of 4 tokens; the reserve may take up to 10 of them.
    sched = make_sched(num_blocks=100, block_size=4, budget=400)
    a = gen(0, [1, 2, 3, 4], max_tokens=37, ignore_eos=True)  # KV up to 40 tokens: 10 blocks
    assert sched.add(a) is None
    runner = FakeRunner(sched)
    sched.postprocess(out := sched.schedule(), runner.step(out))
    assert len(a.block_table) == 1  # its 4 prompt tokens
    # b's prompt takes 91 blocks: 99 free, but a, given its block for this step, still grows
    # into 8 more.
    b = gen(1, [5] * 364, max_tokens=1)
    assert sched.add(b) is None
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a]
    sched.postprocess(out, runner.step(out))
    # Once a is done b is admitted (with nothing running, nothing is held back).
    while not a.is_finished:
        sched.postprocess(out := sched.schedule(), runner.step(out))
    sched.postprocess(out := sched.schedule(), runner.step(out))
    assert b.is_finished and sched.num_preemptions == 0


def _run_behind_lead(sched, lead, rest) -> FakeRunner:
    """Prefill lead alone, then queue rest and run everything to completion, checking the
    invariants each step and the expected tokens at the end; returns the runner (its steps)."""
    assert sched.add(lead) is None
    runner = FakeRunner(sched)
    sched.postprocess(out := sched.schedule(), runner.step(out))  # lead prefilled alone
    for seq in rest:
        assert sched.add(seq) is None
    while sched.has_unfinished():
        sched.postprocess(out := sched.schedule(), runner.step(out))
        check_invariants(sched, [lead] + rest)
    assert_expected([lead] + rest)
    return runner


def test_mixed_chunks_ride_in_decode_steps_longest_max_tokens_first():
    """With mixed_chunk_tokens P, once something decodes, each step gives prompts that are not
    due at most P tokens of at most MIXED_CHUNK_SEQS prompts; prompts go longest max_tokens
    first, whatever order they came in."""
    sched = make_sched(num_blocks=256, budget=64, max_num_seqs=16, mixed_chunk_tokens=5)
    lead = gen(0, range(1, 9), max_tokens=200, ignore_eos=True)
    rest = [gen(i, range(10 * i, 10 * i + 8), max_tokens=10 + i, ignore_eos=True) for i in (1, 2)]
    rest += [gen(i, range(10 * i, 10 * i + 8), max_tokens=30 - i, ignore_eos=True) for i in (3, 4)]
    runner = _run_behind_lead(sched, lead, rest)
    first_step = {}
    for n, step in enumerate(runner.steps):
        for seq_id, _, _, _ in step:
            first_step.setdefault(seq_id, n)
        decoding = [e for e in step if e[2] == 1]
        prompts = [e for e in step if e[2] > 1]
        if decoding and prompts:
            assert sum(e[2] for e in prompts) <= 5 and len(prompts) <= 4, step
    assert sorted(first_step, key=first_step.get) == [0, 3, 4, 2, 1]
    # After the lead's step, 5 prompt tokens a step: the last prompt's first token is the 25th.
    assert first_step[1] == 1 + 24 // 5


def test_mixed_chunk_room_adds_the_padding_rows_tokens():
    """mixed_chunk_room(d) (the runner's padding decode rows of a step with d decode rows) adds
    to P: a mixed step gives prompts that are not due up to P + room(d) tokens, and uses them
    while prompts wait."""
    room = lambda d: -d % 4  # noqa: E731 (buckets every 4 rows)
    sched = make_sched(
        num_blocks=512, budget=64, max_num_seqs=16, mixed_chunk_tokens=5, mixed_chunk_room=room
    )
    lead = gen(0, range(1, 9), max_tokens=300, ignore_eos=True)
    rest = [
        gen(i, range(10 * i, 10 * i + 9), max_tokens=200 - i, ignore_eos=True) for i in range(1, 9)
    ]
    runner = _run_behind_lead(sched, lead, rest)
    given = []  # (decode rows, prompt tokens) of each mixed step
    for step in runner.steps:
        d = sum(1 for e in step if e[2] == 1)
        prompt = sum(e[2] for e in step if e[2] > 1)
        if d and prompt:
            given.append((d, prompt))
            assert prompt <= 5 + room(d), step
    assert any(prompt > 5 for _, prompt in given)
    assert (1, 5 + 3) in given  # the first mixed step: one decode row, 3 padding rows


def test_mixed_chunks_admit_due_prompts_at_once():
    """A prompt that could not finish within the longest running sequence if deferred (its
    max_tokens + DUE_SLACK_STEPS reach that sequence's remaining steps) is prefilled whole."""
    sched = make_sched(num_blocks=256, budget=64, max_num_seqs=16, mixed_chunk_tokens=2)
    lead = gen(0, range(1, 5), max_tokens=20, ignore_eos=True)
    assert sched.add(lead) is None
    runner = FakeRunner(sched)
    sched.postprocess(out := sched.schedule(), runner.step(out))  # lead prefilled, decodes next
    due = gen(1, range(30, 60), max_tokens=10, ignore_eos=True)  # 10 + 16 >= 19 remaining
    assert sched.add(due) is None
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 1), (1, 30)]


def _lookahead_step(monkeypatch, lookahead, max_tokens):
    """The step after a lead (max_tokens 60) is prefilled, with prompts of 20 tokens and the
    given max_tokens waiting, P = 2: (seq_id, tokens) scheduled."""
    monkeypatch.setattr(prompt_allowance, "DUE_LOOKAHEAD_STEPS", lookahead)
    sched = make_sched(num_blocks=256, budget=64, max_num_seqs=16, mixed_chunk_tokens=2)
    assert sched.add(gen(0, range(1, 5), max_tokens=60, ignore_eos=True)) is None
    runner = FakeRunner(sched)
    sched.postprocess(out := sched.schedule(), runner.step(out))  # 59 steps left
    for i, m in enumerate(max_tokens, start=1):
        assert sched.add(gen(i, range(20 * i, 20 * i + 20), max_tokens=m, ignore_eos=True)) is None
    return [(s.seq.seq_id, s.num_new_tokens) for s in sched.schedule().scheduled]


def test_due_prompt_brings_prompts_due_within_the_lookahead(monkeypatch):
    """Once a prompt is due (44 + 16 >= 59), the eager step also prefills those due within
    DUE_LOOKAHEAD_STEPS more steps (30 + 16 + 16 >= 59), not the rest (10 + 32 < 59)."""
    assert _lookahead_step(monkeypatch, 16, [44, 30, 10]) == [(0, 1), (1, 20), (2, 20), (3, 2)]
    # Without the look-ahead the second rides a chunk of P tokens and the third waits.
    assert _lookahead_step(monkeypatch, 0, [44, 30, 10]) == [(0, 1), (1, 20), (2, 2)]


def test_lookahead_waits_for_a_due_prompt(monkeypatch):
    """With no prompt due, the look-ahead changes nothing: prompts ride P tokens a step."""
    assert _lookahead_step(monkeypatch, 16, [30, 10]) == [(0, 1), (1, 2)]


def test_lookahead_run_gives_expected_outputs(monkeypatch):
    """A ragged batch under the look-ahead: every sequence ends with its expected tokens, and
    steps that carry more than P prompt tokens are fewer than without it."""
    eager = {}
    for lookahead in (0, 16):
        monkeypatch.setattr(prompt_allowance, "DUE_LOOKAHEAD_STEPS", lookahead)
        rng = random.Random(3)
        sched = make_sched(num_blocks=512, budget=64, max_num_seqs=32, mixed_chunk_tokens=4)
        seqs = [
            gen(i, [rng.randrange(1, 50) for _ in range(rng.randrange(4, 24))],
                max_tokens=rng.randrange(5, 80), ignore_eos=True)
            for i in range(24)
        ]  # fmt: skip
        runner = run_to_completion(sched, seqs)
        assert_expected(seqs)
        eager[lookahead] = sum(
            1
            for step in runner.steps
            if any(e[2] == 1 for e in step) and sum(e[2] for e in step if e[2] > 1) > 4
        )
    assert eager[16] < eager[0], eager

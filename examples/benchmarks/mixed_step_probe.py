"""What a prompt chunk costs when it rides in a decode step, against the same tokens prefilled
on their own: the number behind overlapping prefill with decode (llama3.1-8b by default).

For decode batches of B sequences (nano's contexts at the step where B still run) and C prompt
tokens (whole prompts of up to 512 tokens each), one eager forward + lm_head of each of:
  decode(B)      B single-token rows;
  prefill(C)     the C prompt tokens alone;
  mixed(B, C)    both in one step (decode rows first, as the scheduler orders them);
GPU ms from CUDA-graph replays (no launch gaps: the GPU's own cost), and the host ms of
launching the step eagerly (what it costs the host unless it is captured); medians of REPS.
saving = decode + prefill - mixed is what riding along saves; saving / C is per prompt token.
nano has 142,827 prompt tokens, so saving / C x 142,827 bounds what a schedule that hides
every prompt this way could take off a run (it needs about 142,827 / C such steps).

Usage (CUDA machine, repo root): python examples/benchmarks/mixed_step_probe.py [PRESET] [P]
P > 0 makes each prompt a later chunk of a longer prompt: C tokens after a cached P-token
prefix (its K/V random), as most chunks of a prompt prefilled in pieces are.
"""

from __future__ import annotations

import random
import sys
import time

import torch

from batchgen.bench.random_model import build_random_model
from batchgen.bench.timing import graph_median_us
from batchgen.layers.context import AttentionContext

BS = 16  # KV block size (the engine's default)
REPS = 10
BATCHES = (32, 64, 128, 256)
CHUNKS = (256, 512, 1024, 2048)
PROMPT = 512  # tokens per whole prompt in a chunk


class Cache:
    """A paged KV cache with random contents and a bump allocator of distinct blocks."""

    def __init__(self, cfg, num_blocks: int, device) -> None:
        shape = (num_blocks, BS, cfg.num_key_value_heads, cfg.head_dim)
        self.layers = [
            (torch.randn(shape, device=device, dtype=torch.bfloat16),
             torch.randn(shape, device=device, dtype=torch.bfloat16))
            for _ in range(cfg.num_hidden_layers)
        ]  # fmt: skip
        self.order = torch.randperm(num_blocks).tolist()
        self.next = 0

    def table(self, tokens: int) -> list[int]:
        n = -(-tokens // BS)
        blocks = self.order[self.next : self.next + n]
        self.next += n
        assert len(blocks) == n, "cache too small"
        return blocks


def slot(table: list[int], pos: int) -> int:
    return table[pos // BS] * BS + pos % BS


def context(rows, device, kv) -> tuple[AttentionContext, torch.Tensor]:
    """rows: (table, start, q_len) per sequence, decode rows first -> (ctx, positions [T])."""
    t = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
    width = -(-max(len(r[0]) for r in rows) // 16) * 16
    tables = [r[0] + [0] * (width - len(r[0])) for r in rows]
    cu, pos, slots = [0], [], []
    for table, start, n in rows:
        cu.append(cu[-1] + n)
        pos += range(start, start + n)
        slots += [slot(table, p) for p in range(start, start + n)]
    lens = [start + n for _, start, n in rows]
    d = sum(1 for r in rows if r[2] == 1)
    split = {}
    if 0 < d < len(rows):
        split = dict(
            num_decode_rows=d,
            prefill_cu_seqlens_q=t([c - d for c in cu[d:]], torch.int32),
            prefill_seq_lens=t(lens[d:], torch.int32),
            prefill_block_tables=t(tables[d:], torch.int32),
        )
    ctx = AttentionContext(
        cu_seqlens_q=t(cu, torch.int32),
        seq_lens=t(lens, torch.int32),
        max_seqlen_q=max(r[2] for r in rows),
        max_seqlen_k=max(lens),
        slot_mapping=t(slots, torch.int64),
        block_tables=t(tables, torch.int32),
        kv_caches=kv,
        is_decode=d == len(rows),
        **split,
    )
    return ctx, t(pos, torch.int64)


@torch.inference_mode()
def time_step(model, rows, cache, vocab) -> tuple[float, float]:
    """(GPU ms, host ms) of one forward + lm_head of `rows`: the GPU time from CUDA-graph
    replays (no launch gaps, as if the host kept ahead), the host time of an eager launch
    (what the step costs the host when it is not captured); medians of REPS."""
    device = cache.layers[0][0].device
    ctx, positions = context(rows, device, cache.layers)
    ids = torch.randint(0, vocab, (positions.numel(),), device=device)
    # Logits of each sequence's last row, as a step that samples every sequence.
    last = torch.tensor([c - 1 for c in ctx.cu_seqlens_q.tolist()[1:]], device=device)

    def step():
        return model.compute_logits(model(ids, positions, ctx)[last])

    host = []
    for _ in range(REPS + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    gpu_us = graph_median_us(step, REPS)
    return gpu_us / 1e3, sorted(host[2:])[REPS // 2]


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "llama3.1-8b"
    device = torch.device("cuda")
    model, _ = build_random_model(preset, torch.bfloat16, device)
    model.fold_norms_()
    cfg = model.config
    rng = random.Random(0)
    ctxs = {}
    for b in BATCHES:
        t = round(1024 - 924 * b / 256)
        ctxs[b] = [rng.randint(100, 1024) + t for _ in range(b)]
    # Chunks get blocks of their own; the decode batches of each B reuse one region (they never
    # run together), sized for the largest.
    prefix = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    chunk_blocks = sum(-(-(prefix + min(PROMPT, c)) // BS) * max(1, c // PROMPT) for c in CHUNKS)
    decode_blocks = max(sum(-(-c // BS) for c in cs) for cs in ctxs.values())
    cache = Cache(cfg, chunk_blocks + decode_blocks, device)
    chunk_rows = {}
    for c in CHUNKS:
        sizes = [min(PROMPT, c)] * max(1, c // PROMPT)
        chunk_rows[c] = [(cache.table(prefix + n), prefix, n) for n in sizes]
    base = cache.next
    decode_rows = {}
    for b, cs in ctxs.items():
        cache.next = base
        decode_rows[b] = [(cache.table(c), c - 1, 1) for c in sorted(cs, reverse=True)]
    print(f"{preset}: ms of one step (forward + lm_head): GPU from graph replays, host of an "
          f"eager launch; medians of {REPS}; chunks after a {prefix}-token prefix")  # fmt: skip
    print(f"{'B':>4} {'C':>5} {'decode':>7} {'(host)':>7} {'prefill':>8} {'mixed':>7} "
          f"{'(host)':>7} {'saving':>7} {'us/tok':>7}")  # fmt: skip
    prefill = {c: time_step(model, chunk_rows[c], cache, cfg.vocab_size)[0] for c in CHUNKS}
    for b in BATCHES:
        decode, decode_host = time_step(model, decode_rows[b], cache, cfg.vocab_size)
        for c in CHUNKS:
            mixed, host = time_step(model, decode_rows[b] + chunk_rows[c], cache, cfg.vocab_size)
            saving = decode + prefill[c] - mixed
            print(f"{b:>4} {c:>5} {decode:>7.2f} {decode_host:>7.2f} {prefill[c]:>8.2f} "
                  f"{mixed:>7.2f} {host:>7.2f} {saving:>7.2f} {saving / c * 1e3:>7.2f}",
                  flush=True)  # fmt: skip
    print("prefill alone, ms per 1k tokens: "
          + ", ".join(f"C={c}: {prefill[c] / c * 1e3:.2f}" for c in CHUNKS))  # fmt: skip


if __name__ == "__main__":
    main()

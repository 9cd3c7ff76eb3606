"""Can prefill and decode share the GPU side by side? llama3.1-8b decode steps (memory-bound)
and prefill steps (compute-bound) replayed at the same time on two streams, with and without a
split of the SMs between them (CUDA green contexts), against running them one after the other.

Each kind of step is captured once as a CUDA graph (forward + lm_head; nano-like contexts for
the decode batch, whole prompts for the prefill), each with its own memory. A round enqueues
ND decode replays on one stream and NP prefill replays on the other, sized so that each kind
alone takes about the same time, and reports the seconds until both streams are done against
the sum of the two run alone (full GPU). A ratio under 1 is overlap: what a scheduler that
prefills on one partition while decoding on the other could gain.

Usage (CUDA machine, repo root): python examples/benchmarks/sm_split_probe.py [B] [C]
B decode rows (default 128), C prompt tokens a prefill step (default 4096, prompts of 1024).
"""

from __future__ import annotations

import random
import sys
import time

import torch
from mixed_step_probe import BS, Cache, context

from batchgen.bench.random_model import build_random_model

PRESET = "llama3.1-8b"
SPLITS = (48, 64, 80)  # SMs given to the decode stream (the prefill stream gets the rest)


def step_fn(model, rows, cache, vocab):
    """forward + lm_head over `rows` (see mixed_step_probe.context) as a no-argument function,
    and the tensors it reads."""
    device = cache.layers[0][0].device
    ctx, positions = context(rows, device, cache.layers)
    ids = torch.randint(0, vocab, (positions.numel(),), device=device)
    last = torch.tensor([c - 1 for c in ctx.cu_seqlens_q.tolist()[1:]], device=device)

    @torch.inference_mode()
    def step():
        return model.compute_logits(model(ids, positions, ctx)[last])

    return step, (ctx, positions, ids, last)


def capture(model, rows, cache, vocab, stream=None):
    """A CUDA graph of forward + lm_head over `rows`, with its own memory pool, captured on
    `stream` (a new one by default); returns (graph, the tensors its replay reads)."""
    step, keep = step_fn(model, rows, cache, vocab)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # A capture stream of its own: cuBLAS keeps a workspace per stream, and two graphs captured
    # on one stream share it; replayed at the same time, their split-K kernels then wait on
    # each other's flags forever (a first run of this probe hung there).
    with torch.cuda.graph(graph, stream=stream or torch.cuda.Stream()):
        step()
    return graph, keep


def timed(fn, *streams) -> float:
    """Wall seconds of fn, from an idle device until `streams` (and the device) are done: a
    device-wide synchronize need not wait for green-context streams."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    for s in streams:
        s.synchronize()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def rounds(decode, prefill, nd, np_, sd, sp) -> float:
    """Seconds to replay nd decode graphs on stream sd and np_ prefill graphs on sp, enqueued
    alternately so neither stream waits on the host."""

    def go():
        for i in range(max(nd, np_)):
            if i < nd:
                with torch.cuda.stream(sd):
                    decode.replay()
            if i < np_:
                with torch.cuda.stream(sp):
                    prefill.replay()

    return min(timed(go, sd, sp) for _ in range(3))


def green_stream(num_sms: int):
    """(context, stream) confined to num_sms SMs, across the torch 2.10-2.12 forms of the API."""
    from torch.cuda.green_contexts import GreenContext

    try:
        ctx = GreenContext.create(num_sms=num_sms, device_id=0)
    except TypeError:
        ctx = GreenContext.create(num_sms, 0)
    if hasattr(ctx, "Stream"):
        return ctx, ctx.Stream()
    print("    (green context without Stream(): stream made while it is current)")
    ctx.set_context()
    stream = torch.cuda.Stream()
    ctx.pop_context()
    return ctx, stream


def main() -> None:
    b = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    c = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    device = torch.device("cuda")
    model, _ = build_random_model(PRESET, torch.bfloat16, device)
    model.fold_norms_()
    cfg = model.config
    rng = random.Random(0)
    t = round(1024 - 924 * b / 256)
    ctxs = sorted((rng.randint(100, 1024) + t for _ in range(b)), reverse=True)
    prompts = [1024] * max(1, c // 1024)
    cache = Cache(cfg, sum(-(-n // BS) for n in ctxs + prompts) + 16, device)
    decode_rows = [(cache.table(n), n - 1, 1) for n in ctxs]
    prefill_rows = [(cache.table(n), 0, n) for n in prompts]
    decode, keep_d = capture(model, decode_rows, cache, cfg.vocab_size)
    prefill, keep_p = capture(model, prefill_rows, cache, cfg.vocab_size)
    t_d = min(timed(lambda: [decode.replay() for _ in range(20)]) for _ in range(3)) / 20
    t_p = min(timed(lambda: [prefill.replay() for _ in range(5)]) for _ in range(3)) / 5
    nd = max(1, round(1.0 / t_d))  # about a second of each
    np_ = max(1, round(1.0 / t_p))
    alone = nd * t_d + np_ * t_p
    print(f"{PRESET}: decode step B={b}: {t_d * 1e3:.2f} ms; prefill step {c} tokens: "
          f"{t_p * 1e3:.2f} ms; a round = {nd} decode + {np_} prefill steps, "
          f"{alone:.3f} s one after the other")  # fmt: skip
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    both = rounds(decode, prefill, nd, np_, s1, s2)
    print(f"  two streams, no split:        {both:.3f} s  ({both / alone:.2f} of alone)")
    hi = torch.cuda.Stream(priority=-1)
    both = rounds(decode, prefill, nd, np_, hi, s2)
    print(f"  decode stream at priority:    {both:.3f} s  ({both / alone:.2f} of alone)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n in SPLITS:
        try:
            gd, sd = green_stream(n)
            gp, sp = green_stream(sms - n)
        except Exception as e:  # no green-context support in this build or driver
            print(f"  green contexts unavailable: {type(e).__name__}: {e}")
            break
        confined(model, decode_rows, prefill_rows, cache, cfg.vocab_size, n, sms, sd, sp)
        d_alone = min(timed(lambda sd=sd: _replay_on(decode, sd, 10), sd) for _ in range(2)) / 10
        p_alone = min(timed(lambda sp=sp: _replay_on(prefill, sp, 3), sp) for _ in range(2)) / 3
        both = rounds(decode, prefill, nd, np_, sd, sp)
        print(f"  split {n:>3} / {sms - n:>3} SMs: decode alone {d_alone * 1e3:6.2f} ms, prefill "
              f"alone {p_alone * 1e3:7.2f} ms; both {both:.3f} s ({both / alone:.2f} of "
              f"alone)", flush=True)  # fmt: skip
        del gd, gp
    del keep_d, keep_p


def confined(model, decode_rows, prefill_rows, cache, vocab, n, sms, sd, sp) -> None:
    """Whether the partition holds for eager launches on its stream, and for graphs captured on
    it: each kind alone on its partition, ms a step, and both kinds together when captured
    there (77 decode + 11 prefill steps, as the rounds above)."""
    decode, keep_d = step_fn(model, decode_rows, cache, vocab)
    prefill, keep_p = step_fn(model, prefill_rows, cache, vocab)

    def eager(fn, stream, k):
        with torch.cuda.stream(stream):
            for _ in range(k):
                fn()

    e_d = min(timed(lambda: eager(decode, sd, 10), sd) for _ in range(2)) / 10
    e_p = min(timed(lambda: eager(prefill, sp, 3), sp) for _ in range(2)) / 3
    try:
        g_d, keep_gd = capture(model, decode_rows, cache, vocab, stream=sd)
        g_p, keep_gp = capture(model, prefill_rows, cache, vocab, stream=sp)
    except Exception as e:
        print(f"    capture on a green stream failed: {type(e).__name__}: {e}")
        return
    c_d = min(timed(lambda: _replay_on(g_d, sd, 10), sd) for _ in range(2)) / 10
    c_p = min(timed(lambda: _replay_on(g_p, sp, 3), sp) for _ in range(2)) / 3
    both = rounds(g_d, g_p, 77, 11, sd, sp)
    print(f"    eager on the partitions: decode {e_d * 1e3:6.2f} ms ({n} SMs), prefill "
          f"{e_p * 1e3:7.2f} ms ({sms - n} SMs); captured on them: decode {c_d * 1e3:6.2f} ms, "
          f"prefill {c_p * 1e3:7.2f} ms, both {both:.3f} s", flush=True)  # fmt: skip
    del keep_d, keep_p, keep_gd, keep_gp


def _replay_on(graph, stream, n: int) -> None:
    with torch.cuda.stream(stream):
        for _ in range(n):
            graph.replay()


if __name__ == "__main__":
    main()

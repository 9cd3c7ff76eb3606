"""The Python API in one script: generate (greedy, sampled, n > 1), score, and streaming.

Runs on the tiny demo model on CPU in a few seconds (its weights are random, so the text is
gibberish; the calls are the same for a real model). Build the model once, then run:

    batchgen make-model --arch llama --preset tiny examples/tiny-llama
    python examples/python_api.py                  # or: python examples/python_api.py MODEL_DIR
"""

from __future__ import annotations

import argparse

from batchgen import LLM, SamplingParams

PROMPTS = [
    "The city council met on Monday to discuss",
    "Once upon a time, in a small village,",
    "The recipe calls for two cups of flour and",
]


def generate_greedy(llm: LLM) -> None:
    print("== generate: greedy")
    # temperature=0.0 is greedy decoding: the same prompt always gives the same text.
    params = SamplingParams(max_tokens=12, temperature=0.0)
    # Prompts are strings (tokenized with the model's tokenizer) or lists of token ids.
    # Outputs come back in input order, one RequestOutput per prompt.
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)  # use_tqdm=True: a progress bar
    for i, out in enumerate(outputs):
        # finish_reason: "stop" (EOS or a stop string), "length" (max_tokens) or "error".
        print(
            f"[{i}] {out.text!r} finish={out.finish_reason} prompt_tokens={out.num_prompt_tokens}"
            f" output_tokens={out.num_output_tokens}"
        )


def generate_sampled(llm: LLM) -> None:
    print("== generate: sampled, n=3")
    # n samples of one prompt share its KV-cache blocks. A fixed seed makes the samples
    # reproducible (the random stream is keyed per request, not per batch).
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_tokens=12, seed=1234)
    (out,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    for sample in out.outputs:  # one CompletionOutput per sample
        print(f"sample {sample.index}: {sample.text!r} finish={sample.finish_reason}")


def generate_with_a_bad_request(llm: LLM) -> None:
    print("== generate: one bad request among good ones")
    # Params may differ per prompt (a SamplingParams or a dict of its fields each). A bad
    # request (here an empty prompt) comes back with finish_reason "error" and a message;
    # the other requests are not affected.
    params = [SamplingParams(max_tokens=4, temperature=0.0), {"max_tokens": 4}]
    for out in llm.generate([PROMPTS[0], ""], params, use_tqdm=False):
        print(f"finish={out.finish_reason} error={out.error!r}")


def score(llm: LLM) -> None:
    print("== score")
    # The log-likelihood of each candidate continuation after its prompt (text is joined as
    # prompt + separator + candidate). A higher score means the model finds it more likely.
    prompts = ["Question: What is the capital of France?\nAnswer:"]
    candidates = [["Paris", "Lyon", "a bowl of soup"]]
    (scores,) = llm.score(prompts, candidates, separator=" ", use_tqdm=False)
    for candidate, s in zip(candidates[0], scores):
        # score: sum of the candidate tokens' log-probs; mean: per token.
        print(f"{candidate!r}: score={s.score:.4f} tokens={s.num_tokens} mean={s.mean:.4f}")


def stream(llm: LLM) -> None:
    print("== stream: results as each request finishes")
    # llm.engine is the streaming interface below llm.generate: add requests, then call
    # step() until none is left; each step returns the requests that finished in it.
    # ignore_eos makes each request run to its max_tokens, so the finishing order shows.
    engine = llm.engine
    for i, max_tokens in enumerate([16, 4, 8]):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"req-{i}", PROMPTS[i], params)  # ids: unique while in flight
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            print(f"step {step}: {out.request_id} done, {out.num_output_tokens} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="examples/tiny-llama", help="model dir")
    args = parser.parse_args()
    # One LLM loads the model once; device "auto" picks CUDA when present, else the CPU.
    # Engine options (max_num_seqs, max_model_len, ...) go as keyword arguments.
    llm = LLM(args.model, dtype="auto")
    generate_greedy(llm)
    generate_sampled(llm)
    generate_with_a_bad_request(llm)
    score(llm)
    stream(llm)


if __name__ == "__main__":
    main()

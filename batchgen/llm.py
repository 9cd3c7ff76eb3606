"""LLM: the public batch API — generate and score lists of prompts, results in input order."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from tqdm import tqdm

from batchgen.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.job.spec import PromptSpec
from batchgen.llm_inputs import conversation_list, prompt_list
from batchgen.models.hub import resolve_model
from batchgen.outputs import RequestOutput, ScoreOutput
from batchgen.plan.perplexity import PerplexityOutput, check_window_args, sliding_windows
from batchgen.plan.prompts import PromptError, PromptRenderer
from batchgen.plan.scoring import tokenize_for_scoring
from batchgen.sampling_params import SamplingParams


class LLM:
    """Offline generation over a Hugging Face model directory or hub model id.

    Args:
        model: a model directory (config.json, safetensors, tokenizer.json), or a Hugging Face
            repo id such as "Qwen/Qwen3-0.6B" (fetched into the hub cache, or found there when
            offline; a local directory of the same name wins).
        dtype: "auto", "bfloat16", "float16" or "float32".
        revision: branch, tag or commit of a hub repo id.
        **engine_options: any other EngineConfig field (device, block_size, num_kv_blocks,
            max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching,
            cpu_threads, tensor_parallel_size, ...).

    With tensor_parallel_size > 1 the LLM starts one process per extra rank; `shutdown()` (or
    `with LLM(...) as llm:`) stops them, as does dropping the LLM or leaving Python.
    """

    def __init__(
        self, model: str, dtype: str = "auto", revision: str | None = None, **engine_options
    ) -> None:
        local = resolve_model(model, revision)
        self.engine = LLMEngine(EngineConfig(model=local, dtype=dtype, **engine_options))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        self = cls.__new__(cls)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        return self

    @property
    def stats(self):
        return self.engine.stats

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes and leave the process group now (done
        anyway when the LLM is collected or Python exits). The LLM cannot run afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: str | dict | SequenceABC[str | list[int] | dict],
        sampling_params: SamplingParams | SequenceABC[SamplingParams | dict] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt.

        Args:
            prompts: each a string (tokenized with the model's tokenizer, BOS added), a list of
                token ids, `{"prompt": text}` or `{"prompt_token_ids": ids}`; forms may be mixed.
                A dict with any other key raises ValueError naming the key and the index.
            sampling_params: one SamplingParams for all, or one per prompt (a SamplingParams or
                a dict of its fields; an invalid dict makes that prompt's output an error).
            use_tqdm: show a progress bar with generated tokens/s.

        Returns:
            One RequestOutput per prompt, in input order; a bad request has finish_reason
            "error" and a message in `.error`.
        """
        items = prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(items))
        for i, (prompt, p) in enumerate(zip(items, params)):
            self.engine.add_request(str(i), prompt, p)
        return self._run(len(items), use_tqdm, "generate")

    def chat(
        self,
        messages: SequenceABC[dict] | SequenceABC[SequenceABC[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams | dict] | None = None,
        chat_template: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate a reply to each conversation, rendered with the model's chat template.

        The template runs in batchgen's jinja2 sandbox (as `prompt.chat` in a job file), with
        the generation prompt added; text the template starts with BOS is not given a second.

        Args:
            messages: one conversation (a list of {"role", "content"} dicts) or a list of them.
            sampling_params: as in `generate`, one for all or one per conversation.
            chat_template: a jinja2 template used instead of the model's own.
            use_tqdm: show a progress bar.

        Returns:
            One RequestOutput per conversation, in order; one the template refuses (e.g. by
            `raise_exception`) comes back with finish_reason "error" and error_code
            "template_error".
        Raises:
            ValueError: malformed messages, no chat template, or one that does not compile or
                fails on a plain user message.
        """
        conversations = conversation_list(messages)
        tok = self.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer, and this engine has none (pass token ids)")
        renderer = PromptRenderer(
            PromptSpec(chat_template=chat_template), tok.chat_template, tok.bos_token, tok.eos_token
        )
        try:
            renderer.check(needs_chat=True)
        except PromptError as e:
            message = str(e).replace("prompt.chat_template", "chat_template=")
            raise ValueError(f"chat template: {message}") from None
        params = self._params_per_prompt(sampling_params, len(conversations))
        results: list[RequestOutput | None] = [None] * len(conversations)
        for i, (conversation, p) in enumerate(zip(conversations, params)):
            try:
                rendered = renderer.render_messages(conversation)
            except PromptError as e:
                results[i] = RequestOutput.failed(str(i), [], e.code, f"messages[{i}]: {e}")
                continue
            ids = tok.encode(rendered.text, add_special_tokens=rendered.add_special_tokens)
            self.engine.add_request(str(i), ids, p)
        return self._run(len(conversations), use_tqdm, "chat", results)

    @staticmethod
    def _params_per_prompt(sampling_params, count: int) -> list:
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, (SamplingParams, dict)):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(
                f"got {len(params)} SamplingParams for {count} prompts; pass one, or one per prompt"
            )
        return params

    def score(
        self,
        prompts: SequenceABC[str] | SequenceABC[list[int]],
        candidates: SequenceABC[SequenceABC[str] | SequenceABC[list[int]]],
        separator: str = "",
        return_token_logprobs: bool = False,
        use_tqdm: bool = True,
    ) -> list[list[ScoreOutput]]:
        """Log-likelihood of each candidate continuation of each prompt.

        Text is joined as `prompt + separator + candidate`: the prompt is tokenized alone (BOS
        added) and the candidate tokens are the tokens of the joined text after the prompt's,
        so a candidate is scored exactly as the model would have generated it, with no BOS in
        the middle. Token-id prompts/candidates are used as they are.

        Returns:
            Per prompt, one ScoreOutput per candidate (score = sum log-prob, num_tokens, mean,
            greedy_match, optional token_logprobs); a bad candidate carries an error.
        """
        if len(candidates) != len(prompts):
            raise ValueError(f"got {len(candidates)} candidate lists for {len(prompts)} prompts")
        for i, (prompt, cands) in enumerate(zip(prompts, candidates)):
            prompt_ids, cand_ids = tokenize_for_scoring(self.tokenizer, prompt, cands, separator)
            self.engine.add_score_request(str(i), prompt_ids, cand_ids, return_token_logprobs)
        outputs = self._run(len(prompts), use_tqdm, "score")
        return [
            o.scores
            if o.scores is not None
            else [
                ScoreOutput(0.0, 0, 0.0, error=o.error, error_code=o.error_code)
                for _ in candidates[i]
            ]
            for i, o in enumerate(outputs)
        ]

    def calibrate_kv_scales(
        self, prompts: SequenceABC[str] | SequenceABC[list[int]]
    ) -> list[tuple[float, float]]:
        """With kv_cache_dtype="fp8": set each layer's K/V scales from max |k| and |v| over
        `prompts` (text or token ids; scale = max / 448) and return them, before anything runs.
        Without it the scales are the checkpoint's, else 1.0 (or the first
        `calibrate_kv_scales` prompts' when that option is set)."""
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self.engine.calibrate_kv_scales(ids)

    def perplexity(
        self,
        texts: SequenceABC[str] | SequenceABC[list[int]],
        context: int = 2048,
        stride: int = 512,
        use_tqdm: bool = True,
    ) -> list[PerplexityOutput]:
        """Sliding-window perplexity of each text (batchgen.plan.perplexity has the recipe:
        Hugging Face's strided window, every token after the first scored once).

        Args:
            texts: strings (tokenized once each, BOS added as for generation) or token ids.
            context: most tokens a window holds (<= the engine's max_model_len).
            stride: tokens between window starts (1 .. context); each window scores the
                tokens past the previous window's end, so every scored token has at least
                context - stride tokens of context after the first window.
            use_tqdm: show a progress bar over the windows.

        Returns:
            One PerplexityOutput per text, in input order (`.perplexity`, `.nll`,
            `.num_tokens`); a text with fewer than 2 tokens, or a token the engine refuses,
            has `.error`. `PerplexityOutput.pool(outputs)` pools several texts.
        """
        check_window_args(context, stride)
        if context > self.engine.max_model_len:
            raise ValueError(
                f"context={context}: longer than the engine's max_model_len="
                f"{self.engine.max_model_len}"
            )
        owners: list[int] = []  # window -> text index
        outputs = [PerplexityOutput(0.0, 0, 0) for _ in texts]
        for i, text in enumerate(texts):
            ids = self.tokenizer.encode(text) if isinstance(text, str) else list(text)
            windows = sliding_windows(len(ids), context, stride)
            if not windows:
                outputs[i].error_code = "too_short"
                outputs[i].error = f"text {i} has {len(ids)} token(s): nothing to score"
            for w in windows:
                prompt, scored = ids[w.begin : w.scored_from], ids[w.scored_from : w.end]
                self.engine.add_score_request(str(len(owners)), prompt, [scored])
                owners.append(i)
        for owner, result in zip(owners, self._run(len(owners), use_tqdm, "perplexity")):
            out = outputs[owner]
            score = result.scores[0] if result.scores is not None else None
            error, code = (score.error, score.error_code) if score else (None, None)
            if result.error is not None or error is not None:
                if out.error is None:
                    out.error = result.error or error
                    out.error_code = result.error_code or code
                continue
            out.nll -= score.score
            out.num_tokens += score.num_tokens
            out.num_windows += 1
        for out in outputs:
            if out.error is not None:
                out.nll, out.num_tokens = 0.0, 0
        return outputs

    def _run(
        self,
        count: int,
        use_tqdm: bool,
        what: str,
        results: list[RequestOutput | None] | None = None,
    ) -> list[RequestOutput]:
        """Step the engine until the `count` requests ("0".."count-1") are done; `results` may
        hold outputs decided before the engine (those ids were never added)."""
        results = results if results is not None else [None] * count
        bar = tqdm(total=count, desc=what, disable=not use_tqdm, dynamic_ncols=True)
        bar.update(sum(r is not None for r in results))
        stats = self.engine.stats
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                results[int(out.request_id)] = out
                bar.update(1)
            bar.set_postfix(
                tok_s=f"{stats.generated_tokens_per_s:.0f}",
                hit=f"{stats.prefix_cache_hit_rate:.0%}",
                refresh=False,
            )
        bar.close()
        return results  # type: ignore[return-value]

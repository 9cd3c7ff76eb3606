"""`batchgen perplexity MODEL TEXT_FILE`: sliding-window perplexity of a model on a text file."""

from __future__ import annotations

import json
import sys

import click

from batchgen.pipeline.exit_codes import EXIT_BAD_JOB


def fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_BAD_JOB)


@click.command()
@click.argument("model", type=click.Path(file_okay=False))
@click.argument("text_file", type=click.Path(dir_okay=False))
@click.option("--context", default=2048, show_default=True, help="Most tokens in a window.")
@click.option("--stride", default=512, show_default=True, help="Tokens between window starts.")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              default="auto", show_default=True)  # fmt: skip
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--quantization", type=click.Choice(["fp8"]), default=None,
              help="fp8: the projections quantized to FP8 at load (online).")  # fmt: skip
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto",
              show_default=True)  # fmt: skip
@click.option("--calibrate-kv-scales", type=int, default=0, show_default=True,
              help="With --kv-cache-dtype fp8: K/V scales from the first N windows.")  # fmt: skip
@click.option("--json", "json_out", default=None, help="Also write the numbers to this file.")
def perplexity(
    model, text_file, context, stride, dtype, device, quantization, kv_cache_dtype,
    calibrate_kv_scales, json_out,
) -> None:  # fmt: skip
    """Sliding-window perplexity of MODEL on TEXT_FILE (UTF-8, read as one text).

    Windows of --context tokens start every --stride tokens; each scores the tokens past the
    previous window's end (Hugging Face's strided recipe: every token after the first is scored
    once, with at least context - stride tokens before it).
    """
    from batchgen.config import ConfigError
    from batchgen.llm import LLM
    from batchgen.models.errors import ModelLoadError
    from batchgen.plan.perplexity import check_window_args

    try:
        check_window_args(context, stride)
        with open(text_file, encoding="utf-8") as f:
            text = f.read()
    except ValueError as e:
        fail(f"{text_file}: {e}" if isinstance(e, UnicodeDecodeError) else str(e))
    except OSError as e:
        fail(f"{text_file}: cannot read ({e.strerror})")
    try:
        llm = LLM(
            model,
            dtype=dtype,
            device=device,
            max_model_len=context,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            calibrate_kv_scales=calibrate_kv_scales,
        )
    except (ModelLoadError, ConfigError) as e:
        fail(f"{model}: {e}")
    try:
        show = sys.stderr.isatty()
        out = llm.perplexity([text], context=context, stride=stride, use_tqdm=show)[0]
    except ValueError as e:  # a context past the model's max_position_embeddings
        fail(f"{model}: {e}")
    if out.error is not None:
        fail(f"{text_file}: {out.error}")
    record = {
        "model": model,
        "text_file": text_file,
        "context": context,
        "stride": stride,
        "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
        "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_scales": llm.engine.kv_scales() if kv_cache_dtype == "fp8" else None,
        "perplexity": out.perplexity,
        "nll": out.nll,
        "num_tokens": out.num_tokens,
        "num_windows": out.num_windows,
    }
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    click.echo(
        f"perplexity {out.perplexity:.4f} over {out.num_tokens} tokens "
        f"({out.num_windows} windows of <= {context} tokens, stride {stride})"
    )

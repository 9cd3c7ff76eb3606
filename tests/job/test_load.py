"""Job file loading and validation: every mistake names its key path."""

from __future__ import annotations

import textwrap

import pytest

from batchgen.job import JobError, load_job

BASE = """
model: {path: examples/tiny-llama}
input: {path: examples/data/docs.jsonl}
prompt: {template: "Summarize:\\n{text}\\nSummary:"}
sampling: {max_tokens: 32, temperature: 0.0}
output: {path: out/summarize}
"""


def job_from(tmp_path, text: str, *overrides: str):
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text))
    return load_job(path, list(overrides))


def test_valid_job_with_defaults(tmp_path):
    job = job_from(tmp_path, BASE)
    assert job.mode == "generate" and job.input.id_column == "id"
    assert job.output.shard_rows == 10000 and job.output.compression == "zstd"
    assert job.sampling.base_params() == {"max_tokens": 32, "temperature": 0.0}


def test_unknown_key_with_hint(tmp_path):
    with pytest.raises(
        JobError,
        match=r"sampling\.temprature: unknown key \(did you mean "
        r"'temperature'\?\)",
    ):
        job_from(tmp_path, BASE.replace("temperature", "temprature"))
    with pytest.raises(
        JobError, match=r"^\S+/job\.yaml: outptu: unknown key \(did you mean 'output'\?\)"
    ):
        job_from(tmp_path, BASE + "outptu: {}\n")


def test_unknown_engine_option(tmp_path):
    with pytest.raises(
        JobError,
        match=r"model\.max_num_seq: unknown key \(did you mean "
        r"'max_num_seqs'\?\)",
    ):
        job_from(
            tmp_path,
            BASE.replace("path: examples/tiny-llama", "path: examples/tiny-llama, max_num_seq: 4"),
        )


def test_wrong_types(tmp_path):
    with pytest.raises(JobError, match=r"sampling\.max_tokens: expected int, got str 'many'"):
        job_from(tmp_path, BASE.replace("max_tokens: 32", "max_tokens: many"))
    with pytest.raises(JobError, match=r"output\.shard_rows: expected int, got bool"):
        job_from(tmp_path, BASE, "output.shard_rows=true")
    with pytest.raises(JobError, match=r"model\.block_size: expected int"):
        job_from(tmp_path, BASE, "model.block_size=1.5")


def test_bad_values(tmp_path):
    with pytest.raises(JobError, match=r"sampling\.temperature=-1\.0: must be 0 \(greedy\) or"):
        job_from(tmp_path, BASE, "sampling.temperature=-1")
    with pytest.raises(JobError, match=r"model\.cpu_kv_cache_gb=nan: must be a finite number"):
        job_from(tmp_path, BASE, "model.cpu_kv_cache_gb=.nan")
    with pytest.raises(JobError, match=r"model\.block_size=12: must be a power of two"):
        job_from(tmp_path, BASE, "model.block_size=12")
    with pytest.raises(
        JobError, match=r"model\.mixed_chunk_tokens=-1: must be between 0 \(off\) and"
    ):
        job_from(tmp_path, BASE, "model.mixed_chunk_tokens=-1")
    job = job_from(tmp_path, BASE, "model.mixed_chunk_tokens=256")
    assert job.model.engine_config().mixed_chunk_tokens == 256
    assert (
        job_from(tmp_path, BASE, "model.kn_weights=false").model.engine_config().kn_weights is False
    )
    with pytest.raises(JobError, match=r"model\.kn_weights: expected bool"):
        job_from(tmp_path, BASE, "model.kn_weights=3")
    with pytest.raises(JobError, match=r"mode: 'sample' is not supported"):
        job_from(tmp_path, BASE, "mode=sample")


def test_tune_gemms_job_key(tmp_path):
    assert job_from(tmp_path, BASE).model.engine_config().tune_gemms is True
    config = job_from(tmp_path, BASE, "model.tune_gemms=false").model.engine_config()
    assert config.tune_gemms is False
    with pytest.raises(JobError, match=r"model\.tune_gemms: expected bool"):
        job_from(tmp_path, BASE, "model.tune_gemms=3")


def test_missing_required(tmp_path):
    with pytest.raises(JobError, match=r"^\S+/job\.yaml: output: missing required section"):
        job_from(tmp_path, BASE.replace("output: {path: out/summarize}", ""))
    with pytest.raises(JobError, match=r"^\S+/job\.yaml: input\.path: missing required key"):
        job_from(tmp_path, BASE.replace("path: examples/data/docs.jsonl", "id_column: id"))


def test_path_escaping_the_working_dir(tmp_path):
    with pytest.raises(
        JobError,
        match=r"input\.path: '\.\./\.\./etc/in' escapes the working "
        r"directory",
    ):
        job_from(tmp_path, BASE, "input.path=../../etc/in")
    assert job_from(tmp_path, BASE, "output.path=/tmp/abs").output.path == "/tmp/abs"
    # Inputs are only read: a '..' that stays inside (as text) is fine there.
    assert job_from(tmp_path, BASE, "input.path=examples/../x.jsonl").input.path.endswith("x.jsonl")


@pytest.mark.parametrize("path", ["out/linkdir/../escaped", "out/a/../b", "/tmp/a/../b", "out/.."])
def test_output_path_with_any_dotdot_is_refused(tmp_path, path):
    # Behind a symlink `linkdir/..` is the link target's parent: out/linkdir/../escaped wrote to
    # /tmp/escaped although the text stays inside the working directory.
    with pytest.raises(JobError, match=r"^\S+/job\.yaml: output\.path: .* has a '\.\.' component"):
        job_from(tmp_path, BASE, f"output.path={path}")


def test_python_tags_refused(tmp_path):
    evil = BASE + "extra: !!python/object/apply:os.system ['echo pwned']\n"
    with pytest.raises(
        JobError,
        match=r"line 7\): YAML tags such as '!!python/object/apply:"
        r"os.system' are not allowed",
    ):
        job_from(tmp_path, evil)


def test_set_overrides(tmp_path):
    job = job_from(
        tmp_path,
        BASE,
        "sampling.temperature=0.7",
        "sampling.stop=[END, '###']",
        "model.max_num_seqs=4",
        "input.columns=[topic]",
    )
    assert job.sampling.base_params()["temperature"] == 0.7
    assert job.sampling.base_params()["stop"] == ("END", "###")
    assert dict(job.model.options) == {"max_num_seqs": 4}
    assert job.input.columns == ("topic",)
    with pytest.raises(JobError, match="expected KEY.PATH=VALUE"):
        job_from(tmp_path, BASE, "sampling.temperature")


def test_placeholders_must_be_plain_columns(tmp_path):
    with pytest.raises(JobError, match=r"placeholder \{text\.__class__\} is not allowed"):
        job_from(tmp_path, BASE.replace("{text}", "{text.__class__}"))
    with pytest.raises(JobError, match=r"placeholder \{text\[0\]\} is not allowed"):
        job_from(tmp_path, BASE.replace("{text}", "{text[0]}"))


def test_prompt_needs_template_or_chat(tmp_path):
    both = BASE.replace(
        'prompt: {template: "Summarize:\\n{text}\\nSummary:"}',
        "prompt: {template: x, chat: [{role: user, content: y}]}",
    )
    with pytest.raises(JobError, match="exactly one of prompt.template or prompt.chat"):
        job_from(tmp_path, both)
    with pytest.raises(JobError, match=r"prompt\.chat\[0\]\.role: 'robot' is not one of"):
        job_from(
            tmp_path,
            BASE.replace(
                '{template: "Summarize:\\n{text}\\nSummary:"}',
                "{chat: [{role: robot, content: hi}]}",
            ),
        )


def test_shipped_jobs_validate():
    for name in ("jobs/summarize.yaml", "jobs/synthetic.yaml"):
        job = load_job(name)
        assert job.model.path == "examples/tiny-llama"
    assert load_job("jobs/synthetic.yaml").sampling.base_params()["n"] == 4


def test_alias_bomb_gives_a_short_error(tmp_path):
    # ~600 bytes of YAML whose aliases expand to 9**6 lists: the message stays short.
    levels = ["&a ['xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx']"]
    for i, name in enumerate("bcdefg"):
        levels.append(f"&{name} [" + ", ".join([f"*{'abcdefg'[i]}"] * 9) + "]")
    stop = "[" + ", ".join(levels) + "]"
    text = BASE.replace(
        "sampling: {max_tokens: 32, temperature: 0.0}",
        f"sampling: {{max_tokens: 32, temperature: 0.0, stop: {stop}}}",
    )
    with pytest.raises(JobError) as e:
        job_from(tmp_path, text)
    assert len(str(e.value)) < 600
    assert "stop" in str(e.value)


def test_nan_temperature_in_a_job_is_refused(tmp_path):
    with pytest.raises(JobError, match="temperature"):
        job_from(tmp_path, BASE, "sampling.temperature=.nan")


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
@pytest.mark.parametrize(
    "key",
    [
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ],
)
def test_non_finite_sampling_numbers_are_refused(tmp_path, key, value):
    with pytest.raises(JobError, match=rf"^\S+/job\.yaml: sampling\.{key}=(nan|-?inf): must be"):
        job_from(tmp_path, BASE, f"sampling.{key}={value}")


def test_logprobs_past_the_cap_is_refused(tmp_path):
    with pytest.raises(
        JobError, match=r"^\S+/job\.yaml: sampling\.logprobs=100000: must be None or an integer in"
    ):
        job_from(tmp_path, BASE, "sampling.logprobs=100000")
    assert (
        job_from(tmp_path, BASE, "sampling.logprobs=100").sampling.base_params()["logprobs"] == 100
    )


def test_alias_bomb_is_refused_at_load_naming_the_key(tmp_path):
    levels = ["&a [x, x, x, x, x, x, x, x, x]"]
    for i, name in enumerate("bcde"):
        levels.append(f"&{name} [" + ", ".join([f"*{'abcde'[i]}"] * 9) + "]")
    text = BASE.replace(
        "sampling: {max_tokens: 32, temperature: 0.0}",
        "sampling: {stop: [" + ", ".join(levels) + "]}",
    )
    with pytest.raises(JobError, match=r"sampling\.stop\[4\]: YAML aliases \(\*name\) expand"):
        job_from(tmp_path, text)
    with pytest.raises(JobError, match=r"line 7\): extra\[0\]: an alias refers to a value"):
        job_from(tmp_path, BASE + "extra: &r [*r]\n")


def test_plain_aliases_and_merge_keys_still_load(tmp_path):
    chat = (
        "prompt:\n  chat:\n    - &sys {role: system, content: be brief}\n"
        "    - {<<: *sys, role: user, content: '{text}'}\n"
    )
    text = BASE.replace('prompt: {template: "Summarize:\\n{text}\\nSummary:"}\n', chat)
    job = job_from(tmp_path, text, "sampling.stop=[&s END, *s]")
    assert [m.role for m in job.prompt.chat] == ["system", "user"]
    assert job.sampling.base_params()["stop"] == ("END", "END")


def test_duplicate_keys_are_refused_naming_key_and_lines(tmp_path):
    with pytest.raises(
        JobError, match=r"\(line 7\): key 'output' given twice in one mapping \(first on line 6\)"
    ):
        job_from(tmp_path, BASE + "output: {path: out/other}\n")
    with pytest.raises(JobError, match=r"\(line 5\): key 'max_tokens' given twice"):
        job_from(tmp_path, BASE.replace("temperature: 0.0", "max_tokens: 8"))
    with pytest.raises(JobError, match=r"^--set .*: key 'a' given twice"):
        job_from(tmp_path, BASE, "sampling.stop={a: 1, a: 2}")


def test_complex_key_is_not_called_a_tag(tmp_path):
    with pytest.raises(JobError, match=r"\(line 7\): a list used as a mapping key") as e:
        job_from(tmp_path, BASE + "? [a, b]\n: 1\n")
    assert "tag" not in str(e.value)


def test_deeply_nested_yaml_is_a_job_error(tmp_path):
    with pytest.raises(JobError, match="nested too deeply"):
        job_from(tmp_path, BASE + "extra: " + "[" * 5000 + "]" * 5000 + "\n")


def test_device_is_checked_with_the_job(tmp_path):
    for device in ("auto", "cpu", "cuda", "cuda:3"):
        job = job_from(tmp_path, BASE, f"model.device={device}")
        assert job.model.engine_config().device == device
    for device in ("tpu", "cuda:x", "CUDA", "cuda:-1"):
        with pytest.raises(
            JobError,
            match=rf"^\S+/job\.yaml: model\.device='{device}': expected auto, cpu, cuda or cuda:N",
        ):
            job_from(tmp_path, BASE, f"model.device={device}")

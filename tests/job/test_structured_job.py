"""sampling.structured_outputs and output.parse_json in a job file: inline schemas, schema
files relative to the working directory, shape errors and refused constraints named by key,
all before any model loads."""

from __future__ import annotations

import json
import textwrap

import pytest

from batchgen.engine.request_checks import ModelLimits
from batchgen.job import JobError, load_job
from batchgen.pipeline.job_limits import check_job_limits
from batchgen.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
BASE = """
model: {path: examples/tiny-llama}
input: {path: in.jsonl}
prompt: {template: "{text}"}
output: {path: out}
"""


def _job(tmp_path, sampling: str, *overrides: str, output: str = ""):
    text = textwrap.dedent(BASE) + f"sampling: {sampling}\n"
    if output:
        text = text.replace("output: {path: out}", f"output: {{path: out, {output}}}")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return load_job(path, list(overrides))


def _constraint(job) -> dict:
    return job.sampling.base_params()["structured_outputs"]


def test_inline_schema_and_other_kinds(tmp_path):
    job = _job(tmp_path, f"{{structured_outputs: {{json: {json.dumps(SCHEMA)}}}}}")
    assert _constraint(job) == {"json": SCHEMA}
    job = _job(tmp_path, '{structured_outputs: {json: \'{"type": "object"}\'}}')
    assert _constraint(job) == {"json": {"type": "object"}}  # JSON text is parsed
    for kind, value in [("regex", "'[0-9]+'"), ("choice", "[a, b]"), ("json_object", "true")]:
        job = _job(tmp_path, f"{{structured_outputs: {{{kind}: {value}}}}}")
        params = SamplingParams(**job.sampling.base_params())
        assert params.structured_outputs.kind == kind


def test_schema_file_relative_to_the_working_dir(tmp_path, monkeypatch):
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "s.json").write_text(json.dumps(SCHEMA))
    monkeypatch.chdir(tmp_path)
    job = _job(tmp_path, "{structured_outputs: {json: schemas/s.json}}")
    assert _constraint(job) == {"json": SCHEMA}  # the content: the fingerprint covers it
    job = _job(tmp_path, "{}", "sampling.structured_outputs.json=schemas/s.json")
    assert _constraint(job) == {"json": SCHEMA}


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ("{structured_outputs: {json: missing.json}}", "cannot read schema file 'missing.json'"),
        ("{structured_outputs: {json: bad.json}}", "schema file 'bad.json' is not JSON"),
        ("{structured_outputs: {json: ../s.json}}", "escapes the working directory"),
        ("{structured_outputs: {json: {}, regex: a}}", "give exactly one of"),
        ("{structured_outputs: {jsn: {}}}", "structured_outputs.jsn: unknown key"),
        ("{structured_outputs: [a]}", "expected a mapping"),
        ("{structured_outputs: {choice: []}}", "structured_outputs.choice=\\[\\]"),
        (
            "{structured_outputs: {json_object: true}, ignore_eos: true}",
            "ignore_eos=True: cannot be set with structured_outputs",
        ),
    ],
)
def test_bad_constraints_name_the_key(tmp_path, monkeypatch, sampling, message):
    (tmp_path / "bad.json").write_text("{not json")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(JobError, match=f"job.yaml: sampling.*{message}"):
        _job(tmp_path, sampling)


def test_a_constraint_the_engine_refuses_fails_the_job(tmp_path):
    limits = ModelLimits(4096, 1000)
    job = _job(tmp_path, "{structured_outputs: {json: {type: array, uniqueItems: true}}}")
    with pytest.raises(JobError, match="sampling.structured_outputs.json: .*uniqueItems"):
        check_job_limits(job, limits)
    job = _job(tmp_path, "{structured_outputs: {regex: '(a'}}")
    with pytest.raises(JobError, match="sampling.structured_outputs.regex: .*unclosed"):
        check_job_limits(job, limits)
    check_job_limits(_job(tmp_path, "{structured_outputs: {regex: 'a+'}}"), limits)


def test_parse_json_option(tmp_path):
    assert _job(tmp_path, "{}").output.parse_json is False
    assert _job(tmp_path, "{}", output="parse_json: true").output.parse_json is True
    with pytest.raises(JobError, match="output.parse_json: expected bool"):
        _job(tmp_path, "{}", output="parse_json: 'yes'")
    with pytest.raises(JobError, match="output.parse_json: only Parquet output"):
        _job(tmp_path, "{}", output="parse_json: true, format: openai-batch")

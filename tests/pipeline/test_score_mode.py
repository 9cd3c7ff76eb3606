"""mode: score end to end: FakeEngine runs (layouts, error records, resume) and one real engine."""

from __future__ import annotations

import json
import os

import pytest
from fake_engine import FakeEngine, FakeTokenizer, fake_score
from workspace import load, make_job, read_output, write_jsonl, write_parquet

from batchgen.engine.request_checks import ModelLimits
from batchgen.job import JobError
from batchgen.pipeline.runner import Runner
from batchgen.pipeline.validate import validate
from batchgen.plan.scoring import tokenize_for_scoring

# polars reads and writes the Parquet these tests check. The GPU machine has none and runs only
# `pytest -m gpu`: there this module is skipped at collection instead of failing it.
pl = pytest.importorskip("polars", reason="polars (a runtime dependency) is not installed")

TEMPLATE = "Q: {question}\nA:"
WORDS = ["yes", "no", "maybe", "blue sky", "forty two", "a cat", "the end"]


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def questions(n: int, prefix: str = "q") -> list[dict]:
    return [
        {
            "id": f"{prefix}{i:04d}",
            "question": f"question {i}?" + " why" * (i % 5),
            "choices": [WORDS[(i + j) % len(WORDS)] for j in range(2 + i % 4)],
            "topic": ["a", "b", "c"][i % 3],
        }
        for i in range(n)
    ]


def score_job(tmp_path, input_path: str, score=None, **sections):
    sections.setdefault("sampling", None)
    sections.setdefault("prompt", {"template": TEMPLATE})
    if score is None:
        score = {"candidates_column": "choices", "separator": " "}
    return make_job(tmp_path, input_path, mode="score", score=score, **sections)


def run(job, engine=None, **kw):
    engine = engine or FakeEngine(max_model_len=64, max_num_seqs=8)
    kw.setdefault("tokenizer_factory", lambda j: FakeTokenizer())
    return Runner(job, engine_factory=lambda j: engine, **kw).run()


def expected(question: str, choices: list[str], sep: str = " ") -> list[float]:
    prompt, cands = tokenize_for_scoring(
        FakeTokenizer(), TEMPLATE.format(question=question), choices, sep
    )
    return [fake_score(prompt, c).score for c in cands]


def check_ranks(df: pl.DataFrame) -> None:
    for (_,), g in df.filter(pl.col("error").is_null()).group_by(["id"]):
        order = g.sort(["score", "candidate_index"], descending=[True, False])
        assert order["rank"].to_list() == list(range(1, g.height + 1))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_list_layout_scores_every_candidate_once(tmp_path, fmt):
    data = questions(60)
    (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"in.{fmt}", data)
    result = run(load(score_job(tmp_path, f"in.{fmt}", output={"shard_rows": 25})))
    assert result.exit_code == 0 and result.complete and result.num_shards == 3
    df = read_output("out")
    want = [(r["id"], j) for r in data for j in range(len(r["choices"]))]
    assert list(zip(df["id"], df["candidate_index"])) == want
    assert df["candidate"].to_list() == [c for r in data for c in r["choices"]]
    assert df["topic"].to_list() == [r["topic"] for r in data for _ in r["choices"]]
    scores = [s for r in data for s in expected(r["question"], r["choices"])]
    assert df["score"].to_list() == pytest.approx(scores)
    assert df["error"].null_count() == df.height and df["rank"].null_count() == 0
    assert (df["mean"] * df["num_tokens"]).to_list() == pytest.approx(df["score"].to_list())
    check_ranks(df)
    assert "token_logprobs" not in df.columns and "text" not in df.columns
    stats = json.loads((tmp_path / "out/_stats.json").read_text())
    assert stats["job"]["ok"] == df.height and stats["job"]["num_generated_tokens"] == 0


def test_bad_rows_and_candidates_become_error_records(tmp_path):
    good = questions(12)
    lines = [json.dumps(r) for r in good]
    lines[1] = json.dumps({**good[1], "choices": ["fine", "", "also fine"]})
    lines[2] = json.dumps({**good[2], "choices": ["ok", None, 7]})
    lines[3] = json.dumps({**good[3], "choices": ["short", "x" * 80]})
    lines[4] = json.dumps({k: v for k, v in good[4].items() if k != "choices"})
    lines[5] = json.dumps({**good[5], "choices": None})
    lines[6] = json.dumps({**good[6], "choices": "not a list"})
    lines[7] = '{"id": "broken", "question": '
    lines[8] = json.dumps({**good[8], "id": good[0]["id"]})
    lines[9] = json.dumps({**good[9], "question": "q" * 80})
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    result = run(load(score_job(tmp_path, "in.jsonl", output={"shard_rows": 5})))
    assert result.exit_code == 0 and result.complete
    df = read_output("out")
    dups = df.filter(pl.col("error_code") == "duplicate_id")
    assert dups.height == len(good[8]["choices"]) and dups["candidate"].null_count() == 0
    df = df.filter(pl.col("error_code").ne_missing("duplicate_id"))
    codes = {(i, c): e for i, c, e in zip(df["id"], df["candidate_index"], df["error_code"])}
    assert len(codes) == df.height
    ids = [r["id"] for r in good]
    assert [codes[(ids[1], j)] for j in range(3)] == [None, "empty_candidate", None]
    assert [codes[(ids[2], j)] for j in range(3)] == [None, "null_candidate", "bad_candidate"]
    assert [codes[(ids[3], j)] for j in range(2)] == [None, "prompt_too_long"]
    assert codes[(ids[4], None)] == "missing_column"
    assert codes[(ids[5], None)] == "missing_candidates"
    assert codes[(ids[6], None)] == "bad_candidates"
    assert codes[(None, None)] == "bad_json"
    assert all(codes[(ids[9], j)] == "prompt_too_long" for j in range(len(good[9]["choices"])))
    for i in (0, 10, 11):
        assert all(codes[(ids[i], j)] is None for j in range(len(good[i]["choices"])))
    # the other candidates of a row with a bad one are scored and ranked among themselves
    row1 = df.filter(pl.col("id") == ids[1]).sort("candidate_index")
    assert row1["rank"].to_list()[1] is None and sorted(row1["rank"].drop_nulls()) == [1, 2]
    assert row1["score"].to_list()[0] == pytest.approx(
        expected(good[1]["question"], ["fine", "also fine"])[0]
    )
    assert all(e.startswith("in.jsonl:") for e in df["error"].drop_nulls())
    check_ranks(df)


def test_group_layout_one_row_per_candidate(tmp_path):
    rows = []
    for g, (q, answers) in enumerate([("sky?", ["blue", "green"]), ("2+2?", ["4", "5", "22"])]):
        for a in answers:
            rows.append({"qid": f"g{g}", "question": q, "answer": a, "topic": f"{g}-{a}"})
    rows.append({"qid": "g2", "question": "lonely?", "answer": "yes", "topic": "t"})
    rows.append({"qid": "g0", "question": "again?", "answer": "no", "topic": "t"})
    rows.append({"qid": "g3", "question": "missing?", "topic": "t"})
    write_jsonl(tmp_path / "in.jsonl", rows)
    score = {"group_column": "qid", "candidate_column": "answer"}
    job = load(score_job(tmp_path, "in.jsonl", score=score, output={"shard_rows": 2}))
    result = run(job, chunk_rows=2)  # groups span reader chunks
    assert result.complete and result.num_shards == 3
    df = read_output("out")
    assert df.height == len(rows)
    assert list(zip(df["id"], df["candidate_index"])) == [
        ("g0", 0),
        ("g0", 1),
        ("g1", 0),
        ("g1", 1),
        ("g1", 2),
        ("g2", 0),
        ("g0", 0),
        ("g3", 0),
    ]
    assert df["topic"].to_list() == [r["topic"] for r in rows]
    assert df["score"].to_list()[:5] == pytest.approx(
        expected("sky?", ["blue", "green"], "") + expected("2+2?", ["4", "5", "22"], "")
    )
    assert df["error_code"].to_list()[5:] == [None, "duplicate_id", "missing_column"]
    check_ranks(df)


def test_rerun_skips_committed_shards_and_redoes_a_lost_one(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", questions(30))
    job = load(score_job(tmp_path, "in.jsonl", output={"shard_rows": 10}))
    assert run(job).complete
    first = read_output("out")
    engine = FakeEngine(max_model_len=64)
    again = run(job, engine=engine)
    assert again.complete and engine.added == [] and again.stats.shards_skipped == 3
    os.unlink(tmp_path / "out/part-00001.parquet")
    engine = FakeEngine(max_model_len=64)
    assert run(job, engine=engine).complete
    assert sorted({int(r.split("/")[0]) for r in engine.added}) == [1]
    assert read_output("out").equals(first)
    score = {"candidates_column": "choices"}  # separator "" instead of " "
    changed = load(score_job(tmp_path, "in.jsonl", score=score, output={"shard_rows": 10}))
    with pytest.raises(JobError, match="changed: score"):
        Runner(
            changed,
            engine_factory=lambda j: FakeEngine(),
            tokenizer_factory=lambda j: FakeTokenizer(),
        ).prepare()


def test_token_logprobs_and_chat_prompt(tmp_path):
    data = questions(6)
    write_jsonl(tmp_path / "in.jsonl", data)
    chat = {"chat": [{"role": "user", "content": "{question}"}]}
    score = {"candidates_column": "choices", "return_token_logprobs": True}
    assert run(load(score_job(tmp_path, "in.jsonl", score=score, prompt=chat))).complete
    df = read_output("out")
    assert df.schema["token_logprobs"] == pl.List(pl.Float64)
    sums = [sum(lp) for lp in df["token_logprobs"]]
    assert sums == pytest.approx(df["score"].to_list())
    # the fake chat template writes BOS itself: no second BOS is added
    rendered = f"<s><|user|>{data[0]['question']}\n<|assistant|>"
    assert df["num_prompt_tokens"][0] == len(FakeTokenizer().encode(rendered, False))


def test_validate_counts_candidates(tmp_path):
    data = questions(10)
    data[3]["choices"] = ["", "x"]
    write_jsonl(tmp_path / "in.jsonl", data)
    job = load(score_job(tmp_path, "in.jsonl"))
    report = validate(
        job, tokenizer_factory=lambda j: FakeTokenizer(), limits_fn=lambda j: ModelLimits(64, 259)
    )
    total = sum(len(r["choices"]) for r in data)
    assert report.rows == 10 and report.ok == total - 1
    assert dict(report.errors) == {"empty_candidate": 1}


@pytest.mark.parametrize(
    "score, sections, message",
    [
        ({"candidates_column": "nope"}, {}, r"score.candidates_column: column 'nope' is not in"),
        ({"candidates_column": "question"}, {}, r"score.candidates_column: .*expected a list"),
        ({"group_column": "id", "candidate_column": "nope"}, {}, r"score.candidate_column: col"),
        ({"group_column": "id"}, {}, r"score.candidate_column: missing required key"),
        ({}, {}, r"score: mode score needs score.candidates_column"),
        ({"candidates_column": "choices", "group_column": "id"}, {}, r"not both"),
        ({"candidates_column": "choices", "sep": " "}, {}, r"score.sep: unknown key"),
        ({"candidates_column": "choices"}, {"sampling": {"max_tokens": 4}}, r"sampling.max_tok"),
        ({"candidates_column": "choices"}, {"output": {"format": "openai-batch"}}, "output.fo"),
        ({"candidates_column": "choices"}, {"prompt": None}, r"prompt: score mode needs"),
    ],
)
def test_job_errors_name_the_key(tmp_path, score, sections, message):
    write_parquet(tmp_path / "in.parquet", questions(4))
    with pytest.raises(JobError, match=message):
        job = load(score_job(tmp_path, "in.parquet", score=score, **sections))
        Runner(job, tokenizer_factory=lambda j: FakeTokenizer()).prepare()
    assert not os.path.exists(tmp_path / "out/_job.json")


def test_score_section_in_generate_mode_is_refused(tmp_path):
    path = make_job(tmp_path, "in.jsonl", score={"candidates_column": "choices"})
    with pytest.raises(JobError, match="score: only used with mode: score"):
        load(path)


def test_real_engine_scores_match_llm_score(tmp_path, tiny_model_dir):
    from batchgen.llm import LLM

    model = tiny_model_dir("llama")
    data = questions(9)
    data[2]["choices"] = ["fine", ""]
    write_jsonl(tmp_path / "in.jsonl", data)
    opts = {"path": model, "num_kv_blocks": 256, "max_model_len": 256}
    job = load(score_job(tmp_path, "in.jsonl", model=opts, output={"shard_rows": 4}))
    result = Runner(job).run()
    assert result.complete
    df = read_output("out")
    llm = LLM(model, num_kv_blocks=256, max_model_len=256)
    prompts = [TEMPLATE.format(question=r["question"]) for r in data]
    want = llm.score(prompts, [r["choices"] for r in data], separator=" ", use_tqdm=False)
    flat = [s for outs in want for s in outs]
    assert df.height == len(flat)
    for got, ref in zip(df.iter_rows(named=True), flat):
        assert got["error_code"] == ref.error_code
        if ref.error_code is None:
            assert got["score"] == pytest.approx(ref.score, abs=1e-5)
            assert got["num_tokens"] == ref.num_tokens
            assert got["greedy_match"] == ref.greedy_match
    check_ranks(df)


def test_candidate_ids_past_the_vocabulary_validate_as_in_the_run(tmp_path):
    # FakeTokenizer ids are bytes + 3: the first byte of "é" (0xC3) is 198, past 180 tokens.
    data = questions(4)
    data[1]["choices"] = ["yes", "é"]
    write_jsonl(tmp_path / "in.jsonl", data)
    job = load(score_job(tmp_path, "in.jsonl"))
    limits = ModelLimits(64, 180)
    report = validate(job, tokenizer_factory=lambda j: FakeTokenizer(), limits_fn=lambda j: limits)
    assert dict(report.errors) == {"invalid_token_id": 1}
    engine = FakeEngine(max_model_len=64, max_num_seqs=8)
    engine.limits = limits
    assert run(job, engine).complete
    df = read_output("out").filter(pl.col("error_code").is_not_null())
    assert df["error_code"].to_list() == ["invalid_token_id"]
    assert df["candidate_index"].to_list() == [1]
    assert report.examples == [f"[invalid_token_id] {df['error'][0]}"]
    assert df["error"][0] == "in.jsonl:2: candidate 1 has token id(s) outside [0, 180): [198]"

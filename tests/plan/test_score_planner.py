"""to_score_rows: engine errors of a score request name the candidate's file:line and index."""

from __future__ import annotations

from batchgen.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.io.score_rows import ScoreRow
from batchgen.outputs import RequestOutput, ScoreOutput
from batchgen.plan.score_planner import Candidate, ScoreRequest, to_score_rows


def request_with_a_refused_candidate(source: str = "data/in.jsonl:4") -> ScoreRequest:
    """Row candidates [a, "", b]: the empty one is refused before the engine, so the engine is
    sent [a, b] and knows b as its candidate 1."""
    cands = [Candidate(i, v, source, {}) for i, v in enumerate(["a", "", "b"])]
    refused = ScoreRow(3, "r3", 1, "", error=f"{source}: candidate 1 is empty", error_code="e")
    return ScoreRequest(3, "r3", [1, 5], cands, {0: [6], 2: [99999]}, [refused])


def test_engine_candidate_error_names_the_row_source_and_its_candidate_index():
    req = request_with_a_refused_candidate()
    bad = ScoreOutput(0.0, 0, 0.0, error="candidate 1: token id 99999", error_code="x")
    out = RequestOutput("0/3", [1, 5], [], scores=[ScoreOutput(-1.0, 1, -1.0), bad])
    rows = to_score_rows(req, out)
    assert [r.candidate_index for r in rows] == [0, 1, 2]
    assert rows[2].error == "data/in.jsonl:4: candidate 2: token id 99999"
    assert rows[2].error_code == "x" and rows[0].ok and rows[0].rank == 1


def test_engine_request_error_names_the_row_source_once():
    req = request_with_a_refused_candidate()
    failed = RequestOutput.failed("0/3", [1, 5], "invalid_token_id", "prompt has token id 7")
    rows = to_score_rows(req, failed)
    assert [r.error for r in rows[::2]] == ["data/in.jsonl:4: prompt has token id 7"] * 2
    assert {r.error_code for r in rows[::2]} == {"invalid_token_id"}
    # A message that already starts with the source is not prefixed twice.
    again = RequestOutput.failed("0/3", [1, 5], "x", rows[0].error)
    assert to_score_rows(req, again)[0].error == rows[0].error


def test_group_layout_candidates_name_their_own_rows():
    cands = [Candidate(0, "a", "g.jsonl:7", {}), Candidate(1, "b", "g.jsonl:8", {})]
    req = ScoreRequest(0, "g", [1, 5], cands, {0: [6], 1: [7]})
    rows = to_score_rows(req, RequestOutput.failed("0/0", [1, 5], "cannot_fit", "too big"))
    assert [r.error for r in rows] == ["g.jsonl:7: too big", "g.jsonl:8: too big"]


def test_real_engine_errors_name_the_rows_candidate(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(model=tiny_model_dir("llama"), dtype="float32", max_model_len=128)
    )
    req = request_with_a_refused_candidate()
    engine.add_score_request("0/3", req.prompt_token_ids, list(req.token_ids.values()))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    rows = to_score_rows(req, outs[0])
    assert rows[0].ok and rows[1].error_code == "e"
    assert rows[2].error_code == "invalid_token_id"
    assert rows[2].error.startswith("data/in.jsonl:4: candidate 2: candidate has token id(s)")

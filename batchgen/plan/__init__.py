"""The plan stage: rows rendered into prompts, tokenized, checked against the model and ordered
for the engine (`planner.py` for generation, `score_planner.py` for scoring)."""

"""Write the example inputs: ~200 short English documents as docs.jsonl and docs.parquet.

Deterministic (seeded): run `python examples/make_data.py` to regenerate examples/data/.
"""

from __future__ import annotations

import json
import os
import random

import polars as pl

SUBJECTS = [
    "The city council",
    "A small bakery",
    "The river",
    "Our neighbor",
    "The museum",
    "A local school",
    "The football club",
    "The old library",
    "A young farmer",
    "The weather service",
    "The train company",
    "A group of students",
]
VERBS = [
    "announced",
    "opened",
    "repaired",
    "celebrated",
    "closed",
    "planned",
    "reported",
    "discovered",
    "painted",
    "visited",
    "measured",
    "improved",
]
OBJECTS = [
    "a new bridge",
    "the summer market",
    "a quiet garden",
    "the main square",
    "an art exhibition",
    "a bicycle path",
    "the harbor",
    "a music festival",
    "the town hall",
    "a reading club",
    "the night bus",
    "a solar roof",
]
DETAILS = [
    "after months of work",
    "despite the rain",
    "with help from volunteers",
    "on a sunny morning",
    "to the surprise of many",
    "for the first time in years",
    "ahead of schedule",
    "with a modest budget",
    "while tourists watched",
    "as the season began",
]
TOPICS = ["news", "culture", "sport", "science", "travel"]


def document(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 5)):
        parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(DETAILS)]
        sentences.append(" ".join(parts) + ".")
    return " ".join(sentences)


def main(out_dir: str = os.path.join(os.path.dirname(__file__), "data"), n: int = 200) -> None:
    rng = random.Random(0)
    rows = [
        {"id": f"doc-{i:04d}", "topic": rng.choice(TOPICS), "text": document(rng)} for i in range(n)
    ]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "docs.jsonl"), "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    pl.DataFrame(rows).write_parquet(os.path.join(out_dir, "docs.parquet"))
    print(f"wrote {n} documents to {out_dir}/docs.jsonl and docs.parquet")


if __name__ == "__main__":
    main()

"""Write the score-mode example input: 40 multiple-choice questions as questions.jsonl.

Each row has an `id`, a `question`, a `subject` and a `choices` list of 2-5 candidate answers
(the correct one in `answer`). Two rows carry a bad candidate on purpose (an empty string and
a null), and one row has no choices, to show per-candidate error records in the output.
Deterministic (seeded): run `python examples/make_score_data.py` to regenerate.
"""

from __future__ import annotations

import json
import os
import random

FACTS = [
    ("geography", "What is the capital of France?", "Paris", ["Lyon", "Marseille", "Nice"]),
    ("geography", "Which ocean is the largest?", "the Pacific", ["the Atlantic", "the Indian"]),
    ("geography", "What is the longest river in Africa?", "the Nile", ["the Congo", "the Niger"]),
    ("geography", "Which country has the city of Kyoto?", "Japan", ["China", "Korea", "Vietnam"]),
    ("geography", "What is the capital of Italy?", "Rome", ["Milan", "Naples", "Turin"]),
    ("science", "What gas do plants take in?", "carbon dioxide", ["oxygen", "helium"]),
    ("science", "How many legs does a spider have?", "eight", ["six", "ten", "four"]),
    ("science", "What is frozen water called?", "ice", ["steam", "salt", "sand"]),
    ("science", "Which planet is closest to the sun?", "Mercury", ["Venus", "Mars", "Earth"]),
    ("science", "What do bees make?", "honey", ["milk", "silk", "wax paper"]),
    ("math", "What is two plus two?", "four", ["three", "five", "twenty-two"]),
    ("math", "How many sides does a triangle have?", "three", ["four", "five"]),
    ("math", "What is ten times ten?", "one hundred", ["twenty", "ten", "one thousand"]),
    ("math", "How many minutes are in an hour?", "sixty", ["thirty", "one hundred"]),
    ("history", "Who painted the Mona Lisa?", "Leonardo da Vinci", ["Picasso", "Monet"]),
    ("history", "In which country were the pyramids of Giza built?", "Egypt", ["Peru", "Iraq"]),
    ("language", "What is the opposite of hot?", "cold", ["warm", "wet", "loud"]),
    ("language", "What is the plural of mouse?", "mice", ["mouses", "meese"]),
    ("language", "Which word is a color?", "blue", ["table", "run", "quickly"]),
    ("language", "What is a baby cat called?", "a kitten", ["a puppy", "a calf", "a foal"]),
]


def make_rows(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(40):
        subject, question, answer, wrong = FACTS[i % len(FACTS)]
        k = rng.randint(1, min(4, len(wrong)))
        choices = [answer] + rng.sample(wrong, k)
        rng.shuffle(choices)
        rows.append(
            {
                "id": f"q{i:03d}",
                "subject": subject,
                "question": question if i < len(FACTS) else f"Quiz {i // len(FACTS)}: {question}",
                "choices": choices,
                "answer": answer,
            }
        )
    rows[7]["choices"] = rows[7]["choices"] + [""]  # an empty candidate
    rows[23]["choices"] = rows[23]["choices"] + [None]  # a null candidate
    rows[31]["choices"] = None  # no candidates at all
    return rows


def main() -> None:
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "questions.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for row in make_rows():
            f.write(json.dumps(row) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

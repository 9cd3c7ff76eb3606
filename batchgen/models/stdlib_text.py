"""The trained tiny model's text: Python standard library source files, read from the running
Python's own library (present on every machine, no download), and their manifest.

The files differ between Python versions, so the manifest records each file's size and sha256
and the Python that was read; `examples/trained-tiny/training_manifest.json` holds the one the
shipped weights were trained on. Run `python -m batchgen.models.stdlib_text eval OUT.txt` to
write the held-out text (and see whether it matches that manifest).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import sysconfig
from dataclasses import dataclass

# Single-file modules (or package files) present from Python 3.10 to 3.14, none deprecated for
# removal: about 1.75 MB of source and docstrings on 3.11.
TRAIN_FILES = (
    "copy.py", "numbers.py", "operator.py", "string.py", "timeit.py", "csv.py", "selectors.py",
    "gettext.py", "weakref.py", "pprint.py", "calendar.py", "tokenize.py", "contextlib.py",
    "uuid.py", "plistlib.py", "fractions.py", "trace.py", "tempfile.py", "random.py",
    "ftplib.py", "codecs.py", "socket.py", "functools.py", "os.py", "traceback.py",
    "platform.py", "urllib/parse.py", "smtplib.py", "statistics.py", "email/message.py",
    "http/server.py", "collections/__init__.py", "ssl.py", "imaplib.py", "configparser.py",
    "shutil.py", "http/client.py", "threading.py", "dataclasses.py", "unittest/case.py",
    "optparse.py", "ast.py", "pdb.py", "pickle.py", "asyncio/base_events.py",
)  # fmt: skip
# Held out (never trained on): about 134 KB on 3.11.
EVAL_FILES = (
    "textwrap.py", "shlex.py", "sched.py", "queue.py", "heapq.py", "bisect.py", "fnmatch.py",
    "glob.py", "colorsys.py", "json/decoder.py", "json/encoder.py", "graphlib.py",
)  # fmt: skip
SPLITS = {"train": TRAIN_FILES, "eval": EVAL_FILES}


@dataclass(frozen=True)
class SourceFile:
    name: str  # relative to the standard library directory
    text: str
    sha256: str  # of the file's bytes
    num_bytes: int


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def read_split(split: str) -> list[SourceFile]:
    """The files of `split` ("train" or "eval") in their fixed order.

    Raises:
        FileNotFoundError: naming a file this Python's standard library lacks.
    """
    root = stdlib_dir()
    out = []
    for name in SPLITS[split]:
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path}: the trained tiny model's {split} text needs this standard library "
                f"file, which Python {platform.python_version()} does not have"
            )
        with open(path, "rb") as f:
            data = f.read()
        out.append(
            SourceFile(name, data.decode("utf-8"), hashlib.sha256(data).hexdigest(), len(data))
        )
    return out


def joined_text(files: list[SourceFile]) -> str:
    """The split as one text: files in order, separated by a blank line."""
    return "\n\n".join(f.text for f in files)


def manifest(files: list[SourceFile]) -> dict:
    """Per file name, size and sha256; the sha256 of the joined text; the Python read."""
    text = joined_text(files).encode("utf-8")
    return {
        "python": platform.python_version(),
        "files": [{"name": f.name, "bytes": f.num_bytes, "sha256": f.sha256} for f in files],
        "text_bytes": len(text),
        "text_sha256": hashlib.sha256(text).hexdigest(),
    }


def main(argv: list[str]) -> int:
    """`python -m batchgen.models.stdlib_text {train,eval} OUT.txt [MANIFEST.json]`: write the
    split's joined text, and say whether it matches the manifest's (when given)."""
    import json

    if len(argv) not in (2, 3) or argv[0] not in SPLITS:
        print(main.__doc__, file=sys.stderr)
        return 2
    files = read_split(argv[0])
    with open(argv[1], "w", encoding="utf-8") as f:
        f.write(joined_text(files))
    ours = manifest(files)
    print(f"wrote {argv[1]}: {ours['text_bytes']} bytes, sha256 {ours['text_sha256']}")
    if len(argv) == 3:
        with open(argv[2], encoding="utf-8") as f:
            expected = json.load(f)["text"][argv[0]]
        same = expected["text_sha256"] == ours["text_sha256"]
        print(
            f"{'matches' if same else 'differs from'} {argv[2]} (Python {expected['python']}; "
            f"this is Python {ours['python']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

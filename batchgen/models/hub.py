"""Hub model ids: resolve `ORG/NAME` (and a revision) to a local snapshot with huggingface_hub.

huggingface_hub owns the cache (its layout, HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN and
`hf auth login`); this module only decides what a model path means and which files to fetch:
weights in safetensors, JSON configs and the tokenizer, never pickle checkpoints.
"""

from __future__ import annotations

import glob
import os
import re

from batchgen.models.errors import ModelLoadError

# What a model needs: config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
# special_tokens_map.json, model*.safetensors (+ index), chat_template.jinja.
ALLOW_PATTERNS = ("*.safetensors", "*.json", "*.jinja")
# Mistral's native-format copy of the weights (a second full download batchgen never reads) and
# Meta's original/ folder (consolidated .pth files and their params).
IGNORE_PATTERNS = ("consolidated*.safetensors", "original/*")
# ORG/NAME as the hub spells repo ids: letters, digits, '-', '_', '.'; no '--' or '..'.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def is_repo_id(text: str) -> bool:
    """True for text shaped like a hub model id (`ORG/NAME`); a path such as `./x/y`, `/x/y`,
    `~/x` or `x/y/z` never is."""
    return (
        _REPO_ID.fullmatch(text) is not None
        and "--" not in text
        and ".." not in text
        and not text.endswith((".git", "."))
    )


def fetch_command(repo_id: str, revision: str | None) -> str:
    """The shell command that puts `repo_id` (the files batchgen reads) into the hub cache."""
    patterns = " ".join(f"'{p}'" for p in ALLOW_PATTERNS)
    rev = f" --revision {revision}" if revision else ""
    return f"hf download {repo_id}{rev} --include {patterns}"


def resolve_model(path: str, revision: str | None = None) -> str:
    """The local model directory for a job's `model.path` / `LLM(model)`.

    A local directory always wins over a hub id of the same text. Anything else shaped like
    `ORG/NAME` is fetched with huggingface_hub (safetensors, JSON and tokenizer files only,
    with its progress bars), or found in its cache when offline.

    Args:
        path: a model directory or a hub repo id.
        revision: a branch, tag or commit of the hub repo (hub ids only).
    Returns:
        The directory holding config.json, the weights and the tokenizer.
    Raises:
        ModelLoadError: a message that says what was wrong and how to fetch the model.
    """
    if os.path.isdir(path):
        if revision is not None:
            raise ModelLoadError(
                f"revision {revision!r} applies to hub ids only, but {path!r} is a local "
                "directory; drop the revision, or move the directory out of the way"
            )
        return path
    if not is_repo_id(path):
        raise ModelLoadError(
            f"{path!r} is not a directory; give a Hugging Face model directory (config.json, "
            "*.safetensors, tokenizer.json) or a hub repo id of the form ORG/NAME"
        )
    snapshot = _snapshot(path, revision)
    _check_snapshot(snapshot, path, revision)
    return snapshot


def _snapshot(repo_id: str, revision: str | None) -> str:
    """snapshot_download with batchgen's file patterns; every failure as one clear message."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
        )
    except GatedRepoError:
        raise ModelLoadError(
            f"{what} is a gated model on the Hugging Face hub: accept its terms on the model's "
            "page, then log in (`hf auth login`) or set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"{what} is not a local directory, and the Hugging Face hub has no model repo of "
            "that name you can read (a private repo needs `hf auth login` or HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ModelLoadError(
            f"{what}: the hub repo has no revision {revision!r} (a branch, tag or commit)"
        ) from None
    except LocalEntryNotFoundError:
        why = (
            "HF_HUB_OFFLINE is set"
            if constants.HF_HUB_OFFLINE
            else "the Hugging Face hub cannot be reached"
        )
        raise ModelLoadError(
            f"{what} is not a local directory, nor in the hub cache ({constants.HF_HUB_CACHE}), "
            f"and {why}. Fetch it once with network access: `{fetch_command(repo_id, revision)}` "
            "(or run this command once online); HF_HOME / HF_HUB_CACHE choose the cache"
        ) from None
    except HfHubHTTPError as e:
        raise ModelLoadError(f"{what}: the Hugging Face hub refused the download ({e})") from None
    except OSError as e:  # a cache folder that cannot be written, a full disk
        raise ModelLoadError(
            f"{what}: cannot download into the hub cache {constants.HF_HUB_CACHE} ({e})"
        ) from None


def _check_snapshot(snapshot: str, repo_id: str, revision: str | None) -> None:
    """A cached snapshot can hold only some files (another program fetched config.json alone):
    say what is missing and how to fetch it, before anything reads the folder."""
    missing = [
        n for n in ("config.json", "tokenizer.json") if not os.path.isfile(f"{snapshot}/{n}")
    ]
    if not glob.glob(os.path.join(glob.escape(snapshot), "*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise ModelLoadError(
            f"{repo_id!r}: the hub snapshot {snapshot} has no {', '.join(missing)}. batchgen "
            "fetches safetensors, JSON and tokenizer files only (never pickle checkpoints); "
            f"complete it with `{fetch_command(repo_id, revision)}`, or pick a repo that has them"
        )

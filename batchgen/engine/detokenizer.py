"""Incremental detokenization, used only to notice stop strings as tokens arrive."""

from __future__ import annotations

from batchgen.models.tokenizer import Tokenizer


class StopStringChecker:
    """Keeps the decoded text of one sequence up to date and reports the first stop string.

    Byte-level BPE can split one character over several tokens, so text is only appended once
    the decoded tail no longer ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.longest = max(len(s) for s in stop)
        self.text = ""
        self.ids: list[int] = []
        self.prefix_offset = 0  # decode from here so tokens see their left context
        self.read_offset = 0  # tokens before this are already in self.text
        self.stop_index: int | None = None  # where the first stop string starts in self.text

    def add(self, token_id: int) -> bool:
        """Append one generated token; True once a stop string has appeared."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        after = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False
        start = max(0, len(self.text) - self.longest + 1)
        self.text += after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stop_index = min(hits)
            return True
        return False

    def final_text(self) -> str:
        """The text up to (not including) the stop string."""
        assert self.stop_index is not None
        return self.text[: self.stop_index]

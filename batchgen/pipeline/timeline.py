"""A job's timeline: when its rows were committed, by whom, and the throughput over time.

Every commit (a whole shard's new rows, or a piece on a stop or checkpoint) records one event
in its manifest entry's `timeline`: the time, when the committing run began on those rows
(it read the shard, or committed its previous piece), the input rows it finished, their
generated tokens, the task and host, and when that run started. A shard's entry carries its pieces'
events too, so the committed entries, plus the pieces of unfinished shards, hold every row's
event exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.io import manifest, pieces


@dataclass(frozen=True)
class Event:
    at: float  # unix time of the commit
    started: float  # unix time the run began on these rows (<= at)
    rows: int  # input rows (units) it finished
    generated_tokens: int
    task: str
    host: str
    run_started: float  # unix time the committing run started


def _events(entry: dict) -> list[Event]:
    found = []
    for e in entry.get("timeline") or []:
        try:
            found.append(
                Event(
                    float(e["at"]),
                    min(float(e.get("started", e["at"])), float(e["at"])),
                    int(e["rows"]),
                    int(e["generated_tokens"]),
                    str(e.get("task", "")),
                    str(e.get("host", "")),
                    float(e.get("run_started", e["at"])),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue  # not an event this version wrote
    return found


def job_events(out_dir: str, fingerprint: str) -> tuple[list[Event], int]:
    """Every commit event of the job in time order, and the number of committed shards whose
    entry has no timeline (written before timelines were recorded)."""
    entries = manifest.read_entries(out_dir)
    entries = {k: e for k, e in entries.items() if e.get("fingerprint") == fingerprint}
    events: list[Event] = []
    untimed = 0
    for entry in entries.values():
        if "timeline" not in entry:
            untimed += 1
        events += _events(entry)
    for k, found in pieces.list_pieces(out_dir, fingerprint).items():
        if k not in entries:
            for p in pieces.usable(found)[0]:
                events += _events(p.entry)
    return sorted(events, key=lambda e: e.at), untimed


def rows_done(events: list[Event]) -> tuple[list[float], list[int]]:
    """Cumulative rows done after each event (times, counts), events in time order."""
    times, counts, total = [], [], 0
    for e in events:
        total += e.rows
        times.append(e.at)
        counts.append(total)
    return times, counts


def throughput(events: list[Event], bins: int) -> tuple[list[float], list[float]]:
    """Generated tokens/s in `bins` equal time bins from the first event's start to the last
    commit: each event's tokens spread evenly over [started, at], summed over events (shards
    in flight together, and tasks at once, add up). Returns (the bins' edges, bins + 1 of
    them; tok/s per bin)."""
    spans = [(e.started, e.at, e.generated_tokens) for e in events]
    lo = min(s for s, _, _ in spans)
    hi = max(e for _, e, _ in spans)
    width = max(hi - lo, 1e-9) / bins
    edges = [lo + i * width for i in range(bins)] + [lo + max(hi - lo, 1e-9)]
    tokens = [0.0] * bins
    for start, end, count in spans:
        if end <= start:  # no interval: all at the commit's instant
            tokens[min(int((end - lo) / width), bins - 1)] += count
            continue
        rate = count / (end - start)
        first = min(int((start - lo) / width), bins - 1)
        last = min(int((end - lo) / width), bins - 1)
        for b in range(first, last + 1):
            overlap = min(end, edges[b + 1]) - max(start, edges[b])
            if overlap > 0:
                tokens[b] += rate * overlap
    return edges, [t / width for t in tokens]

"""Turn what a dead recording left behind into valid traces (``moetrace recover``).

A recorder writes, per rank, closed segment files (streaming modes) or a
checkpoint (``stat``), and a journal (see :mod:`moetrace.trace.files` and :mod:`moetrace.trace.journal`).
:func:`recover` gathers one run's complete segments of each rank in order and
joins them into one trace per rank, marked with root attributes:

- ``recovered = True``;
- ``recovered_last_pass``: the last pass id the trace holds;
- ``recovered_last_segment_unix``: when its last segment (or the checkpoint) was closed;
- ``recovered_segments``: how many segments were joined;
- ``recovered_lost``: JSON description of what was lost (from the journal);
- ``recovered_damaged``: JSON list of the segments (or checkpoint) left out because
  ``moetrace verify`` found them damaged, each with the passes it held.

Segments that an earlier ``dump_record`` consumed are already in that dump and
are not repeated. A run whose process still runs is refused (its segments are
still being written and consumed), unless ``force``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import defaultdict
from pathlib import Path

from .files import CHECKPOINT_RE, JOURNAL_RE, SEGMENT_RE, process_alive, sweep_dead_temporaries
from .join import concat_segments
from .journal import Journal
from .schema import RECOVERED_DAMAGED_ATTR, Attr, TraceError

__all__ = ["RankRecovery", "find_runs", "recover"]


@dataclasses.dataclass(frozen=True)
class RankRecovery:
    """What :func:`recover` did for one rank of a run.

    Attributes:
        path: the recovered trace (``None`` when nothing complete was left).
        first_pass / last_pass: pass ids the recovered trace spans (``-1`` when none).
        lost: plain-language description of what was lost.
        lost_passes: passes known lost (in the open segment), ``None`` if unknown.
    """

    run_id: str
    rank: int
    mode: str
    path: Path | None
    segments: int
    passes: int
    tokens: int
    first_pass: int
    last_pass: int
    last_segment_unix: float
    lost: str
    lost_passes: int | None
    dumped_to: tuple[str, ...]
    damaged: tuple[str, ...] = ()

    def describe(self) -> str:
        where = f"{self.path}" if self.path else "nothing recoverable"
        span = f"passes {self.first_pass}..{self.last_pass} ({self.passes} passes, {self.tokens} tokens) from {self.segments} segment(s)" if self.path else ""
        dumped = f"; earlier dumps: {', '.join(self.dumped_to)}" if self.dumped_to else ""
        damaged = f"; DAMAGED and left out: {'; '.join(self.damaged)}" if self.damaged else ""
        return f"rank {self.rank} ({self.mode}): {where} {span}; lost: {self.lost}{dumped}{damaged}".replace("  ", " ")


@dataclasses.dataclass
class _RankFiles:
    segments: dict[int, Path] = dataclasses.field(default_factory=dict)
    checkpoint: Path | None = None
    journal: Path | None = None


def find_runs(directory: Path) -> dict[str, dict[int, _RankFiles]]:
    """``{run_id: {rank: files}}`` of every recording that left files in ``directory``."""
    runs: dict[str, dict[int, _RankFiles]] = defaultdict(lambda: defaultdict(_RankFiles))
    for path in Path(directory).iterdir():
        if m := SEGMENT_RE.match(path.name):
            runs[m["run"]][int(m["rank"])].segments[int(m["index"])] = path
        elif m := CHECKPOINT_RE.match(path.name):
            runs[m["run"]][int(m["rank"])].checkpoint = path
        elif m := JOURNAL_RE.match(path.name):
            runs[m["run"]][int(m["rank"])].journal = path
    return {run: dict(ranks) for run, ranks in runs.items()}


def _lost(events: list[dict[str, object]], mode: str) -> tuple[str, int | None]:
    """What the journal says was lost after the last closed segment / checkpoint."""
    if events and events[-1].get("event") == "closed":
        return "nothing (the process closed its last segment before it ended)", 0
    if mode == "stat":
        ckpt = [e for e in events if e.get("event") == "checkpoint"]
        after = f"after pass {ckpt[-1]['last_pass']}" if ckpt else "since start_record"
        return f"the counts of passes {after} (recorded after the last checkpoint)", None
    closed = {e.get("segment") for e in events if e.get("event") == "segment"}
    rows = [e for e in events if e.get("event") == "rows" and e.get("segment") not in closed]
    if not rows:
        return "the passes staged in memory after the last complete segment (count not known)", None
    last = rows[-1]
    return (
        f"passes {last['first_pass']}..{last['last_pass']} ({last['passes']} passes, {last['tokens']} tokens) in the open segment "
        "that was never closed, and any passes after them that were still staged in memory",
        int(last["passes"]),  # type: ignore[call-overload]
    )


def _recover_rank(run_id: str, rank: int, files: _RankFiles, out: Path, events: list[dict[str, object]]) -> RankRecovery:
    from .reader import open_trace

    start = next((e for e in events if e.get("event") == "start"), {})
    dumped = tuple(str(e["path"]) for e in events if e.get("event") == "dumped")
    dumped_segments = {int(i) for e in events if e.get("event") == "dumped" for i in e.get("segments", [])}  # type: ignore[union-attr]
    mode = str(start.get("mode", "stat" if files.checkpoint else "per_token"))
    lost, lost_passes = _lost(events, mode)
    if files.checkpoint is not None:
        paths = [files.checkpoint]
    else:
        indices = sorted(i for i in files.segments if i not in dumped_segments)
        gaps = [b for a, b in itertools.pairwise(indices) if b != a + 1]
        if gaps:
            raise TraceError(f"rank {rank} of run {run_id}: segments {indices} are not consecutive (missing before {gaps}); was a segment deleted?")
        paths = [files.segments[i] for i in indices]
    paths, damaged = _intact(paths, events)
    if damaged:
        lost = f"{lost}; and the passes of the damaged file(s) left out"
    if not paths:
        return RankRecovery(run_id, rank, mode, None, 0, 0, 0, -1, -1, 0.0, lost, lost_passes, dumped, damaged)
    with open_trace(paths[0]) as first_trace, open_trace(paths[-1]) as last_trace:
        first_attrs, last_attrs = first_trace.attrs, last_trace.attrs
        mode = str(first_attrs[Attr.MODE])
    if files.checkpoint is not None:
        first_pass = -1
        last_pass = int(last_attrs[Attr.LAST_PASS])  # type: ignore[call-overload]
        closed = float(last_attrs[Attr.CHECKPOINT_UNIX])  # type: ignore[arg-type]
    else:
        first_pass = int(first_attrs[Attr.FIRST_PASS])  # type: ignore[call-overload]
        last_pass = int(last_attrs[Attr.LAST_PASS])  # type: ignore[call-overload]
        closed = float(last_attrs[Attr.SEGMENT_UNIX])  # type: ignore[arg-type]
    attrs = {
        Attr.RECOVERED: True,
        Attr.RECOVERED_LAST_PASS: last_pass,
        Attr.RECOVERED_LAST_SEGMENT_UNIX: closed,
        Attr.RECOVERED_SEGMENTS: len(paths),
        Attr.RECOVERED_LOST: json.dumps({"lost": lost, "lost_passes": lost_passes}),
        RECOVERED_DAMAGED_ATTR: json.dumps(list(damaged)),
    }
    written = concat_segments(paths, out, attrs=attrs)
    with open_trace(written) as trace:
        passes, tokens = int(trace.num_passes().sum()), int(trace.num_tokens().sum())
    if files.checkpoint is not None:
        first_pass = last_pass - passes + 1 if passes else -1
    return RankRecovery(run_id, rank, mode, written, len(paths), passes, tokens, first_pass, last_pass, closed, lost, lost_passes, dumped, damaged)


def _intact(paths: list[Path], events: list[dict[str, object]]) -> tuple[list[Path], tuple[str, ...]]:
    """The files among ``paths`` that :func:`~moetrace.trace.verify.verify_trace` finds
    intact (or readable and unverified), and one line per damaged one (with the passes
    it held, from the journal)."""
    from .verify import verify_trace

    held = {str(e.get("path")): e for e in events if e.get("event") in ("segment", "checkpoint")}
    keep, damaged = [], []
    for path in paths:
        report = verify_trace(path)
        if not report.damaged and not report.problems:
            keep.append(path)
            continue
        note = held.get(path.name, {})
        span = f" (passes {note['first_pass']}..{note['last_pass']}, {note.get('passes', '?')} passes)" if "first_pass" in note else ""
        what = ", ".join(report.damaged) or (report.problems[0][:200] if report.problems else "")
        damaged.append(f"{path.name}{span}: {what}")
    return keep, tuple(damaged)


def recover(directory: Path | str, out: Path | str | None = None, run_id: str | None = None, force: bool = False) -> list[RankRecovery]:
    """Recover the run that left segments in ``directory`` into one trace per rank.

    Args:
        directory: the dead recorder's ``output_dir``.
        out: trace to write (``-rank<r>`` is added when several ranks left
            files); default ``<directory>/moetrace-recovered-<run>.h5``.
        run_id: which run, when the directory holds several.
        force: recover even though the run's process still runs.

    Raises:
        TraceError: nothing to recover, several runs and no ``run_id``, a live
            process, or unreadable segments.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise TraceError(f"{directory}: not a directory; pass the recorder's output_dir")
    runs = find_runs(directory)
    if run_id is not None:
        matches = [r for r in runs if r.startswith(run_id)]
        if len(matches) != 1:
            raise TraceError(f"{directory}: run id {run_id!r} matches {len(matches)} runs; runs with files here: {sorted(runs) or 'none'}")
        run_id = matches[0]
    elif len(runs) == 1:
        run_id = next(iter(runs))
    elif not runs:
        raise TraceError(f"{directory}: no moetrace segments, checkpoints or journals here; nothing to recover")
    else:
        raise TraceError(f"{directory}: holds files of {len(runs)} runs ({', '.join(sorted(runs))}); pass --run-id")
    ranks = runs[run_id]
    journals = {rank: Journal.read(files.journal) if files.journal else [] for rank, files in ranks.items()}
    if not force:
        for rank, events in journals.items():
            start = next((e for e in events if e.get("event") == "start"), None)
            if start is None or events[-1].get("event") == "closed":
                continue
            writers = [int(start["pid"]), *([int(start["writer_pid"])] if start.get("writer_pid") else [])]  # type: ignore[call-overload]
            for pid in writers:  # the recording process, and its writer process (it closes its open segment when that one dies)
                if process_alive(pid, str(start["host"])):
                    raise TraceError(f"rank {rank} of run {run_id} is still being recorded by process {pid}; recover is for dead runs (pass --force to copy what is complete now)")
    target = Path(out) if out is not None else directory / f"moetrace-recovered-{run_id[:12]}.h5"
    results = []
    for rank in sorted(ranks):
        path = target if len(ranks) == 1 else target.with_name(f"{target.stem}-rank{rank}{target.suffix}")
        results.append(_recover_rank(run_id, rank, ranks[rank], path, journals[rank]))
    sweep_dead_temporaries(directory)
    return results

"""A recording process to kill: feeds seeded routing passes forever and logs each pass id first.

Run as ``python -m tests.faults.recording MODE OUTPUT_DIR LOG [DUMP_AT]``. Pass ``i`` routes
:func:`pass_ids` ``(i)``; its id is written to ``LOG`` (flushed) *before* the pass
is fed, so every pass the recorder saw is in the log, independently of moetrace.
Also used in-process by the multi-rank test (:func:`feed`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig

LAYERS, EXPERTS, TOP_K, TOKENS = 3, 16, 2, 8
SEGMENT_SECONDS = 0.2
CHUNK_TOKENS = 64  # 8 passes per hand-off


def pass_ids(pass_id: int, rank: int = 0) -> np.ndarray:
    """Routing of pass ``pass_id`` on ``rank``: ``[TOKENS, LAYERS, TOP_K]`` distinct ids per token."""
    rng = np.random.default_rng((rank, pass_id))
    return np.argsort(rng.random((TOKENS, LAYERS, EXPERTS)), axis=2)[:, :, :TOP_K].astype(np.int64)


def make_recorder(mode: str, output_dir: Path, **rotation: float) -> ExpertDistributionRecorder:
    """A small recorder whose segments rotate every :data:`SEGMENT_SECONDS` (``rotation``: other
    ``segment_seconds`` / ``segment_bytes``)."""
    config = RecorderConfig(
        num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, mode=mode, output_dir=output_dir,
        max_tokens_per_pass=TOKENS, stream_chunk_tokens=CHUNK_TOKENS, stream_chunk_passes=8,
        **{"segment_seconds": SEGMENT_SECONDS, "window": 16, **rotation},  # type: ignore[arg-type]
    )
    return ExpertDistributionRecorder(config)


def writer_pid(output_dir: Path) -> int | None:
    """The recording's writer process, as its journal's ``start`` event names it (``None``: no journal yet)."""
    from moetrace.trace.journal import Journal

    for journal in Path(output_dir).glob(".moetrace-*.journal"):
        start = next((e for e in Journal.read(journal) if e.get("event") == "start"), None)
        if start is not None:
            return int(start["writer_pid"])  # type: ignore[call-overload]
    return None


def wait_gone(pid: int, seconds: float = 60.0) -> None:
    """Wait (bounded) until process ``pid`` of this host has exited (a zombie counts as gone)."""
    import socket
    import time

    from moetrace.trace.files import process_alive

    deadline = time.monotonic() + seconds
    while process_alive(pid, socket.gethostname()):
        assert time.monotonic() < deadline, f"process {pid} still runs after {seconds} s"
        time.sleep(0.02)


def feed(rec: ExpertDistributionRecorder, pass_id: int, rank: int = 0) -> None:
    ids = torch.as_tensor(pass_ids(pass_id, rank))
    with rec.with_forward_pass(pass_id):
        for layer in range(LAYERS):
            with rec.with_current_layer(layer):
                rec.on_select_experts(ids[:, layer])


def two_rank_worker(rank: int, world_size: int, output_dir: str, passes: int, kill_at: int) -> str:
    """Each rank records its own seeded passes; rank 1 SIGKILLs itself before pass ``kill_at``.
    Rank 0 (no collective after ``start_record``) records every pass and dumps normally.

    Segments rotate at every hand-off (``segment_bytes=1``: each ``CHUNK_TOKENS // TOKENS`` passes),
    never by time: a time bound on a loaded machine rotates at every pass (each pass end finds it
    expired), and a segment per pass made the run outlast the launcher's bound."""
    import os
    import signal

    rec = make_recorder("per_token", Path(output_dir), segment_seconds=0, segment_bytes=1)
    rec.start_record()  # collective: broadcasts the run id
    for pass_id in range(passes):
        if rank == 1 and pass_id == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        feed(rec, pass_id, rank)
    rec.stop_record()
    return str(rec.dump_record(Path(output_dir) / "run.h5"))


def hold_background_dumps(marker: Path) -> None:
    """Make every dump stop on its background thread just before its rename (the child process
    that joined the rows has written them to the temporary and exited): write ``marker`` then,
    and never go on (the parent kills the process)."""
    import threading

    from moetrace.trace import offload

    offload.CHILD_MIN_BYTES = 0  # the tiny segments are joined in a child, as a DeepSeek-V3 dump's are
    promote = offload.promote

    def held(staging: Path, target: Path) -> Path:
        if threading.current_thread().name == "moetrace-dump":
            marker.write_text("joined\n")
            threading.Event().wait()
        return promote(staging, target)

    offload.promote = held  # type: ignore[assignment]


def main() -> None:
    """``MODE OUTPUT_DIR LOG [DUMP_AT]``: with ``DUMP_AT``, ``dump_record(wait=False)`` after that
    many passes, its background join held before the rename (``LOG`` + ``.joined`` says when)."""
    mode, output_dir, log = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    dump_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    torch.set_num_threads(1)
    # A held dump needs a join to hold: segments rotate at every hand-off (never by time), so the
    # cut always takes several closed segments. By time, a fast machine closed one segment by the
    # cut, which the dump renames into place without a join (nothing to hold: the test waited forever).
    rec = make_recorder(mode, output_dir, **({"segment_seconds": 0, "segment_bytes": 1} if dump_at >= 0 else {}))
    if dump_at >= 0:
        hold_background_dumps(log.with_name(log.name + ".joined"))
    rec.start_record()
    with log.open("w", encoding="utf-8") as fh:
        pass_id = 0
        while True:
            if pass_id == dump_at:
                rec.dump_record(output_dir / "cut.h5", wait=False)
            fh.write(f"{pass_id}\n")
            fh.flush()
            feed(rec, pass_id)
            pass_id += 1


if __name__ == "__main__":
    main()

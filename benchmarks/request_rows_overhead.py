"""Issue 35: the per_token hot path before request rows and now, side by side in one run.

Run: ``.venv/bin/python benchmarks/request_rows_overhead.py [--quick] [--repeats N] [--rounds N] [--before COMMIT]``

"Before" is the code just before request identity reached ``per_token`` rows: commit
``734a1f5``, the parent of ``42cf41e`` ("Request identity on per_token rows (issue 35 item 1,
contract)"), its ``moetrace/`` extracted with ``git archive`` into a temporary directory.
"Now" is this checkout (``--now COMMIT``: that commit, extracted the same way). Each tree runs
in its own Python process with ``PYTHONPATH`` set to it (the process drops the editable
install's finder and checks that every ``moetrace`` module it imported came from its tree).
The two processes stay up side by side and take turns, one timing at a time: every round times
each variant of one tree, then each variant of the other, the tree that goes first alternating
round by round (ABBA...), so the machine's load drift hits both trees alike. A ratio is taken
between the two trees' timings of one round (seconds apart), then the median over rounds.
``--repeats`` starts a fresh pair of processes each time (so a process's own luck, memory
layout or thread placement, is not the figure either); the spread over repeats is reported.

Workload: DeepSeek-V3's decode shape on one EP rank, as in ``dump_stall.py``: 58 MoE layers,
288 physical slots (256 experts + 32 redundant), top-8, EP 8. One pass is what the engine's
hooks do on the host for it: ``with_forward_pass`` and, per layer, ``with_current_layer``,
``on_select_experts`` on the layer's ``[T, 8]`` ids and ``on_dispatch`` on its ``[8]`` send and
receive counts; no layer compute, so the figure is the recorder's own cost (the "hooks alone"
figure of the Recorder overhead section of docs/benchmarks.md). Workloads (ids drawn once per
layer from the seed):

- ``decode, skewed``: 256 tokens = 256 decoding requests of one row each, Zipf-skewed slots;
  4 requests finish and 4 new ones take their places every pass (continuous batching);
- ``decode, uniform``: the same batch, uniform slots;
- ``prefill, skewed``: 4096 tokens = 16 requests of 256 rows (chunked prefill, 4 chunks per
  request, 4 new requests every pass).

Variants (each its own recorder, ``per_token`` mode, default settings, segments on ``/dev/shm``):

- ``off``: a recorder that is not recording (what an engine with moetrace installed pays while
  it does not record);
- ``per_token``: recording, no batch given (the only ``per_token`` there was before);
- now only, ``off+requests`` and ``per_token+requests``: the engine's batch handed over each
  pass as the adapters do it (``PassBatch.of`` from host arrays, built inside the timed pass,
  then ``with_forward_pass(batch=...)``), so every row carries its request and position.

Figures, on two clocks: the forward thread's CPU time (``time.thread_time``: the hooks' own cost,
without the segment writer's thread) and wall time. Milliseconds per pass (median over every
round of every repeat), the per_token overhead (recording minus ``off`` of the same round and
tree) and the ratios now / before. Checks: every recording variant of both trees counted the same
passes, tokens and expert selections (all of them), the ``off`` ones none; and each "now"
process dumps 3 passes with request rows and holds every token row's request id, position and
ids to the batch given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: the parent of 42cf41e, the commit that put request identity on per_token rows
BEFORE = "734a1f5"
LAYERS, SLOTS, TOP_K, EP = 58, 288, 8, 8
WORKLOADS: dict[str, dict[str, Any]] = {
    "decode, skewed": {"tokens": 256, "prefill": False, "skew": True, "passes": 40},
    "decode, uniform": {"tokens": 256, "prefill": False, "skew": False, "passes": 40},
    "prefill, skewed": {"tokens": 4096, "prefill": True, "skew": True, "passes": 8},
}
QUICK_WORKLOADS = ("decode, skewed",)
TREES = ("before", "now")
VARIANTS = ("off", "per_token", "off+requests", "per_token+requests")
#: per pass: the forward thread's CPU time (what the hooks cost, without the segment writer's thread) and wall time
CLOCKS = ("cpu", "wall")


# ---------------------------------------------------------------------------- the worker (one tree, one process)
def routes(tokens: int, skew: bool, seed: int) -> list[Any]:
    """One ``[tokens, TOP_K]`` int64 id tensor per layer: distinct slots per token, Zipf-skewed or uniform."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, SLOTS + 1) if skew else np.ones(SLOTS)
    out = []
    for _ in range(LAYERS):
        keys = rng.random((tokens, SLOTS)) ** (1.0 / weights)  # weighted sampling without replacement (Efraimidis-Spirakis)
        out.append(torch.as_tensor(np.argpartition(-keys, TOP_K, axis=1)[:, :TOP_K].astype(np.int64)))
    return out


def dispatch_counts(ids: list[Any]) -> list[Any]:
    """Per layer, the ``[EP]`` copies this rank sends to each EP rank (slots split evenly over the ranks)."""
    import torch

    return [torch.bincount(layer.reshape(-1) // (SLOTS // EP), minlength=EP) for layer in ids]


class Requests:
    """The engine's side of the batch: request ids and positions on the host, moving on every pass.

    Decode: ``tokens`` requests of one row each, positions advancing by one, 4 requests replaced
    per pass. Prefill: requests of 256 rows (one chunk each pass, 4 chunks per request), the
    chunks staggered so that 4 requests start every pass.
    """

    def __init__(self, tokens: int, prefill: bool) -> None:
        import numpy as np

        self.prefill = prefill
        self.chunk = 256 if prefill else 1
        self.size = tokens // self.chunk
        self.next_id = 0
        self.ids = [self._new() for _ in range(self.size)]
        self.chunks = np.arange(self.size, dtype=np.int64) % 4  # prefill: chunk index of each request
        self.pos = 512 + np.arange(self.size, dtype=np.int64) % 64  # decode: prompt lengths before decoding
        self.counts = np.full(self.size, self.chunk, dtype=np.int64)
        self.turn = 0

    def _new(self) -> str:
        self.next_id += 1
        return f"{self.next_id:032x}"  # SGLang's rids are uuid4().hex: 32 hex characters

    def step(self) -> tuple[list[str], Any]:
        """The next pass's request ids and the start position of each one's rows (host arrays)."""
        if self.prefill:
            for i in range(self.size):
                if self.chunks[i] == 4:
                    self.ids[i], self.chunks[i] = self._new(), 0
            start = self.chunks * self.chunk
            self.chunks = self.chunks + 1
            return self.ids, start
        for j in range(4):  # 4 requests finish, 4 new ones take their slots
            i = (self.turn * 4 + j) % self.size
            self.ids[i] = self._new()
            self.pos[i] = 512
        self.turn += 1
        start = self.pos.copy()
        self.pos += 1
        return self.ids, start

    def batch(self) -> Any:
        from moetrace.batch import PassBatch

        ids, start = self.step()
        return PassBatch.of(ids, start, self.counts, prefill=self.prefill)


class Workload:
    """One workload's recorders, one per variant this tree has, and its timed passes."""

    def __init__(self, name: str, tmp: Path, variants: tuple[str, ...], quick: bool, seed: int) -> None:
        from moetrace import ExpertDistributionRecorder, RecorderConfig

        spec = WORKLOADS[name]
        self.name, self.tokens, self.prefill = name, spec["tokens"], spec["prefill"]
        self.passes = max(1, spec["passes"] // (4 if quick else 1))
        self.ids = routes(self.tokens, spec["skew"], seed)
        self.sends = dispatch_counts(self.ids)
        self.base = tmp / f"{name.replace(', ', '-')}-{os.getpid()}"
        self.recorders = {}
        for variant in variants:
            config = RecorderConfig(num_layers=LAYERS, num_physical_experts=SLOTS, top_k=TOP_K, ep_size=EP, mode="per_token",
                                    output_dir=self.base / variant, max_tokens_per_pass=self.tokens)
            self.recorders[variant] = rec = ExpertDistributionRecorder(config)
            if not variant.startswith("off"):
                rec.start_record()
        self.feeders = {v: Requests(self.tokens, self.prefill) for v in variants if v.endswith("+requests")}

    def one_pass(self, rec: Any, feeder: Requests | None) -> None:
        ids, sends = self.ids, self.sends
        with rec.with_forward_pass() if feeder is None else rec.with_forward_pass(batch=feeder.batch()):
            for layer in range(LAYERS):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(ids[layer])
                    rec.on_dispatch(sends[layer], sends[layer])

    def time(self, variant: str, passes: int | None = None) -> dict[str, float]:
        """Seconds per pass: the CPU time of this (the forward) thread, and wall time."""
        rec, feeder, passes = self.recorders[variant], self.feeders.get(variant), passes or self.passes
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(passes):
            self.one_pass(rec, feeder)
        return {"cpu": (time.thread_time() - cpu) / passes, "wall": (time.perf_counter() - wall) / passes}

    def finish(self, check: bool) -> dict[str, Any]:
        """What each recorder counted; then (``check``) the request rows of a dumped trace held to the batches."""
        import numpy as np

        counted = {}
        for variant, rec in self.recorders.items():
            snap = rec.snapshot()
            counted[variant] = {"passes": int(snap.num_passes), "tokens": int(snap.num_tokens),
                                "selections": int(np.asarray(snap.physical_count).sum())}
            if not variant.startswith("off"):
                rec.stop_record()
            rec.reset()
        shutil.rmtree(self.base, ignore_errors=True)
        out: dict[str, Any] = {"counted": counted, "passes_per_timing": self.passes, "tokens": self.tokens}
        if check:
            out["rows_checked"] = check_request_rows(self.ids, self.tokens, self.prefill, self.base.with_name(self.base.name + "-check"))
        return out


def check_request_rows(ids: list[Any], tokens: int, prefill: bool, directory: Path, passes: int = 3) -> int:
    """Record ``passes`` passes with their batches, dump, and hold every token row to what was given:
    its request id, its position in the request, and its ids in every layer. Returns the rows checked."""
    import numpy as np

    from moetrace import ExpertDistributionRecorder, RecorderConfig
    from moetrace.trace import open_trace

    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=LAYERS, num_physical_experts=SLOTS, top_k=TOP_K, ep_size=EP, mode="per_token",
                                                    output_dir=directory, max_tokens_per_pass=tokens))
    feeder = Requests(tokens, prefill)
    expected_ids, expected_pos = [], []
    rec.start_record()
    for _ in range(passes):
        batch = feeder.batch()
        request, position = batch.row_requests()
        expected_ids.append(np.asarray(batch.request_ids, dtype=object)[request])
        expected_pos.append(position)
        with rec.with_forward_pass(batch=batch):
            for layer in range(LAYERS):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(ids[layer])
    rec.stop_record()
    path = rec.dump_record(directory / "check.h5")
    want_ids = np.stack([layer.numpy() for layer in ids], axis=1)  # [T, L, k]
    rows = 0
    with open_trace(path) as trace:
        table = trace.request_table()
        for chunk in trace.iter_tokens():
            if chunk.request is None or chunk.request_position is None:
                raise AssertionError("the trace has no request rows")
            for row in range(len(chunk.pass_id)):
                p, t = int(chunk.pass_id[row]), int(chunk.position[row])
                if table[chunk.request[row]] != expected_ids[p][t] or chunk.request_position[row] != expected_pos[p][t]:
                    raise AssertionError(f"pass {p} row {t}: request {table[chunk.request[row]]} position {chunk.request_position[row]}, "
                                         f"given {expected_ids[p][t]} position {expected_pos[p][t]}")
            np.testing.assert_array_equal(chunk.topk_ids, want_ids[chunk.position])
            rows += len(chunk.pass_id)
    if rows != passes * tokens:
        raise AssertionError(f"{rows} token rows in the trace, {passes * tokens} recorded")
    rec.reset()
    shutil.rmtree(directory, ignore_errors=True)
    return rows


def serve(tree: Path, tmp: Path, quick: bool, seed: int) -> None:
    """One tree's process: answer the driver's commands, one JSON line in, one out."""
    # An editable install's finder would serve modules an older tree lacks from the checkout it points at:
    # drop it, so that every moetrace module comes from the tree or fails to import.
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    import torch

    import moetrace

    source = Path(moetrace.__file__).resolve()
    if tree not in source.parents:
        raise SystemExit(f"moetrace imported from {source}, not from the tree {tree}: PYTHONPATH did not take")
    requests_on = (source.parent / "batch.py").exists()
    variants = VARIANTS if requests_on else VARIANTS[:2]
    torch.set_num_threads(1)
    workloads: dict[str, Workload] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "hello":
            reply: Any = {"moetrace": str(source.parent), "request_rows": requests_on, "variants": variants}
        elif op == "setup":
            workloads[cmd["workload"]] = Workload(cmd["workload"], tmp, variants, quick, seed)
            reply = {"passes_per_timing": workloads[cmd["workload"]].passes}
        elif op == "time":
            reply = workloads[cmd["workload"]].time(cmd["variant"], cmd.get("passes"))
        elif op == "finish":
            reply = workloads.pop(cmd["workload"]).finish(check=requests_on)
        elif op == "quit":
            strays = sorted(n for n, m in sys.modules.items() if n.split(".")[0] == "moetrace" and getattr(m, "__file__", None)
                            and tree not in Path(m.__file__).resolve().parents)
            reply = {"strays": strays}
        else:
            raise SystemExit(f"unknown command {op!r}")
        print(json.dumps(reply), flush=True)
        if op == "quit":
            return


# ---------------------------------------------------------------------------- the driver
class Tree:
    """A tree's worker process, driven over its stdin/stdout."""

    def __init__(self, name: str, tree: Path, tmp: Path, args: argparse.Namespace) -> None:
        self.name = name
        self.stderr: IO[str] = tempfile.TemporaryFile("w+")
        command = [sys.executable, str(Path(__file__).resolve()), "--serve", str(tree), "--tmp", str(tmp), "--seed", str(args.seed),
                   *(["--quick"] if args.quick else [])]
        self.proc = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(tree)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True)

    def ask(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.proc.wait(60)
            self.stderr.seek(0)
            raise SystemExit(f"the {self.name} process failed (exit {self.proc.returncode}) at {cmd}:\n{self.stderr.read()[-4000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(60)
        self.stderr.close()


def extract(commit: str, into: Path) -> Path:
    """``moetrace/`` of ``commit`` (the core package is all the workload imports) into ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "moetrace"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(trees: dict[str, Path], tmp: Path, args: argparse.Namespace, load: list[str]) -> list[dict[str, Any]]:
    """``args.repeats`` repeats, each a fresh pair of processes taking turns round by round."""
    repeats = []
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        procs = {name: Tree(name, path, tmp, args) for name, path in trees.items()}
        try:
            info = {name: proc.ask(op="hello") for name, proc in procs.items()}
            result: dict[str, Any] = {"info": info, "workloads": {}}
            for workload in args.workload:
                passes = {name: proc.ask(op="setup", workload=workload)["passes_per_timing"] for name, proc in procs.items()}
                assert passes["before"] == passes["now"]
                for name, proc in procs.items():  # warm-up: every path twice
                    for variant in info[name]["variants"]:
                        proc.ask(op="time", workload=workload, variant=variant, passes=2)
                samples = {name: {clock: {v: [] for v in info[name]["variants"]} for clock in CLOCKS} for name in procs}
                for r in range(args.rounds):
                    order = TREES if (r + rep) % 2 == 0 else TREES[::-1]
                    for name in order:
                        variants = info[name]["variants"]
                        for variant in variants[r % len(variants):] + variants[: r % len(variants)]:
                            timing = procs[name].ask(op="time", workload=workload, variant=variant)
                            for clock in CLOCKS:
                                samples[name][clock][variant].append(timing[clock])
                done = {name: proc.ask(op="finish", workload=workload) for name, proc in procs.items()}
                result["workloads"][workload] = {"samples": samples, "finish": done, "passes_per_timing": passes["now"]}
            strays = {name: proc.ask(op="quit")["strays"] for name, proc in procs.items()}
            if any(strays.values()):
                raise SystemExit(f"moetrace modules imported from outside their tree: {strays}")
        finally:
            for proc in procs.values():
                proc.close()
        load.append(_loadavg())
        print(f"  repeat {rep + 1}/{args.repeats}: {time.perf_counter() - t0:.0f} s, /proc/loadavg {load[-1]}", flush=True)
        repeats.append(result)
    return repeats


def _ratio(values: list[list[float]]) -> dict[str, Any]:
    """Per-round ratios grouped by repeat: the median over all rounds, and the spread of the repeats' medians."""
    flat = [v for rep in values for v in rep]
    medians = [statistics.median(rep) for rep in values]
    return {"median": statistics.median(flat), "repeat_medians": medians, "min": min(medians), "max": max(medians)}


def _samples(rep: dict[str, Any], name: str, clock: str, tree: str, variant: str) -> list[float]:
    """One repeat's seconds per pass of one (tree, variant), round by round."""
    return rep["workloads"][name]["samples"][tree][clock][variant]


def _minus(a: list[float], b: list[float]) -> list[float]:
    return [x - y for x, y in zip(a, b, strict=True)]


def _over(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True)]


def summarise(repeats: list[dict[str, Any]], workloads: list[str], clock: str) -> dict[str, Any]:
    """Per workload, on one clock: ms per pass, per_token overheads and now/before ratios (per round, then the median)."""
    table: dict[str, Any] = {}
    for name in workloads:
        # per repeat, round by round: every (tree, variant) and the overheads (recording minus off, same round and tree)
        per = [{f"{tree} {v}": _samples(rep, name, clock, tree, v) for tree in TREES for v in rep["workloads"][name]["samples"][tree][clock]}
               for rep in repeats]
        for t in per:
            t["before: per_token - off"] = _minus(t["before per_token"], t["before off"])
            t["now: per_token - off"] = _minus(t["now per_token"], t["now off"])
            t["now: per_token+requests - off+requests"] = _minus(t["now per_token+requests"], t["now off+requests"])
            t["now: per_token+requests - off"] = _minus(t["now per_token+requests"], t["now off"])
            t["now: off+requests - off (the batch alone)"] = _minus(t["now off+requests"], t["now off"])
        ms = {k: 1e3 * statistics.median(x for t in per for x in t[k]) for k in per[0] if " " in k and ":" not in k}
        over_ms = {k: 1e3 * statistics.median(x for t in per for x in t[k]) for k in per[0] if ":" in k}
        pairs = {
            "off: now / before": ("now off", "before off"),
            "per_token: now / before": ("now per_token", "before per_token"),
            "per_token+requests (now) / per_token (before)": ("now per_token+requests", "before per_token"),
            "per_token overhead: now / before": ("now: per_token - off", "before: per_token - off"),
            "per_token+requests overhead (now, over off+requests) / per_token overhead (before)":
                ("now: per_token+requests - off+requests", "before: per_token - off"),
            "per_token+requests overhead (now, over off) / per_token overhead (before)": ("now: per_token+requests - off", "before: per_token - off"),
            "per_token+requests / per_token (now, same process)": ("now per_token+requests", "now per_token"),
        }
        ratios = {label: _ratio([_over(t[a], t[b]) for t in per]) for label, (a, b) in pairs.items()}
        table[name] = {"ms_per_pass": ms, "overhead_ms_per_pass": over_ms, "ratios": ratios}
    return table


def check_counts(repeats: list[dict[str, Any]], workloads: list[str]) -> dict[str, Any]:
    """Both trees' recording variants counted the same passes, tokens and selections, and all of them; ``off`` none."""
    totals = {}
    for name in workloads:
        first = repeats[0]["workloads"][name]
        tokens = first["finish"]["now"]["tokens"]
        passes = first["finish"]["before"]["counted"]["per_token"]["passes"]
        want = {"passes": passes, "tokens": passes * tokens, "selections": passes * tokens * TOP_K * LAYERS}
        for rep in repeats:
            for tree in TREES:
                for variant, got in rep["workloads"][name]["finish"][tree]["counted"].items():
                    expected = {"passes": 0, "tokens": 0, "selections": 0} if variant.startswith("off") else want
                    if got != expected:
                        raise AssertionError(f"{name}: {tree} {variant} counted {got}, expected {expected}")
        totals[name] = want
    return totals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: decode, skewed only, 1 repeat of 3 rounds, a quarter of the passes")
    parser.add_argument("--repeats", type=int, help="fresh pairs of processes (default 4; --quick 1)")
    parser.add_argument("--rounds", type=int, help="rounds per repeat, trees taking turns (default 8; --quick 3)")
    parser.add_argument("--before", default=BEFORE, help=f"the commit before request rows (default {BEFORE})")
    parser.add_argument("--now", help="measure this commit as 'now' instead of the checkout (to locate a change between two commits)")
    parser.add_argument("--workload", nargs="+", choices=sorted(WORKLOADS), help="workloads (default: all; --quick: decode, skewed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="results JSON (default benchmarks/results/request_rows_overhead.json)")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.repeats = (1 if args.quick else 4) if args.repeats is None else args.repeats
    args.rounds = (3 if args.quick else 8) if args.rounds is None else args.rounds
    args.workload = args.workload or list(QUICK_WORKLOADS if args.quick else WORKLOADS)
    if args.repeats < 1 or args.rounds < 1:
        parser.error("--repeats and --rounds must be >= 1")
    return args


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def _loadavg() -> str:
    path = Path("/proc/loadavg")
    return path.read_text().strip() if path.exists() else " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve.resolve(), args.tmp, args.quick, args.seed)
        return {}
    before = _git("rev-parse", "--short", args.before)
    now = _git("rev-parse", "--short", args.now or "HEAD")
    modified = not args.now and bool(_git("status", "--porcelain", "--", "moetrace"))
    runtime = _git("log", "-1", "--format=%h", args.now or "HEAD", "--", "moetrace")  # the last commit that changed what "now" runs
    shm = Path("/dev/shm")
    load = [_loadavg()]
    started = time.perf_counter()
    print(f"request rows overhead: before {before} vs now {now} (moetrace/ last changed in {runtime}{', modified since' if modified else ''}); "
          f"{args.repeats} repeat(s) of {args.rounds} rounds; workloads: {'; '.join(args.workload)}; /proc/loadavg {load[0]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="moetrace-rr-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None) as tmp:
        trees = {"before": extract(before, Path(tmp) / "before"), "now": extract(now, Path(tmp) / "now") if args.now else ROOT}
        repeats = measure(trees, Path(tmp), args, load)
    info = repeats[0]["info"]
    if not info["now"]["request_rows"] or (args.before == BEFORE and info["before"]["request_rows"]):
        raise AssertionError(f"request rows: before {info['before']['request_rows']}, now {info['now']['request_rows']}: wrong trees")
    totals = check_counts(repeats, args.workload)
    table = {clock: summarise(repeats, args.workload, clock) for clock in CLOCKS}
    seconds = time.perf_counter() - started
    for clock in CLOCKS:
        print_table(table[clock], clock)
    rows = {name: [rep["workloads"][name]["finish"]["now"]["rows_checked"] for rep in repeats] for name in args.workload}
    print(f"\nboth trees counted the same tokens: {totals}; request rows checked against the batches given: {rows}")
    print(f"before {before}, now {now} (moetrace/ of {runtime}); {seconds:.0f} s; /proc/loadavg: {' | '.join(load)}")
    sys.path.insert(0, str(HERE))
    from harness import machine

    result = {
        "benchmark": "request_rows_overhead", "machine": machine(),
        "command": " ".join(["python benchmarks/request_rows_overhead.py", *(sys.argv[1:] if argv is None else argv)]),
        "before": before, "now": now, "now_moetrace_commit": runtime, "now_modified": modified, "repeats": args.repeats, "rounds": args.rounds,
        "shape": {"layers": LAYERS, "slots": SLOTS, "top_k": TOP_K, "ep": EP},
        "workloads": {name: {k: WORKLOADS[name][k] for k in ("tokens", "prefill", "skew")}
                      | {"passes_per_timing": repeats[0]["workloads"][name]["passes_per_timing"]} for name in args.workload},
        "loadavg": load, "seconds": seconds, "counted": totals, "rows_checked": rows, "trees": info,
        "results": table, "samples": [rep["workloads"] for rep in repeats],
    }
    output = args.output or HERE / "results" / "request_rows_overhead.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")
    return result


def print_table(table: dict[str, Any], clock: str) -> None:
    what = "CPU time of the forward thread" if clock == "cpu" else "wall time"
    print(f"\n== {what}, ms per pass (median over rounds); DeepSeek-V3 decode shape: {LAYERS} layers, {SLOTS} slots, top-{TOP_K}, EP {EP}")
    cols = [f"{tree} {v}" for tree in TREES for v in VARIANTS if not (tree == "before" and v.endswith("+requests"))]
    print(f"{'workload':<18}" + "".join(f"{c:>24}" for c in cols))
    for name, row in table.items():
        print(f"{name:<18}" + "".join(f"{row['ms_per_pass'].get(c, float('nan')):>24.3f}" for c in cols))
    print("-- per_token overhead, ms per pass (recording minus off, same round and tree)")
    for name, row in table.items():
        for label, v in row["overhead_ms_per_pass"].items():
            print(f"{name:<18}{label:<44}{v:>8.3f}")
    print("-- ratios: median over rounds [min, max of the repeats' medians]")
    for name, row in table.items():
        for label, r in row["ratios"].items():
            print(f"{name:<18}{label:<84}{r['median']:>7.3f} [{r['min']:.3f}, {r['max']:.3f}]")


if __name__ == "__main__":
    main()

"""A reference replica behind HTTP, speaking enough of SGLang's server API for ``sglang-router``.

``python -m moetrace.drivers.http_replica --port P --index I`` serves the
reference serving loop (with its prefix cache) on ``127.0.0.1:P``:

- ``GET /health``, ``/health_generate``: 200 when up;
- ``GET /server_info``, ``/model_info`` (and the ``/get_*`` spellings): what a
  router asks when it registers a worker;
- ``POST /generate`` ``{"text": "12 7 33 ...", "sampling_params":
  {"max_new_tokens": n}, "rid": "..."}``: the prompt is token ids written as
  decimal text (or ``"input_ids": [...]``), so a router that matches prefixes
  on text (SGLang's ``cache_aware``) sees token prefixes. The answer carries the
  output ids and ``meta_info`` with ``prompt_tokens``, ``completion_tokens``,
  ``cached_tokens`` (the prefix cache's count), ``replica`` and the replica's
  ``time.monotonic()`` stamps ``received``, ``start``, ``first_token``,
  ``finish`` (one clock for every process of the machine);
- ``GET /moetrace_stats``: what this replica counted per request id.

:func:`record_response` turns one answer into ``ReplicaRecorder`` hooks: the
router's decision is only observed (policy ``external``, reason ``other``, no
candidates), the outcome is the replica's own.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..replicas.replica_recorder import ReplicaRecorder
from .engine import REPLICA_LOOP, REPLICA_MODEL, build_loop, serve

__all__ = ["ReplicaServer", "main", "parse_prompt", "record_response"]


def parse_prompt(body: dict[str, Any]) -> list[int]:
    """Token ids of a ``/generate`` body (``input_ids``, or ``text`` of decimal ids)."""
    if "input_ids" in body:
        ids = body["input_ids"]
    elif isinstance(body.get("text"), str):
        try:
            ids = [int(t) for t in body["text"].split()]
        except ValueError:
            raise ValueError("'text' must be token ids written as decimal numbers separated by spaces") from None
    else:
        raise ValueError("the body needs 'input_ids' (a list of token ids) or 'text' (decimal token ids)")
    if not isinstance(ids, list) or not ids or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise ValueError("the prompt must be a non-empty list of integer token ids")
    return ids


class ReplicaServer:
    """The serving loop on a thread, fed by HTTP handler threads."""

    def __init__(self, index: int, cache_blocks: int, block_size: int, model: dict[str, Any] | None = None, loop: dict[str, Any] | None = None) -> None:
        self.index = index
        self.loop = build_loop(model or REPLICA_MODEL, loop or REPLICA_LOOP, cache_blocks, block_size)
        self.inbox: queue.Queue = queue.Queue()
        self.stats: dict[str, dict[str, Any]] = {}
        self._waiting: dict[str, tuple[threading.Event, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._seq = 0
        threading.Thread(target=self._run, name="moetrace-replica-loop", daemon=True).start()

    def generate(self, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        from ..reference import Request

        received = time.monotonic()
        prompt = parse_prompt(body)
        max_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 16))
        with self._lock:
            self._seq += 1
            rid = str(body.get("rid") or f"r{self.index}-{self._seq}")
        done, meta = threading.Event(), {"id": rid, "replica": self.index, "received": received, "prompt_tokens": len(prompt)}
        self._waiting[rid] = (done, meta)
        self.inbox.put(Request(rid, prompt, max_new))
        if not done.wait(timeout):
            raise TimeoutError(f"request {rid} did not finish within {timeout} s")
        if "error" in meta:
            raise ValueError(meta["error"])
        output = meta.pop("output_ids")
        self.stats[rid] = {k: meta[k] for k in ("cached_tokens", "completion_tokens", "received", "start", "first_token", "finish")}
        return {"text": " ".join(map(str, output)), "output_ids": output, "meta_info": meta}

    def _run(self) -> None:
        serve(self.loop, self._take, self)

    def _take(self, idle: bool) -> bool:
        if idle:
            self._submit(self.inbox.get())
        while not self.inbox.empty():
            self._submit(self.inbox.get_nowait())
        return True

    # StepEvents (moetrace.drivers.engine.serve): stamped into the waiting request's meta_info
    def started(self, rid: str, t: float) -> None:
        self._waiting[rid][1]["start"] = t

    def kv(self, kind: str, hashes: list[int]) -> None:
        """No router listens for KV events here (an external router keeps its own view)."""

    def first_token(self, rid: str, t: float) -> None:
        self._waiting[rid][1]["first_token"] = t

    def finished(self, result: Any, t: float) -> None:
        done, meta = self._waiting.pop(result.rid)
        meta.update(output_ids=result.output_ids, completion_tokens=len(result.output_ids), cached_tokens=result.cached_tokens, finish=t)
        meta.setdefault("first_token", t)
        done.set()

    def _submit(self, request: Any) -> None:
        try:
            self.loop.submit([request])
        except ValueError as exc:
            done, meta = self._waiting.pop(request.rid)
            meta["error"] = str(exc)
            done.set()


def _handler(server: ReplicaServer) -> type[BaseHTTPRequestHandler]:
    info = {"model_path": "moetrace-reference", "tokenizer_path": None, "is_generation": True, "replica": server.index}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _send(self, obj: Any, code: int = 200) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path in ("/health", "/health_generate"):
                self._send({})
            elif path in ("/server_info", "/model_info", "/get_server_info", "/get_model_info"):
                self._send(info)
            elif path == "/moetrace_stats":
                self._send(server.stats)
            else:
                self._send({"error": f"no such endpoint {path}"}, 404)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path.split("?")[0] != "/generate":
                    self._send({"error": f"no such endpoint {self.path}"}, 404)
                    return
                self._send(server.generate(body))
            except (ValueError, TimeoutError) as exc:
                self._send({"error": str(exc)}, 400)

    return Handler


def record_response(recorder: ReplicaRecorder, rid: str, response: dict[str, Any], *, session: str | None = None) -> None:
    """Record one ``/generate`` answer that an external router placed (``on_arrival`` already called)."""
    meta = response["meta_info"]
    recorder.on_decision(rid, int(meta["replica"]), "external", "other", (), t=meta["received"])
    recorder.on_start(rid, t=meta["start"])
    recorder.on_first_token(rid, t=meta["first_token"])
    recorder.on_finish(rid, meta["completion_tokens"], meta["cached_tokens"], t=meta["finish"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A moetrace reference replica behind HTTP (SGLang-style /generate).")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--index", type=int, default=0, help="replica number reported in meta_info")
    parser.add_argument("--cache-blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    server = ReplicaServer(args.index, args.cache_blocks, args.block_size)
    ThreadingHTTPServer((args.host, args.port), _handler(server)).serve_forever()


if __name__ == "__main__":
    main()

"""Convert other tools' routing records into moetrace traces.

Sources:

- **SGLang expert-distribution dumps** (``.pt``, written by
  ``/dump_expert_distribution_record``), loaded with
  ``torch.load(weights_only=True)`` so no arbitrary object is ever unpickled:

  - ``stat`` mode: ``{"rank", "logical_count": [L, E] or [S, L, E], ...}``
    becomes a ``stat`` trace (logical id space, ``/stat`` only: SGLang keeps
    its per-step rows in a ring buffer without their order, so no ``/window``).
  - ``per_pass`` mode: ``{"records": [{"forward_pass_id", "rank",
    "global_physical_count": [L, P], ...}], "last_physical_to_logical_map":
    [L, P]}`` becomes a ``per_pass`` trace (``timestamp`` = NaN: SGLang does
    not record it).
  - ``per_token`` mode: the same with ``"topk_ids_of_layer": [L, T, 8]`` per
    record becomes a ``per_token`` trace (``position`` = index in the pass).

  SGLang dumps do not say ``top_k`` for ``stat``/``per_pass``: pass it. Reading one is the
  only part of this module that needs torch, which it imports then.

- **JSON-lines routing logs**: one object per line and layer,
  ``{"layer": 3, "topk_ids": [5, 9], "pass_id": 0, "position": 12}``
  (``pass_id``/``forward_pass_id``, ``request_id``/``rid`` and
  ``position``/``token_index`` optional). A token is identified by its pass (or
  request) and position; without ``position`` the n-th line of a layer within
  a pass is token n. The result is a ``per_token`` trace whose layers are the
  distinct ``layer`` values. Tokens are written in first-seen order and memory
  stays bounded when each token's lines are near each other in the log.
"""

from __future__ import annotations

import json
import math
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..ids import to_logical
from .schema import PADDING_IDS, Data, TraceError, TraceHeader
from .writer import TraceWriter, token_id_dtype

__all__ = ["convert", "convert_jsonl", "convert_sglang"]

_CHUNK = 65536
_RECORDS_PER_CHUNK = 1024


# ----------------------------------------------------------------------------- shared
def _header(mode: str, mapping: np.ndarray, top_k: int, ep_size: int, layer_ids: np.ndarray, rank: int, run_id: str | None, model: str, engine: str, world_size: int | None = None) -> TraceHeader:
    world = world_size or rank + 1
    if not 0 <= rank < world:
        raise TraceError(f"rank {rank} is outside world_size={world}; pass --world-size larger than every rank")
    num_physical = mapping.shape[1]
    if num_physical % ep_size:
        raise TraceError(f"{num_physical} physical experts cannot be split over ep_size={ep_size}; pass an ep size that divides it")
    identity = (mapping == np.arange(num_physical)).all()
    extra = {"run_id": run_id} if run_id else {}
    return TraceHeader(
        mode=mode, id_space="logical" if identity else "physical", num_layers=mapping.shape[0],
        num_physical_experts=num_physical, top_k=top_k, ep_size=ep_size, layer_ids=layer_ids,
        physical_to_logical=mapping, model=model, engine=engine, rank=rank, world_size=world, **extra,
    )


def _write_stat(writer: TraceWriter, physical: np.ndarray, invalid: np.ndarray, passes: int, tokens: int, padding: np.ndarray | None = None) -> None:
    """``/stat`` for one rank from ``physical [L, P]``, ``invalid [L]`` and, when the source
    says, ``padding [L]`` (ids -1)."""

    h = writer.header
    num_layers, ep = h.num_layers, h.ep_size
    writer.write(Data.STAT_PHYSICAL_COUNT, physical[None].astype(np.int64))
    writer.write(Data.STAT_LOGICAL_COUNT, to_logical(physical, h.physical_to_logical)[None].astype(np.int64))
    writer.write(Data.STAT_INVALID_IDS, invalid[None].astype(np.int64))
    if padding is not None:
        writer.write(PADDING_IDS, padding[None].astype(np.int64))
    writer.write(Data.STAT_SEND_COUNT, np.zeros((1, num_layers, ep), np.int64))
    writer.write(Data.STAT_RECV_COUNT, np.zeros((1, num_layers, ep), np.int64))
    writer.write(Data.STAT_DROPPED, np.zeros((1, num_layers), np.int64))
    writer.write(Data.STAT_NUM_PASSES, np.array([passes], np.int64))
    writer.write(Data.STAT_NUM_TOKENS, np.array([tokens], np.int64))


def _append_tokens(writer: TraceWriter, topk: np.ndarray, pass_id: np.ndarray, position: np.ndarray, totals: np.ndarray, invalid: np.ndarray, padding: np.ndarray) -> None:
    """Append token rows (ids ``>= P`` stored as -2) and add them to ``totals [L, P]``,
    ``invalid [L]`` and ``padding [L]``."""
    num_physical = totals.shape[1]
    bad = (topk >= num_physical) | (topk < -1)
    invalid += bad.sum(axis=(0, 2))
    padding += (topk == -1).sum(axis=(0, 2))
    ids = np.where(bad, -2, topk).astype(token_id_dtype(num_physical))
    ok = ids >= 0
    layer = np.broadcast_to(np.arange(totals.shape[0])[None, :, None], ids.shape)
    totals += np.bincount((layer * num_physical + ids)[ok], minlength=totals.size).reshape(totals.shape)
    writer.append(Data.TOKENS_TOPK_IDS, ids)
    writer.append(Data.TOKENS_PASS_ID, pass_id.astype(np.int64))
    writer.append(Data.TOKENS_POSITION, position.astype(np.int32))


# ----------------------------------------------------------------------------- SGLang
def _tensor(obj: object, what: str, src: Path, shape: tuple[int | None, ...] | None = None, negative: bool = False) -> np.ndarray:
    """``obj`` as an integer array, checked: a tensor, of an integer dtype, of ``shape``
    (``None`` = any length on that axis), and without negative values unless ``negative``.

    Raises:
        TraceError: naming the field, what it holds and what was expected.
    """
    import torch

    if not isinstance(obj, torch.Tensor):
        raise TraceError(f"{src}: {what} is not a tensor ({type(obj).__name__}); not an SGLang expert-distribution dump")
    if obj.dtype == torch.bool or obj.is_floating_point() or obj.is_complex():
        raise TraceError(f"{src}: {what} has dtype {str(obj.dtype).removeprefix('torch.')}, expected an integer tensor; not an SGLang expert-distribution dump")
    if shape is not None and (obj.ndim != len(shape) or any(e is not None and a != e for a, e in zip(obj.shape, shape, strict=False))):
        want = ", ".join("*" if e is None else str(e) for e in shape)
        raise TraceError(f"{src}: {what} has shape {list(obj.shape)}, expected [{want}]; not a dump of this model's layers and experts")
    array = obj.detach().cpu().numpy()
    if not negative and array.size and array.min() < 0:
        raise TraceError(f"{src}: {what} holds negative counts (min {int(array.min())}); the dump is damaged")
    return array


def _record_int(record: dict, key: str, src: Path, index: int, default: int = 0) -> int:
    """An integer field of record ``index`` (``forward_pass_id``, ``rank``)."""
    import torch

    value = record.get(key, default)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TraceError(f"{src}: record {index} has {key}={value!r}, expected an integer; not an SGLang expert-distribution dump")
    return int(value)


def _record_tensor(record: dict, key: str, src: Path, index: int, shape: tuple[int | None, ...], negative: bool = False) -> np.ndarray:
    if key not in record:
        raise TraceError(f"{src}: record {index} has no {key!r}; not an SGLang expert-distribution dump of this mode")
    return _tensor(record[key], f"record {index}'s {key}", src, shape, negative)


def _check_crc(src: Path) -> None:
    """A torch file (a zip archive) whose members do not match their CRC-32 is damaged: ``torch.load``
    does not check them and would hand back the damaged tensors as numbers.

    Raises:
        TraceError: a member's CRC-32 fails or the archive's structure is broken.
    """
    if not zipfile.is_zipfile(src):
        return  # the legacy (pre-1.6) format carries no checksums; torch.load judges it
    try:
        with zipfile.ZipFile(src) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as exc:
        raise TraceError(f"{src}: its zip structure is damaged ({exc}); copy the dump again from a good source") from exc
    if bad is not None:
        raise TraceError(f"{src}: {bad} does not match its CRC-32: the dump is damaged; copy it again from a good source")


def convert_sglang(src: Path | str, out: Path | str, *, top_k: int | None = None, ep_size: int = 1, run_id: str | None = None, world_size: int | None = None, model: str = "") -> Path:
    """Convert an SGLang expert-distribution dump (``.pt``) into a trace at ``out``.

    Per-rank dumps of one run become mergeable (``merge_traces``) when they are
    converted with the same ``run_id`` and ``world_size``.

    Raises:
        TraceError: not a readable SGLang dump, or ``top_k`` is needed and missing.
    """
    src = Path(src)
    if not src.is_file():
        raise TraceError(f"{src}: no such file")
    _check_crc(src)
    import torch

    try:
        data = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(f"{src}: cannot load as a weights-only torch file ({first})") from exc
    if not isinstance(data, dict):
        raise TraceError(f"{src}: expected a dict, found {type(data).__name__}; not an SGLang expert-distribution dump")
    if "logical_count" in data:
        return _sglang_stat(src, data, out, top_k, ep_size, run_id, world_size, model)
    if isinstance(data.get("records"), list) and "last_physical_to_logical_map" in data:
        return _sglang_records(src, data, out, top_k, ep_size, run_id, world_size, model)
    raise TraceError(f"{src}: has neither 'logical_count' (stat) nor 'records' (per_pass/per_token); not an SGLang expert-distribution dump")


def _need_top_k(top_k: int | None, src: Path, mode: str) -> int:
    if top_k is None or top_k < 1:
        raise TraceError(f"{src}: SGLang {mode} dumps do not record top_k; pass --top-k (the model's experts per token)")
    return int(top_k)


def _sglang_stat(src: Path, data: dict, out: Path | str, top_k: int | None, ep_size: int, run_id: str | None, world_size: int | None, model: str) -> Path:
    k = _need_top_k(top_k, src, "stat")
    counts = _tensor(data["logical_count"], "logical_count", src).astype(np.int64)
    if counts.ndim == 2:
        counts = counts[None]
    if counts.ndim != 3 or 0 in counts.shape[1:]:
        raise TraceError(f"{src}: logical_count has shape {list(counts.shape)}, expected [L, E] or [steps, L, E]")
    steps = int((counts.sum(axis=(1, 2)) > 0).sum())
    total = counts.sum(axis=0)
    num_layers, num_experts = total.shape
    mapping = np.tile(np.arange(num_experts), (num_layers, 1))
    rank = int(data.get("rank", 0) or 0)
    with TraceWriter(out, _header("stat", mapping, k, ep_size, np.arange(num_layers), rank, run_id, model, "sglang", world_size)) as writer:
        _write_stat(writer, total, np.zeros(num_layers, np.int64), steps, -(-int(total.sum(axis=1).max()) // k))
        return writer.commit()


def _sglang_records(src: Path, data: dict, out: Path | str, top_k: int | None, ep_size: int, run_id: str | None, world_size: int | None, model: str) -> Path:
    mapping = _tensor(data["last_physical_to_logical_map"], "last_physical_to_logical_map", src, (None, None)).astype(np.int64)
    if 0 in mapping.shape or mapping.max() >= mapping.shape[1]:
        raise TraceError(f"{src}: last_physical_to_logical_map {list(mapping.shape)} maps to logical ids up to {int(mapping.max()) if mapping.size else None}, expected [L, P] with ids in [0, P)")
    if not all(isinstance(r, dict) for r in data["records"]):
        raise TraceError(f"{src}: 'records' must be a list of dicts; not an SGLang expert-distribution dump")
    pass_ids = [_record_int(r, "forward_pass_id", src, i) for i, r in enumerate(data["records"])]
    records = [r for _, r in sorted(zip(pass_ids, data["records"], strict=True), key=lambda item: item[0])]
    per_token = bool(records) and "topk_ids_of_layer" in records[0]
    ranks = {_record_int(r, "rank", src, i) for i, r in enumerate(records)} or {0}
    if len(ranks) > 1:
        raise TraceError(f"{src}: records from several ranks {sorted(ranks)}; SGLang writes one file per rank")
    rank = ranks.pop()
    num_layers, num_physical = mapping.shape
    if per_token:
        widths = [_record_tensor(r, "topk_ids_of_layer", src, i, (num_layers, None, None), negative=True) for i, r in enumerate(records)]
        used = max((int((w >= 0).any(axis=(0, 1)).sum()) for w in widths), default=1)
        k = int(top_k) if top_k else max(used, 1)
        header = _header("per_token", mapping, k, ep_size, np.arange(num_layers), rank, run_id, model, "sglang", world_size)
        with TraceWriter(out, header) as writer:
            totals, invalid, padding, tokens = np.zeros((num_layers, num_physical), np.int64), np.zeros(num_layers, np.int64), np.zeros(num_layers, np.int64), 0
            writer.ensure_empty(Data.TOKENS_TOPK_IDS, (num_layers, k), token_id_dtype(num_physical))
            for record, ids in zip(records, widths, strict=True):
                rows = np.ascontiguousarray(ids.transpose(1, 0, 2)[:, :, :k])  # [T, L, k]
                tokens += len(rows)
                pid = np.full(len(rows), int(record.get("forward_pass_id", 0)), np.int64)
                _append_tokens(writer, rows, pid, np.arange(len(rows)), totals, invalid, padding)
            writer.ensure_empty(Data.TOKENS_PASS_ID, (), np.dtype(np.int64))
            writer.ensure_empty(Data.TOKENS_POSITION, (), np.dtype(np.int32))
            _write_stat(writer, totals, invalid, len(records), tokens, padding)
            return writer.commit()
    k = _need_top_k(top_k, src, "per_pass")
    header = _header("per_pass", mapping, k, ep_size, np.arange(num_layers), rank, run_id, model, "sglang", world_size)
    with TraceWriter(out, header) as writer:
        totals, tokens = np.zeros((num_layers, num_physical), np.int64), 0
        for start in range(0, len(records), _RECORDS_PER_CHUNK):
            part = records[start : start + _RECORDS_PER_CHUNK]
            counts = np.stack([_record_tensor(r, "global_physical_count", src, start + i, (num_layers, num_physical)) for i, r in enumerate(part)]).astype(np.int32)
            per_pass_tokens = -(-counts.sum(axis=2, dtype=np.int64).max(axis=1) // k)  # at least every assignment seen
            tokens += int(per_pass_tokens.sum())
            totals += counts.sum(axis=0)
            n = len(part)
            writer.append(Data.PASSES_PASS_ID, np.array([int(r.get("forward_pass_id", 0)) for r in part], np.int64))
            writer.append(Data.PASSES_TIMESTAMP, np.full(n, math.nan))
            writer.append(Data.PASSES_NUM_TOKENS, per_pass_tokens.astype(np.int64))
            writer.append(Data.PASSES_PHYSICAL_COUNT, counts)
            writer.append(Data.PASSES_INVALID_IDS, np.zeros((n, num_layers), np.int32))
            writer.append(Data.PASSES_SEND_COUNT, np.zeros((n, num_layers, ep_size), np.int32))
            writer.append(Data.PASSES_RECV_COUNT, np.zeros((n, num_layers, ep_size), np.int32))
        _write_stat(writer, totals, np.zeros(num_layers, np.int64), len(records), tokens)
        return writer.commit()


# ----------------------------------------------------------------------------- JSON lines
def _lines(src: Path) -> Iterator[tuple[int, dict]]:
    with src.open("r", encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{src}:{number}: not valid JSON ({exc.msg}); expected one routing record per line") from exc
            if not isinstance(obj, dict) or "layer" not in obj or not isinstance(obj.get("topk_ids"), list):
                raise TraceError(f'{src}:{number}: expected an object with "layer" and a "topk_ids" list')
            yield number, obj


def _group(obj: dict) -> object:
    for key in ("pass_id", "forward_pass_id", "request_id", "rid"):
        if key in obj:
            return obj[key]
    return None


def _scan_jsonl(src: Path) -> tuple[set[int], int, int]:
    """The first read of a JSON-lines routing log: its layer ids, largest expert id and top-k."""
    if not src.is_file():
        raise TraceError(f"{src}: no such file")
    layers: set[int] = set()
    max_id, top_k, count = -1, 1, 0
    for number, obj in _lines(src):
        try:
            ids = [int(x) for x in obj["topk_ids"]]
            layers.add(int(obj["layer"]))
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{src}:{number}: layer and topk_ids must be integers") from exc
        max_id = max([max_id, *ids])
        top_k = max(top_k, len(ids))
        count += 1
    if not count:
        raise TraceError(f"{src}: no routing records")
    return layers, max_id, top_k


def convert_jsonl(src: Path | str, out: Path | str, *, num_experts: int | None = None, run_id: str | None = None, model: str = "", chunk: int = _CHUNK) -> Path:
    """Convert a JSON-lines routing log into a ``per_token`` trace at ``out`` (format in the module docstring).

    Raises:
        TraceError: naming the file and line of the first malformed record.
    """
    src = Path(src)
    layers, max_id, top_k = _scan_jsonl(src)
    experts = int(num_experts) if num_experts else max_id + 1
    if experts < 1:
        raise TraceError(f"{src}: no expert ids >= 0; pass --experts")
    layer_ids = np.array(sorted(layers))
    compact = {int(x): i for i, x in enumerate(layer_ids)}
    num_layers = len(layer_ids)
    mapping = np.tile(np.arange(experts), (num_layers, 1))
    writer = TraceWriter(out, _header("per_token", mapping, top_k, 1, layer_ids, 0, run_id, model, "jsonl"))
    totals, invalid, padding = np.zeros((num_layers, experts), np.int64), np.zeros(num_layers, np.int64), np.zeros(num_layers, np.int64)
    pending: OrderedDict[tuple[object, int], tuple[np.ndarray, int, int]] = OrderedDict()
    flushed: set[tuple[object, int]] = set()
    seen_in_group: dict[tuple[object, int], int] = {}
    pass_index: dict[object, int] = {}
    pass_ids: set[int] = set()
    state = {"tokens": 0}

    def flush(keep: int) -> None:
        rows, pids, positions = [], [], []
        while len(pending) > keep:
            key, (row, pid, pos) = pending.popitem(last=False)
            flushed.add(key)
            rows.append(row)
            pids.append(pid)
            positions.append(pos)
        if rows:
            state["tokens"] += len(rows)
            _append_tokens(writer, np.stack(rows), np.array(pids), np.array(positions), totals, invalid, padding)

    with writer:
        for number, obj in _lines(src):
            group = _group(obj)
            layer = compact[int(obj["layer"])]
            if "position" in obj or "token_index" in obj:
                position = int(obj.get("position", obj.get("token_index")))
            else:
                position = seen_in_group.get((group, layer), 0)
                seen_in_group[(group, layer)] = position + 1
            key = (group, position)
            if key in flushed:
                raise TraceError(f"{src}:{number}: token {key} appears again more than {chunk} tokens after its first line; group the log by pass or token")
            if key not in pending:
                pid = group if isinstance(group, int) else pass_index.setdefault(group, len(pass_index))
                pass_ids.add(int(pid))
                pending[key] = (np.full((num_layers, top_k), -1, np.int64), int(pid), position)
            row = pending[key][0]
            if (row[layer] != -1).any():
                raise TraceError(f"{src}:{number}: token {key} has two records for layer {obj['layer']}")
            ids = [int(x) for x in obj["topk_ids"]]
            row[layer, : len(ids)] = ids
            if len(pending) >= 2 * chunk:
                flush(chunk)
        flush(0)
        writer.ensure_empty(Data.TOKENS_TOPK_IDS, (num_layers, top_k), token_id_dtype(experts))
        writer.ensure_empty(Data.TOKENS_PASS_ID, (), np.dtype(np.int64))
        writer.ensure_empty(Data.TOKENS_POSITION, (), np.dtype(np.int32))
        _write_stat(writer, totals, invalid, len(pass_ids), state["tokens"], padding)
        return writer.commit()


def convert(src: Path | str, out: Path | str, **options: object) -> Path:
    """Convert ``src`` by kind: ``.pt`` = SGLang dump, anything else = JSON-lines log."""
    src = Path(src)
    if src.suffix == ".pt":
        allowed = {k: v for k, v in options.items() if k in ("top_k", "ep_size", "run_id", "world_size", "model")}
        return convert_sglang(src, out, **allowed)  # type: ignore[arg-type]
    allowed = {k: v for k, v in options.items() if k in ("num_experts", "run_id", "model")}
    return convert_jsonl(src, out, **allowed)  # type: ignore[arg-type]


"""OpenTelemetry exporter: observable instruments, lifecycle spans, request-span summaries.

Metrics::

    from moetrace.exporters import otel
    handle = otel.create_otel_instruments(meter_provider=provider)   # or the global provider
    ...
    handle.close()                                       # stop reporting

The instruments live on a meter named ``moetrace``; their names, units (UCUM)
and attributes are :data:`moetrace.exporters.catalog.METRICS`. Their callbacks
read ``recorder.snapshot()``: one snapshot per collection, shared by all
instruments, so the values of one export are consistent with each other.
Counters are cumulative since ``start_record``; a new recording restarts them
from zero, which backends read as a counter reset.

This module uses only the OpenTelemetry API and never installs a global
provider: pass ``meter_provider`` / ``tracer_provider`` or configure the
globals in the application.

Traces: :func:`traced_start_record`, :func:`traced_stop_record` and :func:`traced_dump_record` wrap
the recorder's lifecycle calls in spans (``moetrace.start_record``, ...);
:func:`annotate_routed_experts` attaches a compact summary of one request's
routed experts to a span.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Instrument, MeterProvider, Observation
from opentelemetry.trace import Span, TracerProvider

from moetrace._version import __version__
from moetrace.lazy import renamed_attributes
from moetrace.process_recorder import Recorder, get_recorder
from moetrace.recorder import RecorderStateError
from moetrace.snapshot import RecorderSnapshot

from .catalog import HISTOGRAMS, INFO, histogram_samples, info_labels, samples, selected
from .spec import METER_NAME, MetricSpec, moetrace_meter, otel_instrument

__all__ = [
    "MoetraceInstruments",
    "annotate_routed_experts",
    "create_otel_instruments",
    "traced_dump_record",
    "traced_start_record",
    "traced_stop_record",
]


class _SnapshotPerCollection:
    """Hands every instrument callback of one collection the same snapshot.

    A collection calls each instrument's callback once; when a callback asks
    again, a new collection has begun and a fresh snapshot is taken. This
    holds whatever order the SDK calls instruments in, and for several readers.
    """

    def __init__(self, recorder: Recorder | None) -> None:
        self._recorder = recorder
        self._lock = threading.Lock()
        self._snap: RecorderSnapshot | None = None
        self._served: set[str] = set()

    def get(self, name: str) -> RecorderSnapshot | None:
        with self._lock:
            if self._snap is None or name in self._served:
                recorder = self._recorder if self._recorder is not None else get_recorder()
                try:
                    self._snap = recorder.snapshot()
                except RecorderStateError:  # no recorder configured yet
                    self._snap = None
                self._served = set()
            self._served.add(name)
            return self._snap


@dataclasses.dataclass
class MoetraceInstruments:
    """The observable instruments :func:`instrument` created; :meth:`close` stops their reports."""

    instruments: dict[str, Instrument]
    _closed: threading.Event = dataclasses.field(default_factory=threading.Event)

    def close(self) -> None:
        """Make every callback report nothing from now on (the OTel API cannot remove instruments)."""
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()


def _observations(spec: MetricSpec, snap: RecorderSnapshot) -> Iterator[Observation]:
    for labels, value in samples(spec, snap):
        yield Observation(value, labels)


def create_otel_instruments(meter_provider: MeterProvider | None = None, recorder: Recorder | None = None,
                            per_expert: bool = False, per_ep_rank: bool = False) -> MoetraceInstruments:
    """Create moetrace's observable instruments on the ``moetrace`` meter.

    Args:
        meter_provider: the SDK (or any API) provider to use; ``None`` uses
            the global one (a no-op until the application sets it).
        recorder: the recorder to read; ``None`` looks up
            :func:`moetrace.get_recorder` at each collection. An unconfigured
            recorder reports no data points.
        per_expert: also create ``moetrace.expert.routed_tokens`` (L x E series).
        per_ep_rank: also create the ``[layer, ep_rank]`` instruments (3 x L x R series).

    Returns:
        a :class:`MoetraceInstruments` handle; call ``close()`` to stop reporting.
    """
    meter = moetrace_meter(meter_provider)
    source = _SnapshotPerCollection(recorder)
    handle = MoetraceInstruments({})

    def callback(name: str, produce: Callable[[RecorderSnapshot], Iterable[Observation]]):
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            if handle.closed:
                return []
            snap = source.get(name)
            return [] if snap is None else list(produce(snap))
        return observe

    for spec in selected(per_expert=per_expert, per_ep_rank=per_ep_rank):
        observe = callback(spec.otel_name, lambda snap, spec=spec: _observations(spec, snap))
        _, handle.instruments[spec.otel_name] = otel_instrument(meter, spec, observe)
    for hist in HISTOGRAMS:  # no asynchronous histogram in the OTel API: time and count counters
        for suffix, unit, pick in ((".time", "s", 3), (".count", "{pass}", 2)):
            observe = callback(hist.otel_name + suffix, lambda snap, hist=hist, pick=pick: [Observation(item[pick], item[0]) for item in histogram_samples(hist, snap)])
            name, instrument = otel_instrument(meter, hist, observe, suffix=suffix, unit=unit)
            handle.instruments[name] = instrument
    info = callback(INFO.otel_name, lambda snap: [Observation(1, info_labels(snap))])
    _, handle.instruments[INFO.otel_name] = otel_instrument(meter, INFO, info)
    return handle


# ---------------------------------------------------------------------- lifecycle spans
def _tracer(tracer_provider: TracerProvider | None) -> trace.Tracer:
    return trace.get_tracer(METER_NAME, __version__, tracer_provider=tracer_provider)


def _describe(span: Span, recorder: Recorder) -> None:
    status = recorder.status()
    span.set_attribute("moetrace.mode", str(status["mode"]))
    span.set_attribute("moetrace.recording", bool(status["recording"]))
    span.set_attribute("moetrace.passes", int(status["passes"]))  # type: ignore[call-overload]
    span.set_attribute("moetrace.tokens", int(status["tokens"]))  # type: ignore[call-overload]


def traced_start_record(recorder: Recorder | None = None, tracer_provider: TracerProvider | None = None) -> None:
    """``recorder.start_record()`` inside a ``moetrace.start_record`` span (errors are recorded on the span and re-raised)."""
    recorder = recorder if recorder is not None else get_recorder()
    with _tracer(tracer_provider).start_as_current_span("moetrace.start_record") as span:
        recorder.start_record()
        _describe(span, recorder)


def traced_stop_record(recorder: Recorder | None = None, tracer_provider: TracerProvider | None = None) -> None:
    """``recorder.stop_record()`` inside a ``moetrace.stop_record`` span."""
    recorder = recorder if recorder is not None else get_recorder()
    with _tracer(tracer_provider).start_as_current_span("moetrace.stop_record") as span:
        recorder.stop_record()
        _describe(span, recorder)


def traced_dump_record(recorder: Recorder | None = None, path: str | Path | None = None,
                tracer_provider: TracerProvider | None = None) -> Path:
    """``recorder.dump_record(path)`` inside a ``moetrace.dump_record`` span carrying the written path."""
    recorder = recorder if recorder is not None else get_recorder()
    with _tracer(tracer_provider).start_as_current_span("moetrace.dump_record") as span:
        written = recorder.dump_record(path)
        span.set_attribute("moetrace.dump.path", str(written))
        _describe(span, recorder)
        return written


# ---------------------------------------------------------------------- request spans
def annotate_routed_experts(routed: np.ndarray | Sequence, layer_ids: Sequence[int] | None = None,
                            span: Span | None = None) -> dict[str, object]:
    """Attach a compact summary of one request's routed experts to a span.

    Args:
        routed: ``[tokens, L, k]`` expert ids of one request, as the capturer
            returns them (negative ids: layer not captured / invalid, ignored).
            A torch tensor is copied to the host, so call this after the
            request, not inside the forward.
        layer_ids: model layer id of each of the ``L`` layers (default ``0..L-1``).
        span: the span to annotate; default the current span.

    Sets (and returns) ``moetrace.routed_experts.tokens``, ``.layers`` (layer
    ids), ``.distinct_per_layer`` (distinct experts used in each layer),
    ``.top_expert_per_layer`` (most used expert, -1 when none) and
    ``.distinct_total`` (distinct (layer, expert) pairs).
    """
    array = np.asarray(routed.cpu() if hasattr(routed, "cpu") else routed)
    if array.ndim != 3:
        raise ValueError(f"routed must be [tokens, layers, top_k], got shape {list(array.shape)}")
    num_layers = array.shape[1]
    layers = list(range(num_layers)) if layer_ids is None else [int(i) for i in layer_ids]
    if len(layers) != num_layers:
        raise ValueError(f"layer_ids has {len(layers)} entries but routed has {num_layers} layers")
    distinct, top = [], []
    for layer in range(num_layers):
        ids = array[:, layer, :].reshape(-1)
        ids = ids[ids >= 0]
        values, counts = np.unique(ids, return_counts=True)
        distinct.append(len(values))
        top.append(int(values[np.argmax(counts)]) if len(values) else -1)
    attributes: dict[str, object] = {
        "moetrace.routed_experts.tokens": int(array.shape[0]),
        "moetrace.routed_experts.layers": layers,
        "moetrace.routed_experts.distinct_per_layer": distinct,
        "moetrace.routed_experts.top_expert_per_layer": top,
        "moetrace.routed_experts.distinct_total": int(sum(distinct)),
    }
    (span if span is not None else trace.get_current_span()).set_attributes(attributes)  # type: ignore[arg-type]
    return attributes


__getattr__ = renamed_attributes(__name__, {"instrument": "create_otel_instruments", "start_record": "traced_start_record",
                                            "stop_record": "traced_stop_record", "dump_record": "traced_dump_record"},
                                 globals().__getitem__)

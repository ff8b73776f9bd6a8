"""HDF5 traces: schema v1, atomic writer, reader."""

from .reader import PassChunk, TokenChunk, Trace, Window, open_trace
from .schema import SCHEMA_NAME, SCHEMA_VERSION, TraceError, TraceHeader, TraceWriteError
from .writer import TraceWriter

__all__ = [
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "PassChunk",
    "TokenChunk",
    "Trace",
    "TraceError",
    "TraceHeader",
    "TraceWriteError",
    "TraceWriter",
    "Window",
    "open_trace",
]

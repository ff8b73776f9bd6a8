"""The recorder's rooms: what :class:`moetrace.recorder.ExpertDistributionRecorder` uses and nothing else does.

- :mod:`.accumulators`: the pass counter and one device-side sink per mode;
- :mod:`.session`: a running recording's files (segments, checkpoints, journal) for crash safety;
- :mod:`.dumper`: each mode's cut at a pass boundary, and the ledger of what the dumps did;
- :mod:`.dump`: the dumps' files: the gathers over ranks and the background dump thread;
- :mod:`.timing_state`: a recording's phase-timing clock, aggregates and rows;
- :mod:`.hook_args`: the hooks' argument checks (metadata only, never a tensor's values).

Users import the recorder from :mod:`moetrace.recorder` (or :func:`moetrace.configure`), never from here.
"""

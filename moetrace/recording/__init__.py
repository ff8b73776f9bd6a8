"""The recorder's rooms: what :class:`moetrace.recorder.ExpertDistributionRecorder` uses and nothing else does.

- :mod:`.pass_counter`: what every hook counts (two device ops), and each pass's tokens;
- :mod:`.modes`: one class per mode, owning everything that differs between modes;
- :mod:`.sink`: what a mode keeps of each pass, the interface; :mod:`.window` (``stat``) and
  :mod:`.streams` (``per_pass``, ``per_token``) the sinks;
- :mod:`.session`: a running recording's files (segments, checkpoints, journal) for crash safety;
- :mod:`.dump_cuts`: each mode's cut at a pass boundary, under the recorder's lock, and the ledger of what the dumps did;
- :mod:`.dump_files`: writing the dumps' files: the gathers over ranks and the background dump thread;
- :mod:`.timing_state`: a recording's phase-timing clock, aggregates and rows;
- :mod:`.hook_args`: the hooks' argument checks (metadata only, never a tensor's values).

Users import the recorder from :mod:`moetrace.recorder` (or :func:`moetrace.configure`), never from here.
"""

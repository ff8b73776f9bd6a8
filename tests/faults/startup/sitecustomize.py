"""Start-up hook of the engine processes that fault tests start (``tests/faults/injection.py`` puts this folder on
``PYTHONPATH``): with ``MOETRACE_TEST_FAULT`` set, makes one moetrace step raise, and writes moetrace's warnings to a file.

Engines spawn their worker and scheduler processes (fresh interpreters), so a fault
monkeypatched in the test's process would never reach them; Python imports this
module at every interpreter's start. Without ``MOETRACE_TEST_FAULT`` it does nothing.
"""

import json
import os

_SPEC = os.environ.get("MOETRACE_TEST_FAULT")


def _inject(spec: dict) -> None:
    import builtins
    import importlib
    import logging

    module_name, _, path = spec["target"].partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    error = getattr(builtins, spec.get("error", "RuntimeError"))
    message = f"injected fault in {spec['target']}"
    while_recording = bool(spec.get("while_recording"))

    def fault(*args, **kwargs):
        if not while_recording or getattr(args[0], "recording", False):
            raise error(message)

    setattr(owner, name, fault)
    handler = logging.FileHandler(spec["log"])
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(spec["format"]))
    logger = logging.getLogger("moetrace")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # whatever level the engine sets its root logger to (sglang.Engine: error)


if _SPEC:
    _inject(json.loads(_SPEC))

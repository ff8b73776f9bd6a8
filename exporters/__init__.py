"""Exporters: Prometheus and OpenTelemetry.

``routing`` and ``labels`` are renamed :mod:`~moetrace.exporters.replicas` and
:mod:`~moetrace.exporters.label_load`: ``from moetrace.exporters import routing`` still answers, with a
``DeprecationWarning``, for one release.
"""

import importlib

from moetrace.lazy import renamed_attributes

__getattr__ = renamed_attributes(__name__, {"routing": "replicas", "labels": "label_load"},
                                 lambda module: importlib.import_module(f"{__name__}.{module}"))

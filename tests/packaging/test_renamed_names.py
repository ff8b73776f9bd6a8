"""Renamed public names still answer for one release, each with a ``DeprecationWarning`` that names the new
name, through the module's ``__getattr__`` (``moetrace.lazy.renamed_attributes``): never a silent re-export."""

from __future__ import annotations

import importlib
import warnings

import pytest

# (module, old name, new name): every renamed public name users import (CHANGELOG, issue 49).
RENAMED = [
    ("moetrace.replicas", "RoutingRecorder", "ReplicaRecorder"),
    ("moetrace.replicas", "RoutingSnapshot", "ReplicaSnapshot"),
    ("moetrace.replicas", "RoutingStateError", "ReplicaStateError"),
    ("moetrace.exporters.otel", "instrument", "create_otel_instruments"),
    ("moetrace.exporters.otel", "start_record", "traced_start_record"),
    ("moetrace.exporters.otel", "stop_record", "traced_stop_record"),
    ("moetrace.exporters.otel", "dump_record", "traced_dump_record"),
    ("moetrace.exporters.label_load", "instrument", "create_otel_instruments"),
    ("moetrace.exporters.replicas", "instrument", "create_otel_instruments"),
    ("moetrace.exporters.replicas", "routing_samples", "replica_samples"),
    ("moetrace.exporters.replicas", "ROUTING_METRICS", "REPLICA_METRICS"),
    ("moetrace.exporters.replicas", "ROUTING_HISTOGRAMS", "REPLICA_HISTOGRAMS"),
    ("moetrace.exporters.replicas", "RoutingCollector", "ReplicaCollector"),
    ("moetrace.exporters.replicas", "RoutingInstruments", "ReplicaInstruments"),
]
# Renamed modules users reach as a package attribute (``from moetrace.exporters import routing``).
RENAMED_MODULES = [("moetrace.exporters", "routing", "replicas"), ("moetrace.exporters", "labels", "label_load")]


@pytest.mark.parametrize(("module", "old", "new"), RENAMED + RENAMED_MODULES)
def test_old_name_warns_and_gives_the_new_object(module, old, new):
    package = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is renamed {module}\.{new}"):
        value = getattr(package, old)
    expected = getattr(package, new) if (module, old, new) in RENAMED else importlib.import_module(f"{module}.{new}")
    assert value is expected


@pytest.mark.parametrize(("module", "old", "new"), RENAMED)
def test_old_name_is_not_re_exported(module, old, new):
    package = importlib.import_module(module)
    assert old not in vars(package), f"{module}.{old} is a silent re-export; give it through __getattr__ only"
    assert old not in getattr(package, "__all__", ())


def test_new_names_and_unknown_names_do_not_warn():
    """Negative control: the warning comes from the renamed names only; an unknown name is an AttributeError."""
    otel = importlib.import_module("moetrace.exporters.otel")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert otel.create_otel_instruments is vars(otel)["create_otel_instruments"]
        with pytest.raises(AttributeError, match="has no attribute 'instrumentz'"):
            otel.instrumentz  # noqa: B018

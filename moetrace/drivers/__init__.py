"""Replica drivers: reference engines run behind the request router.

:mod:`moetrace.drivers.live` starts N reference replica processes behind a
:class:`~moetrace.replicas.router.ReplicaRouter`; :mod:`moetrace.drivers.http_replica`
serves one reference replica over HTTP for external routers (``sglang-router``);
:mod:`moetrace.drivers.engine` builds the serving loop both run. This layer sits
above the reference runtime and the replica router it joins; neither imports it.
"""

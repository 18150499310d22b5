"""Internal: what runs a collective on a backend (no public names; use :mod:`moecomm`).

The :class:`~moecomm.engine.engine.Engine` (one per communicator: its backend, staging,
exchange numbering and count checks), the requests it hands out (``requests``), the tag
envelope of host-backend messages (``tags``), the per-peer count checks (``peer_check``),
the supported dtypes (``dtypes``) and host tables on the device (``device_tables``).
Layer: above :mod:`moecomm.backends`, below :mod:`moecomm.collectives`
(docs/architecture.md).
"""

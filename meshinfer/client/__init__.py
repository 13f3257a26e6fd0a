"""Client: the mesh as seen by a person's machine. Discovery and RTT probes, the pure route
planner (``routing``, no torch), conversations over a route with failover, spot-checks and
speculative decoding (``speculative``; a draft model in ``draft``, the one module here that
imports the engine). Imports ``core``, ``wire`` and ``text``; never ``peer`` or ``app``."""

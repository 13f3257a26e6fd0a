"""Peer: one ``meshinfer join`` process. The node (lifecycle, handshake, dispatch), its
conversations and steps, the step scheduler, the verify recomputation and cheap checks, and
metrics. Imports ``core``, ``wire`` and ``engine``; never ``client`` or ``app``."""

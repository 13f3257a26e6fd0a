"""meshinfer: one LLM split by layers across a peer-to-peer mesh."""

__version__ = "0.1.0"

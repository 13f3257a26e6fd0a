"""App: what a person runs. The CLI, one chat reply shared by ``chat`` and ``serve``, the
OpenAI-compatible API with its web page, the mesh view, benchmarks and ``netsim``. Imports
anything; nothing imports ``app``."""

"""Core: what every layer shares and nothing else. Config (``ModelConfig``, ``LayerRange``),
the exception tree, log formats, the torch-free GGUF header, sampling parameters and a
generation's result. Imports nothing from meshinfer outside ``core``."""

"""Engine: the model on one device. Models (pure torch, one file per family), weights
(GGUF, safetensors, the registry, the converted cache), the KV cache, the device executor,
token choice (``sampling``) and the single-process baseline (``generate``). Imports only ``core``."""

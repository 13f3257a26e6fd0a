"""Text: token ids and back. The tokenizer (from GGUF metadata or ``tokenizer.json``), the
chat template and its sandbox, tool-call parsing, streaming detokenization. Imports only ``core``."""

"""Wire: what crosses the network. The message catalogue and its validation (``protocol``,
torch-free), tensor framing (``tensors``), the websocket connection and relay circuits
(``transport``), peer identity, signed adverts and the peer table (``discovery``), TLS.
Imports only ``core``."""

"""Start a peer from a model name or path: what ``meshinfer join`` runs (:func:`launch_peer`)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from meshinfer.core.config import LayerRange
from meshinfer.core.errors import WeightsError
from meshinfer.engine.executor import DeviceExecutor
from meshinfer.peer.limits import ClientLimits
from meshinfer.peer.node import Peer
from meshinfer.peer.settings import PeerSettings
from meshinfer.wire import tls
from meshinfer.wire.discovery import peer_id_of

#: a child of the node's logger: configuring ``meshinfer.peer.node`` configures all of a peer
log = logging.getLogger("meshinfer.peer.node.launch")

__all__ = ["ClientLimits", "PeerSettings", "launch_peer"]  # what ``meshinfer join`` needs


async def launch_peer(model: str, layers: LayerRange | None, *, device: str = "cpu", dtype: str = "f32",
                      settings: PeerSettings | None = None, key_path: str | None = None,
                      threads: int | None = None, warmup: bool = True, home: str | None = None,
                      tls_self_signed: bool = False) -> Peer:
    """Load a shard and start a peer serving it: what ``meshinfer join`` runs.

    Args:
        model: a path or a known model name (pulled if missing).
        layers: the half-open layer range, or None for every layer.
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.
        dtype: a precision name (``meshinfer.core.config.PRECISION_NAMES``: ``f32``, ``bf16``, ``f16``,
            ``q8-bf16``, ``gguf``, ``gguf-a16``, ``gguf-a8``); also the advertised precision. Quantized precisions
            cache their converted tensors under ``<home>/converted``.
        settings: network and budget settings.
        key_path: Ed25519 key file (created on first start); None: an ephemeral key.
        threads: torch CPU threads for the device thread.
        tls_self_signed: serve ``wss://`` with a self-signed certificate kept next to the key
            file (``KEY.tls-cert.pem``, ``KEY.tls-key.pem``; made on first start), or in a
            temporary folder with an ephemeral key. Ignored when ``settings.tls_cert`` is set.

    Raises:
        ModelNotFound, WeightsError, LayerRangeError, DeviceError: bad arguments or files.
    """
    from meshinfer.engine.executor import parse_device
    from meshinfer.engine.generate import check_precision_device, parse_dtype
    from meshinfer.engine.weights.registry import resolve_model

    precision = parse_dtype(dtype)
    check_precision_device(precision, device)
    dev = parse_device(device)
    path = resolve_model(model, home=home)
    executor = DeviceExecutor(dev, threads=threads)
    try:
        shard, bundle, digest = await _load(executor, path, layers, precision, home)
        key = _key(key_path)
        settings = settings or PeerSettings()
        if tls_self_signed and settings.tls_cert is None:
            import tempfile
            stem = key_path or str(Path(tempfile.mkdtemp(prefix="meshinfer-tls-")) / "peer")
            cert, tls_key = tls.self_signed(stem, peer_id_of(key))
            settings = replace(settings, tls_cert=str(cert), tls_key=str(tls_key))
        peer = Peer(shard, executor, key=key, weights_hash=digest, precision=dtype,
                    tokenizer_bundle=bundle, settings=settings)
        peer.owns_executor = True
        await peer.start(warmup=warmup)
        return peer
    except BaseException:
        executor.close()
        raise


async def _load(executor: DeviceExecutor, path: Path, layers: LayerRange | None, precision, home: str | None):
    """(shard, tokenizer bundle or None, weights hash) of ``layers`` of the model at ``path``,
    loaded on ``executor``'s device thread; the first hop's shard comes with the tokenizer.

    The shard is a copy of the file's tensors (``load_shard``): a file changed later reaches no
    step. The hash is taken before the copy and checked after it (a look-up, unless the file's
    size or modification time moved).

    Raises:
        WeightsError: the file changed while it was being loaded.
    """
    from meshinfer.engine.generate import load_shard
    from meshinfer.engine.weights import open_weights
    from meshinfer.engine.weights.identity import weights_hash
    from meshinfer.engine.weights.registry import meshinfer_home
    from meshinfer.text.tokenizer import Tokenizer

    digest = await executor.run(weights_hash, path)  # and again after the copy: it names what was loaded
    src = await executor.run(open_weights, path)
    rng = layers or LayerRange(0, src.config.num_hidden_layers)
    rng.check_within(src.config.num_hidden_layers)
    t0 = time.perf_counter()
    shard = await executor.run(load_shard, src, rng, dtype=precision, device=str(executor.device),
                               cache_dir=meshinfer_home(home) / "converted")
    log.info("loaded layers %s of %s in %.1f s", rng.cli(), path.name, time.perf_counter() - t0)
    bundle = None
    if rng.start == 0:  # the first hop serves the tokenizer to clients
        bundle = (await executor.run(Tokenizer.from_gguf, src)).to_bundle() if path.is_file() \
            else (await executor.run(Tokenizer.from_hf_dir, path)).to_bundle()
    if await executor.run(weights_hash, path) != digest:
        raise WeightsError(f"{path}: the model file changed while this peer loaded it; start the peer again")
    return shard, bundle, digest


def _key(key_path: str | None):
    """The peer's Ed25519 private key: loaded from (or created at) ``key_path``, else a new ephemeral one."""
    if key_path:
        from meshinfer.wire.discovery import load_or_create_key
        return load_or_create_key(key_path)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    return Ed25519PrivateKey.generate()

"""The ``meshinfer`` command line: the only module that prints.

Subcommands: pull, generate, join, chat, serve, status, netsim, bench. Every flag that names a peer list or
a model also reads an environment variable (``MESHINFER_PEERS``, ``MESHINFER_MODEL``).
A user's mistake ends with a one-line ``error: ...`` on stderr and exit status 2.
Every subcommand takes ``--log-format text|json`` (``MESHINFER_LOG_FORMAT``, see :mod:`meshinfer.core.logs`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from urllib.parse import urlsplit
from pathlib import Path

from meshinfer.core.config import PRECISION_NAMES, LayerRange, check_device_args, check_device_spec
from meshinfer.core.errors import ContextOverflow, MeshError
from meshinfer.client.speculative import DEFAULT_DRAFT_TOKENS
from meshinfer.engine.weights.registry import DEFAULT_MODEL

#: ``--draft-tokens`` default with ``--draft-model`` (meshinfer.client.draft.DEFAULT_MODEL_DRAFT_TOKENS).
DEFAULT_MODEL_DRAFT_TOKENS = 16

#: ``--draft-dtype`` default (meshinfer.client.draft.DEFAULT_DRAFT_DTYPE; kept here so --help needs no torch).
DEFAULT_DRAFT_DTYPE = "auto"

#: ``--dtype`` help: every precision is one kernel family (docs/performance.md).
DTYPE_HELP = ("compute precision: f32, bf16, f16 (float weights), q8-bf16 (int8 weights), "
              "gguf, gguf-a16, gguf-a8 (a GGUF file's own blocks; float32, int16, int8 activations); "
              "peers only route with their own precision")

DEFAULT_PEERS = "ws://127.0.0.1:7700"
EXAMPLES = {
    "pull": "examples:\n  meshinfer pull\n  meshinfer pull smollm2-135m-instruct-q4_1",
    "generate": "examples:\n  meshinfer generate -p 'Write a haiku about routers'\n"
                "  meshinfer generate --model smollm2-135m-instruct-q4_1 --messages chat.json --json",
    "join": "examples:\n  meshinfer join --layers 0-11 --listen 0.0.0.0:7700 --tls self-signed\n"
            "  meshinfer join --layers 12-23 --listen 0.0.0.0:7701 --tls self-signed --peers wss://10.0.0.5:7700 "
            "--device cuda\n"
            "  meshinfer join --listen 0.0.0.0:7700 --tls-cert peer.crt --tls-key peer.key\n"
            "  meshinfer join --listen 0.0.0.0:7700 --insecure   # plain ws://, trusted network only",
    "chat": "examples:\n  meshinfer chat --peers ws://127.0.0.1:7700\n"
            "  meshinfer chat --peers wss://10.0.0.5:7700\n"
            "  meshinfer chat -p 'Explain RoPE in one paragraph' --json\n"
            "  meshinfer chat --draft-model ~/models/qwen2.5-0.5b-instruct-q4_k_m.gguf   # a small sibling drafts for a 7B mesh",
    "serve": "examples:\n  meshinfer serve --peers ws://127.0.0.1:7700\n"
             "  meshinfer serve --peers wss://10.0.0.5:7700 --host 0.0.0.0 --port 8000 --api-key-file api.key\n"
             "  # then: OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='unused')",
    "id": "examples:\n  meshinfer id --key ~/.cache/meshinfer/peer-7700.key >> allowed-peers.txt",
    "status": "examples:\n  meshinfer status --peers ws://127.0.0.1:7700\n  meshinfer status --json",
    "netsim": "examples:\n  meshinfer netsim --target 127.0.0.1:7701 --listen 127.0.0.1:7801 --rtt-ms 100\n"
              "  # then start the first peer with --peers ws://127.0.0.1:7801 (or a client with --peers)",
    "bench": "examples:\n  meshinfer bench\n  meshinfer bench --splits 1,2 --max-tokens 64 --out docs/bench.json\n"
             "  meshinfer bench --single --dtypes f32,q8-bf16,gguf,gguf-a16,gguf-a8 --threads 2\n"
             "  meshinfer bench --suite speculative --rtts 0,100 --max-tokens 64\n"
             "  meshinfer bench --suite speculative --rtts 0,100,370 --max-tokens 48 --repeats 1 "
             "--draft-model qwen2.5-coder-0.5b-instruct-q4_k_m --draft-dtype gguf-a16\n"
             "  meshinfer bench --suite ttft --splits 1,2\n"
             "  meshinfer bench --splits 1,2 --concurrency 1,4,16,32 --max-tokens 32",
}


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _env_flag(name: str, default: bool) -> bool:
    """A boolean environment variable: 1/true/yes/on or 0/false/no/off. Raises ValueError otherwise."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    if text.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if text.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"${name}={text!r} is not one of 1/true/yes/on or 0/false/no/off")


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name}={text!r} is not a whole number") from None


def parse_bytes(text: str) -> int:
    """``"2GiB"`` (binary), ``"512MB"`` (decimal), ``"1000000"`` -> bytes.

    Raises:
        ValueError: anything else.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text or "", re.I)
    if not m:
        raise ValueError(f"{text!r} is not a size such as 2GiB or 512MB")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * ((1024 if m.group(3) else 1000) ** power))


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen {text!r} is not HOST:PORT with a port 0-65535 (0: any free port)")
    return host or "127.0.0.1", int(port)


def _peers(text: str | None) -> list[str]:
    """The comma-separated ws:// or wss:// addresses of ``text`` (``--peers``, ``--public-addr``).

    Raises:
        ValueError: an address that is no such URL, has no host, or a port outside 1-65535.
    """
    urls = [u.strip() for u in (text or "").split(",") if u.strip()]
    for u in urls:
        if not re.fullmatch(r"wss?://[^\s/]+(/\S*)?", u):
            raise ValueError(f"peer address {u!r} is not ws://HOST:PORT or wss://HOST:PORT (what a peer's "
                             f"ready: line shows)")
        try:
            port, host = urlsplit(u).port, urlsplit(u).hostname
        except ValueError:  # a port that is no number or past 65535
            port, host = -1, None
        if not host or port is not None and not 1 <= port <= 65535:
            raise ValueError(f"peer address {u!r} has no host or a port outside 1-65535")
        from websockets.exceptions import InvalidURI  # late: the CLI starts without loading websockets
        from websockets.uri import parse_uri

        try:  # what the websocket library and the resolver take (an attack run crashed join with these)
            parse_uri(u)
            host.encode("idna")
        except (ValueError, UnicodeError, InvalidURI) as exc:
            raise ValueError(f"peer address {u!r} is not a valid ws:// or wss:// URL ({exc})") from None
    return urls


def _mesh_key(args) -> bytes | None:
    """The private mesh's key from ``--mesh-key-file``, or None for an open mesh."""
    from meshinfer.wire.discovery import load_mesh_key

    if not args.mesh_key_file:
        return None
    try:
        return load_mesh_key(args.mesh_key_file)
    except OSError as exc:
        raise ValueError(f"--mesh-key-file {args.mesh_key_file}: {exc.strerror or exc}") from exc


def _allow_ids(args) -> frozenset[str] | None:
    """Peer ids from ``--allow-keys``, or None when no list is given."""
    from meshinfer.wire.discovery import load_allowlist

    return load_allowlist(args.allow_keys) if getattr(args, "allow_keys", None) else None


def _audit_options(args) -> dict:
    """MeshClient options from ``--spot-check-rate`` (absent: the library default)."""
    if args.spot_check_rate is None:
        return {}
    if not 0.0 <= args.spot_check_rate <= 1.0:
        raise ValueError(f"--spot-check-rate {args.spot_check_rate} must be within 0..1")
    return {"spot_check_rate": args.spot_check_rate}


def _default_key_path(name: int | str) -> str:
    """``$MESHINFER_HOME/peer-NAME.key``: NAME is the port a peer listens on, or, for a peer that
    does not listen (``--listen none``), ``hidden-FIRST-LAST`` from its layers (all such peers
    of one machine used to share ``peer-0.key``, one identity: the second replaced the first)."""
    return str(Path(_env("MESHINFER_HOME", "~/.cache/meshinfer")).expanduser() / f"peer-{name}.key")


def _warn_plain(urls: list[str], insecure: bool) -> None:
    """One stderr line when ``--insecure`` lets plain ws:// reach another machine."""
    from meshinfer.wire.tls import is_loopback

    plain = [u for u in urls if u.startswith("ws://") and not is_loopback(urlsplit(u).hostname or "")]
    if insecure and plain:
        print(f"warning: plain ws:// to {', '.join(plain)}: prompts and tokens travel unencrypted",
              file=sys.stderr)


def _messages(args) -> list[dict]:
    if getattr(args, "messages", None):
        try:
            data = json.loads(Path(args.messages).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--messages {args.messages}: {exc}") from exc
        if isinstance(data, dict) and "messages" in data:
            data = data["messages"]
        return data
    return _system_turn(args) + [{"role": "user", "content": args.prompt}]


def _system_turn(args) -> list[dict[str, str]]:
    """``--system TEXT`` as a system turn; an explicit empty ``--system ""`` is a turn too (the
    template then leaves out its default system prompt), no ``--system`` is none."""
    system = getattr(args, "system", None)
    return [] if system is None else [{"role": "system", "content": system}]


def _setup_logging(verbose: int, fmt: str = "text") -> None:
    from meshinfer.core.logs import configure

    configure(logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING, fmt)


def _announce(args, message: str) -> None:
    """Print a life-cycle line (``ready: ...``, ``shutting down``) on stdout: as written, or as
    one JSON log object with ``--log-format json`` so that every line of the service parses."""
    if getattr(args, "log_format", "text") == "json":
        from meshinfer.core.logs import JsonFormatter

        record = logging.LogRecord("meshinfer.app.cli", logging.INFO, __file__, 0, message, None, None)
        message = JsonFormatter().format(record)
    print(message, flush=True)


def _stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets (on the running loop), for a clean shutdown."""
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        except NotImplementedError:  # pragma: no cover - Windows
            pass
    return stop


def _run(coro):
    try:
        import uvloop  # noqa: F401
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# --------------------------------------------------------------------------- pull
def cmd_pull(args) -> int:
    from meshinfer.engine.weights.registry import pull

    path = pull(args.name or DEFAULT_MODEL, progress=not args.quiet)
    print(path)
    return 0


# --------------------------------------------------------------------------- generate
def cmd_generate(args) -> int:
    from meshinfer.engine.weights.registry import resolve_model

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    messages = _messages(args)  # a bad --messages file or --model fails before torch loads
    check_device_args(args.dtype, args.device)
    path = resolve_model(args.model)

    import torch

    from meshinfer.engine.executor import parse_device
    from meshinfer.engine.generate import greedy_generate, load_shard, parse_dtype
    from meshinfer.text.stream import StreamDecoder
    from meshinfer.text.tokenizer import Tokenizer
    from meshinfer.engine.weights import open_weights

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    device = parse_device(args.device)
    src = open_weights(path)
    tok = Tokenizer.from_gguf(src) if path.is_file() else Tokenizer.from_hf_dir(path)
    prompt_ids = tok.encode_chat(messages)
    from meshinfer.engine.weights.registry import meshinfer_home
    shard = load_shard(src, dtype=dtype, device=str(device), cache_dir=meshinfer_home() / "converted")
    stream = StreamDecoder(tok)

    def show(token: int) -> None:
        if not args.json:
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()

    if not args.no_warmup:  # a cold model is slow on its first pass; time the steady state
        greedy_generate(shard, prompt_ids[:16], max_tokens=2)
    out = greedy_generate(shard, prompt_ids, max_tokens=args.max_tokens, eos_ids=tok.eos_ids, on_token=show)
    out.text = tok.decode(out.token_ids)
    if args.json:
        print(json.dumps(out.to_dict()))
    else:
        sys.stdout.write(stream.flush() + "\n")
        print(_stats_line(out), file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- join
def _check_port_free(host: str, port: int) -> None:
    """Fail before the (slow) model load when ``--listen`` cannot be bound."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(infos[0][4])
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                         f"(is another peer using it? pick another --listen port)") from None


@dataclass(frozen=True)
class JoinPlan:
    """``join``'s arguments once checked (:func:`check_join_args`), before torch or the weights load.

    ``layers`` is half-open; None with ``auto`` False means every layer of the model."""

    listen: bool
    host: str
    port: int
    layers: LayerRange | None
    auto: bool
    bootstrap: tuple[str, ...]
    public_addrs: tuple[str, ...]
    kv_budget_bytes: int | None
    mesh_key: bytes | None
    allow_ids: frozenset[str] | None


def check_join_args(args) -> JoinPlan:
    """Every check of ``join``'s arguments that needs no weights, run before torch is imported:
    addresses and ports (``--listen``, ``--peers``, ``--public-addr``, ``--metrics-port``, each
    bound once to see that it is free), option combinations, limits, TLS and key files, and
    ``--layers`` against the layer count in the model's GGUF header (torch-free, no tensors read).

    Raises:
        ValueError, MeshError (LayerRangeError, InvalidInput, ModelNotFound, WeightsError): the
            message names the flag; the CLI prints it as one ``error:`` line and exits 2.
    """
    check_device_args(args.dtype, args.device)
    listen, host, port, bootstrap, public = _check_join_addresses(args)
    _check_join_limits(args)
    auto = args.layers == "auto" or (args.layers is None and bool(bootstrap))
    if args.max_layers is not None and not auto:
        raise ValueError("--max-layers goes with --layers auto")
    if args.layers is not None and not args.layers.strip():
        raise ValueError("--layers is empty: give an inclusive range such as 0-11, or auto")
    layers = LayerRange.parse(args.layers) if args.layers and args.layers != "auto" else None
    num_layers = _model_layer_count(args.model)
    if layers is not None and num_layers is not None:
        layers.check_within(num_layers)
    if args.metrics_port:
        _check_port_free(args.metrics_host or host, args.metrics_port)
    return JoinPlan(listen=listen, host=host, port=port, layers=layers, auto=auto, bootstrap=bootstrap,
                    public_addrs=public,
                    kv_budget_bytes=None if args.kv_budget == "auto" else parse_bytes(args.kv_budget),
                    mesh_key=_mesh_key(args), allow_ids=_allow_ids(args))


def _check_join_addresses(args) -> tuple[bool, str, int, tuple[str, ...], tuple[str, ...]]:
    """(listen, host, port, bootstrap urls, public urls) of ``join``, checked: address syntax,
    ``--listen none`` combinations, TLS files, no plain ws:// listener off loopback, a free port."""
    from meshinfer.wire.tls import check_listen, check_plain_url, client_context, server_context

    listen = args.listen.strip().lower() != "none"
    host, port = _listen(args.listen) if listen else ("127.0.0.1", 0)
    bootstrap, public = tuple(_peers(args.peers)), tuple(_peers(args.public_addr))
    if not args.insecure:
        for url in bootstrap:  # a refusal that retrying cannot fix: say it before loading anything
            check_plain_url(url, insecure=False)
    if not listen and not bootstrap:
        raise ValueError("--listen none needs --peers: a peer that does not listen is reached through the "
                         "peers it dials (its relays)")
    if not listen and args.public_addr:
        raise ValueError("--listen none and --public-addr contradict each other: a peer that does not listen "
                         "has no address")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert is not None:
        server_context(args.tls_cert, args.tls_key)
    if args.tls_ca is not None:
        client_context(args.tls_ca)
    if not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port {args.metrics_port} is not a TCP port (0 turns metrics off)")
    if listen:
        check_listen(host, tls=bool(args.tls or args.tls_cert), insecure=args.insecure)
        _check_port_free(host, port)
    return listen, host, port, bootstrap, public


def _check_join_limits(args) -> None:
    """``join``'s numeric limits: layers, batching, connections, threads, idle timeout."""
    if args.max_layers is not None and args.max_layers < 1:
        raise ValueError(f"--max-layers must be at least 1, got {args.max_layers}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be at least 1 (1 turns batching off), got {args.max_batch}")
    if not 0 <= args.batch_wait_ms <= 1000:
        raise ValueError(f"--batch-wait-ms must be 0-1000 (0: never wait), got {args.batch_wait_ms}")
    if args.max_connections_per_host < 1:
        raise ValueError(f"--max-connections-per-host must be at least 1, got {args.max_connections_per_host}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if not args.idle_timeout > 0:
        raise ValueError(f"--idle-timeout must be above 0 seconds, got {args.idle_timeout}")


def _model_layer_count(model: str) -> int | None:
    """The decoder layer count of ``--model`` from its GGUF header (no torch, no tensors), or None
    when it cannot be known before loading: a Hugging Face directory, or a known model not pulled
    yet (join pulls it) or whose file is unreadable (join pulls it again).

    Raises:
        ModelNotFound: ``model`` is neither an existing path nor a known name.
        WeightsError: a GGUF file given by path has no readable header or layer count.
    """
    from meshinfer.core.gguf_header import read_gguf_layer_count
    from meshinfer.engine.weights.registry import KNOWN_MODELS, model_path, resolve_model

    if not Path(model).expanduser().exists() and model in KNOWN_MODELS:
        try:
            return read_gguf_layer_count(model_path(model))
        except (OSError, MeshError):
            return None
    path = resolve_model(model, pull_missing=False)
    return read_gguf_layer_count(path) if path.is_file() else None


async def _join(args, plan: JoinPlan) -> int:
    from meshinfer.peer.launch import ClientLimits, PeerSettings, launch_peer

    settings = PeerSettings(host=plan.host, port=plan.port, public_addrs=plan.public_addrs, listen=plan.listen,
                            bootstrap=plan.bootstrap, kv_budget_bytes=plan.kv_budget_bytes,
                            idle_timeout_s=args.idle_timeout, mesh_key=plan.mesh_key,
                            tls_cert=args.tls_cert, tls_key=args.tls_key, insecure=args.insecure,
                            tls_ca=args.tls_ca, metrics_port=args.metrics_port or None,
                            metrics_host=args.metrics_host or None,
                            allow_ids=plan.allow_ids, max_batch=args.max_batch,
                            max_hold_s=args.batch_wait_ms / 1000,
                            client_limits=ClientLimits(connections=args.max_connections_per_host))
    _warn_plain(list(settings.bootstrap), args.insecure)
    layers = await _auto_layers(args, settings) if plan.auto else plan.layers
    key = args.key or _default_key_path(plan.port if plan.listen else f"hidden-{layers.cli()}")
    peer = await launch_peer(args.model, layers, device=args.device, dtype=args.dtype, settings=settings,
                             key_path=key, threads=args.threads, tls_self_signed=bool(args.tls) and plan.listen)
    stop = _stop_on_signals()
    where = ", ".join(peer.addrs) or "no address (--listen none: reached through the peers it dials)"
    _announce(args, f"ready: peer {peer.peer_id} serving layers {peer.shard.range.cli()} of "
                    f"{peer.cfg.num_hidden_layers} at {where} "
                    f"({peer.executor.device}, {peer.precision}, {peer.compute_ms_per_token:.1f} ms/token)")
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(peer.stopped.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    _announce(args, "shutting down")
    await peer.close()
    return 0


async def _auto_layers(args, settings):
    """The layers ``join --layers auto`` takes: the contiguous range the mesh (reached through
    ``--peers``) serves least, of at most ``--max-layers`` layers, else of as many as fit in
    the device's free memory beside the KV budget (:mod:`meshinfer.client.coverage`). A mesh that
    cannot be reached counts as empty. Announces the choice and the reason."""
    from meshinfer.client.coverage import (WEIGHTS_MEMORY_SHARE, choose_layers, coverage,
        layers_that_fit)
    from meshinfer.engine.executor import parse_device
    from meshinfer.peer.limits import free_memory_bytes
    from meshinfer.client.mesh import MeshClient
    from meshinfer.engine.weights import open_weights
    from meshinfer.engine.weights.identity import weights_hash
    from meshinfer.engine.weights.registry import resolve_model

    path = resolve_model(args.model)
    cfg, digest = open_weights(path).config, weights_hash(path)
    peers = []
    if settings.bootstrap:
        try:
            async with MeshClient(list(settings.bootstrap), mesh_key=settings.mesh_key, insecure=args.insecure,
                                  tls_ca=args.tls_ca, allow_ids=settings.allow_ids) as client:
                peers = await client.refresh()
        except MeshError as exc:
            print(f"warning: cannot read the mesh's coverage through --peers ({exc}); choosing as its first peer",
                  file=sys.stderr)
    same = [p for p in peers if (p.weights_hash, p.precision, p.num_layers) == (digest, args.dtype, cfg.num_hidden_layers)]
    max_layers = args.max_layers or layers_that_fit(
        cfg, args.dtype, int(free_memory_bytes(parse_device(args.device)) * WEIGHTS_MEMORY_SHARE))
    placement = choose_layers(coverage(same, cfg.num_hidden_layers), max_layers)
    _announce(args, placement.reason)
    return placement.layers


def cmd_join(args) -> int:
    plan = check_join_args(args)  # before torch loads: a mistake fails in a fraction of a second
    return _run(_join(args, plan))


# --------------------------------------------------------------------------- chat
def _sampling(args):
    """``--temperature/--top-p/--seed`` as :class:`SamplingParams`, or None for greedy."""
    from meshinfer.core.sampling_params import SamplingParams

    if not args.temperature:
        return None
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=seed)


async def _chat(args) -> int:
    interactive = args.prompt is None and args.messages is None
    messages = [] if interactive else _messages(args)  # bad input fails before the mesh is contacted
    if args.context < 2:
        raise ValueError("--context must be at least 2 tokens")
    args.sampling = _sampling(args)
    spec = _spec(args)  # bad speculation options fail before the mesh is contacted
    _draft_ahead(args)
    if getattr(args, "draft_model", None) and (args.sampling is not None or not spec["speculate"]):
        why = "--temperature above 0 decodes plainly" if args.sampling is not None else "--no-speculate"
        print(f"note: --draft-model {args.draft_model} is not loaded: {why}", file=sys.stderr)
        args.draft_model = None
    _peers(args.peers)
    with _draft_model(args) as draft:  # a missing or corrupt draft model too
        return await _chat_with(args, messages, interactive, draft)


async def _chat_with(args, messages: list[dict], interactive: bool, draft) -> int:
    from meshinfer.app.reply import check_prompt_fits, model_id, one_reply, plan_for, weights_for
    from meshinfer.client.mesh import MeshClient

    _warn_plain(_peers(args.peers), args.insecure)
    async with MeshClient(_peers(args.peers), mesh_key=_mesh_key(args), insecure=args.insecure,
                          tls_ca=args.tls_ca, allow_ids=_allow_ids(args), draft_model=draft,
                          draft_ahead=_draft_ahead(args),
                          **_audit_options(args)) as client:
        # refuses a draft model with another vocabulary
        weights = await weights_for(client, args.model) if args.model else None
        route, tok = await plan_for(client, weights_hash=weights, precision=args.precision)
        if not args.json:
            print(f"route ({model_id(route.compat_key[0])}, {route.compat_key[1]}): {route.describe()}",
                  file=sys.stderr)
        if not interactive:
            check_prompt_fits(tok, messages, context_tokens=client.context_tokens(route), max_tokens=args.max_tokens)
            ids = tok.encode_chat(messages)
            _announce_prefill(len(ids), route, args)
            result = await one_reply(client, route, tok, ids, max_tokens=args.max_tokens,
                                     sampling=args.sampling, on_text=None if args.json else _show,
                                     conversation_options=_spec(args))
            _reply_done(result, args)
            return 0
        await _repl(client, route, tok, args)
    return 0


@contextlib.contextmanager
def _draft_model(args):
    """The :class:`~meshinfer.client.draft.DraftModel` of ``--draft-model`` (None without one), loaded
    before any peer is contacted and closed after.

    Raises:
        ModelNotFound, WeightsError, InvalidInput, DeviceError: see :func:`meshinfer.client.draft.load_draft_model`.
    """
    if not getattr(args, "draft_model", None):
        yield None
        return
    from meshinfer.client.draft import load_draft_model
    from meshinfer.engine.weights.registry import meshinfer_home

    if not getattr(args, "json", False):
        print(f"loading draft model {args.draft_model} ({args.draft_dtype}, {args.draft_device})", file=sys.stderr)
    threads = args.draft_threads  # an int (argparse applies _threads to $MESHINFER_DRAFT_THREADS too) or None
    draft = load_draft_model(args.draft_model, device=args.draft_device, dtype=args.draft_dtype,
                             cache_dir=meshinfer_home() / "converted", threads=threads)
    if not getattr(args, "json", False):
        print(f"draft model {draft.name}: {draft.precision} on {args.draft_device}, "
              f"{threads or 'default'} thread(s), {draft.ms_per_token:.0f} ms per drafted token", file=sys.stderr)
    try:
        yield draft
    finally:
        draft.close()


def _draft_ahead(args) -> bool | str:
    """``--draft-ahead`` as :class:`~meshinfer.client.mesh.MeshClient` takes it: "auto", True or False."""
    value = getattr(args, "draft_ahead", "auto")
    if value not in ("auto", "on", "off"):
        raise ValueError(f"--draft-ahead (or $MESHINFER_DRAFT_AHEAD) must be auto, on or off, got {value!r}")
    return {"on": True, "off": False}.get(value, "auto")


def _spec(args) -> dict:
    """Speculation options of a conversation from ``--speculate``/``--draft-tokens`` (or their env vars)."""
    from meshinfer.client.speculative import MAX_DRAFT_TOKENS

    speculate = _env_flag("MESHINFER_SPECULATE", True) if args.speculate is None else args.speculate
    default = DEFAULT_MODEL_DRAFT_TOKENS if getattr(args, "draft_model", None) else DEFAULT_DRAFT_TOKENS
    k = _env_int("MESHINFER_DRAFT_TOKENS", default) if args.draft_tokens is None else args.draft_tokens
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--draft-tokens must be 1-{MAX_DRAFT_TOKENS}, got {k}")
    return {"speculate": speculate, "draft_tokens": k}


REPL_HELP = ("commands: /help shows this; /reset starts the conversation over; /exit, /quit or Ctrl-D "
             "leaves; Ctrl-C stops a reply. Any other line is sent to the model (start it with // to "
             "send a line that begins with /).")


def _repl_command(line: str | None) -> str | None:
    """What a REPL input line is: ``"exit"``, ``"reset"``, ``"help"``, ``"skip"`` (blank),
    ``"unknown"`` (a ``/word`` that is no command), or None (a message for the model)."""
    if line is None:
        return "exit"
    word = line.strip()
    if not word:
        return "skip"
    if re.fullmatch(r"/[A-Za-z?]+", word):
        return {"/exit": "exit", "/quit": "exit", "/reset": "reset", "/help": "help", "/?": "help"}.get(
            word.lower(), "unknown")
    return None


async def _repl(client, route, tok, args) -> None:
    """Interactive chat: Ctrl-C stops the current reply, Ctrl-D or /exit leaves. A message whose
    chat cannot fit the context (``--context`` or the model's) is refused before it is tokenized."""
    from meshinfer.app.reply import check_prompt_fits

    system = _system_turn(args)
    messages = list(system)
    conv = client.conversation(route, max_tokens_total=args.context, **_spec(args))
    lines = _stdin_lines()
    loop = asyncio.get_running_loop()
    print("meshinfer chat: type a message; /help lists commands; /exit or Ctrl-D leaves", file=sys.stderr)
    try:
        while True:
            _show_prompt()
            line = await lines.get()
            command = _repl_command(line)
            if command == "exit":
                print(file=sys.stderr)
                break
            if command == "reset":
                messages = list(system)
                print("(conversation reset)", file=sys.stderr)
                continue
            if command in ("help", "unknown"):
                print((f"unknown command {line.strip()}; " if command == "unknown" else "") + REPL_HELP,
                      file=sys.stderr)
                continue
            if command == "skip":
                continue
            if line.startswith("//"):
                line = line[1:]
            messages.append({"role": "user", "content": line})
            context = min(args.context, client.context_tokens(route) or args.context)
            try:  # the bound before tokenizing (a pasted megabyte would take seconds), the count after
                check_prompt_fits(tok, messages, max_tokens=args.max_tokens, context_tokens=context)
                prompt_ids = tok.encode_chat(messages)
                if len(prompt_ids) + args.max_tokens > context:
                    raise ContextOverflow(f"the chat is {len(prompt_ids)} tokens; with --max-tokens {args.max_tokens} "
                                          f"it cannot fit the context of {context} tokens")
            except ContextOverflow as exc:
                print(f"error: {exc} (/reset starts over; chat --context N reserves more)", file=sys.stderr)
                messages.pop()
                continue
            reply = asyncio.ensure_future(_reply(conv, tok, prompt_ids, args))
            loop.add_signal_handler(signal.SIGINT, reply.cancel)
            try:
                result = await reply
                messages.append({"role": "assistant", "content": result.text})
            except asyncio.CancelledError:
                print("\n(reply stopped)", file=sys.stderr)
                messages.pop()
            except MeshError as exc:
                print(f"error: {exc}", file=sys.stderr)
                if _outgrew_context(exc, len(prompt_ids), args):
                    print("(type /reset to start over, or start chat with a larger --context)", file=sys.stderr)
                messages.pop()
            finally:
                loop.remove_signal_handler(signal.SIGINT)
    finally:
        await conv.close()


def _outgrew_context(exc: MeshError, n_prompt: int, args) -> bool:
    """Whether ``exc`` says that the REPL's prompt plus ``--max-tokens`` no longer fit the
    ``--context`` tokens its conversation reserved (the conversation's own check, which
    /reset or a larger --context cures), rather than the model's context on a hop."""
    return isinstance(exc, ContextOverflow) and n_prompt + args.max_tokens > args.context


def _show_prompt() -> None:
    """The REPL's ``> `` on stdout, only when stdin is a terminal: with piped input stdout holds
    the replies alone, each ended by a newline."""
    if sys.stdin is not None and sys.stdin.isatty():
        print("> ", end="", flush=True)


def _stdin_lines() -> asyncio.Queue:
    """Lines of stdin (None at end of file), read by a daemon thread so Ctrl-C never waits on it."""
    import threading

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(queue.put_nowait, line.rstrip("\n"))
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=read, name="stdin", daemon=True).start()
    return queue


def _show(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


#: New prompt tokens from which chat says it is reading them (a prefill takes seconds on a CPU).
LONG_PROMPT_TOKENS = 512


def _announce_prefill(new: int, route, args) -> None:
    """Tell the user a long prompt is being read (``new`` tokens the hops do not hold yet, from
    ``LONG_PROMPT_TOKENS`` on)."""
    if new >= LONG_PROMPT_TOKENS and not args.json:
        print(f"(reading {new} prompt tokens through {len(route.hops)} hop(s) before the first token)",
              file=sys.stderr)


async def _reply(conv, tok, prompt_ids, args):
    from meshinfer.app.reply import reply

    _announce_prefill(len(prompt_ids) - conv.reused_prefix(prompt_ids), conv.route, args)
    result = await reply(conv, tok, prompt_ids, max_tokens=args.max_tokens, sampling=args.sampling,
                         on_text=None if args.json else _show)
    if not args.json:
        _reply_done(result, args)
    return result


def _reply_done(result, args) -> None:
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        sys.stdout.write("\n")
        print(_stats_line(result), file=sys.stderr)


def _stats_line(r) -> str:
    n = len(r.token_ids)
    speed = f", {r.decode_tokens_per_s:.1f} tok/s" if n > 1 else ""
    failover = f", {len(r.failovers)} failover(s)" if getattr(r, "failovers", None) else ""
    liars = f", {len(r.detections)} lying peer(s) excluded" if getattr(r, "detections", None) else ""
    unverified = getattr(r, "unverified", None) or []
    notes = "".join(f"; UNVERIFIED: peer {u['peer'][:12]} (layers {u['layers']}): {u['reason']}" for u in unverified)
    spec = getattr(r, "speculative", None) or {}
    model = spec.get("drafter", "").removeprefix("model:") if spec.get("drafter", "").startswith("model:") else None
    drafts = ""
    if spec.get("proposed") or model:
        drafts = f", drafts {spec['accepted']}/{spec['proposed']} accepted" + (f" ({model})" if model else "")
    if model and not spec.get("proposed"):  # say why, or it looks broken (a new user's check)
        drafts += ": drafting measured no gain on this route (the draft policy, docs/architecture.md)"
    return (f"[{n} token{'s' if n != 1 else ''}, TTFT {r.ttft_ms:.0f} ms{speed}{drafts}{failover}{liars}, "
            f"finish: {r.finish_reason}{notes}]")


def cmd_chat(args) -> int:
    return _run(_chat(args))


# --------------------------------------------------------------------------- serve
async def _serve(args) -> int:
    from meshinfer.wire.tls import is_loopback

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a TCP port")
    if args.default_max_tokens < 1:
        raise ValueError("--default-max-tokens must be at least 1")
    if args.max_requests_per_client < 0:
        raise ValueError(f"--max-requests-per-client must be 0 (no limit) or more, got {args.max_requests_per_client}")
    if args.max_connections_per_client < 0:
        raise ValueError(f"--max-connections-per-client must be 0 (no limit) or more, got "
                         f"{args.max_connections_per_client}")
    api_key = None
    if args.api_key_file:
        try:
            api_key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file {args.api_key_file}: {exc.strerror or exc}") from exc
        if not api_key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
    _warn_plain(_peers(args.peers), args.insecure)
    if not is_loopback(args.host) and api_key is None:
        print(f"warning: serving on {args.host} without --api-key-file: anyone who reaches it can use the mesh",
              file=sys.stderr)
    with _draft_model(args) as draft:
        return await _serve_with(args, api_key, draft)


async def _serve_with(args, api_key: str | None, draft) -> int:
    from meshinfer.app.api import ApiServer
    from meshinfer.core.errors import PeerUnavailable
    from meshinfer.client.mesh import MeshClient

    async with MeshClient(_peers(args.peers), mesh_key=_mesh_key(args), insecure=args.insecure,
                          tls_ca=args.tls_ca, allow_ids=_allow_ids(args), draft_model=draft,
                          draft_ahead=_draft_ahead(args),
                          **_audit_options(args)) as client:
        server = ApiServer(client, host=args.host, port=args.port, api_key=api_key,
                           default_max_tokens=args.default_max_tokens,
                           max_requests_per_client=args.max_requests_per_client,
                           max_connections_per_client=args.max_connections_per_client)
        try:
            await server.start()
        except OSError as exc:
            raise ValueError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
        try:
            models = ", ".join(m["id"] for m in await server.models.models()) or "none yet"
        except PeerUnavailable as exc:  # peers may start after the API: requests get 503 until then
            print(f"warning: {exc}; answering 503 until a peer does", file=sys.stderr)
            models = "none yet"
        _announce(args, f"ready: OpenAI-compatible API at {server.url} (models: {models})")
        _announce(args, f"page: open http://{server.host}:{server.port}/ in a browser (chat and a live map of the mesh)")
        stop = _stop_on_signals()
        await stop.wait()
        _announce(args, "shutting down")
        await server.close()
    return 0


def cmd_serve(args) -> int:
    return _run(_serve(args))


# --------------------------------------------------------------------------- id
def cmd_id(args) -> int:
    """Print the peer id and public key of a key file (what goes in others' --allow-keys)."""
    from meshinfer.wire.discovery import load_or_create_key, peer_id_of, public_key_hex

    path = args.key or _default_key_path(7700)
    if not Path(path).expanduser().exists() and not args.create:
        raise ValueError(f"no key at {path}: pass --key FILE (join creates it on first start), or --create")
    key = load_or_create_key(path)
    if args.json:
        print(json.dumps({"peer_id": peer_id_of(key), "public_key": public_key_hex(key), "key_file": path}))
    else:
        print(f"{peer_id_of(key)}  # peer id of {path}; public key {public_key_hex(key)}")
    return 0


# --------------------------------------------------------------------------- status
async def _status(args) -> int:
    from meshinfer.app.meshview import group_json
    from meshinfer.client.routing import complete_routes_summary, precision_note
    from meshinfer.client.mesh import MeshClient

    _warn_plain(_peers(args.peers), args.insecure)
    async with MeshClient(_peers(args.peers), mesh_key=_mesh_key(args), insecure=args.insecure,
                          tls_ca=args.tls_ca, allow_ids=_allow_ids(args)) as client:
        peers = await client.refresh()
        rtts = await client.measure_rtts()
        groups = complete_routes_summary(peers, client_rtts_ms=rtts,  # as chat plans: reachable peers only
                                         exclude=frozenset(p.peer_id for p in peers if p.peer_id not in rtts))
        code = 1 if args.require_route and not any(g.route for g in groups) else 0
        if args.json:
            print(json.dumps({"peers": [dict(p.to_wire(), layers_inclusive=p.layers.cli(), rtt_ms=rtts.get(p.peer_id))
                                        for p in peers],
                              "routes": [group_json(g, peers) for g in groups]}))
            return code
        rows = [("PEER", "ADDRESS", "LAYERS", "DEVICE", "PREC", "WEIGHTS", "STATE", "RTT ms", "FREE KV tokens")]
        for p in sorted(peers, key=lambda p: (p.layers.start, p.peer_id)):
            rtt = rtts.get(p.peer_id)
            rows.append((p.peer_id[:12], _address(p), p.layers.cli(), p.device, p.precision,
                         p.weights_hash[:12], p.state, f"{rtt:.1f}" if rtt is not None else "unreachable",
                         str(p.free_kv_tokens)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        print()
        for g in groups:
            print(_group_line(g))
            print(f"  coverage {_coverage_line(peers, g)}")
        note = precision_note(groups)
        if note and any(g.route is None for g in groups):
            print(note.strip(" ()"))
        if client.not_allowed:
            print(f"({len(client.not_allowed)} more peer(s) in the mesh are not in --allow-keys)")
    return code


def _address(p) -> str:
    """The first address of ``p``, or for a peer reached through relays ``relayed via ID[,ID]``."""
    if p.relays and not p.addrs:
        return "relayed via " + ",".join(r[:12] for r in p.relays)
    if p.relays:
        return f"{p.addrs[0]} (unreachable; relayed via {','.join(r[:12] for r in p.relays)})"
    return (p.addrs or ("-",))[0]


def _coverage_line(peers, g) -> str:
    """``"layers 0-23 |111111111111............| (. = no peer)"``: peers of group ``g`` serving each layer."""
    from meshinfer.client.coverage import coverage, coverage_strip

    L = g.compat_key[3]
    strip = coverage_strip(coverage([p for p in peers if p.compat_key == g.compat_key], L))
    return f"layers 0-{L - 1} |{strip}| (peers per layer; . = none)"


def _group_line(g) -> str:
    if g.route is not None:
        return f"complete route ({g.identity}): {g.route.describe()}"
    return (f"no complete route ({g.identity}): layers {', '.join(r.cli() for r in g.missing)} have no usable "
            f"peer of this identity")


def cmd_status(args) -> int:
    return _run(_status(args))


# --------------------------------------------------------------------------- netsim
async def _netsim(args) -> int:
    from meshinfer.app.netsim import NetSim

    host, port = _listen(args.listen)
    target_host, target_port = _listen(args.target)
    rate = parse_bytes(args.bandwidth) if args.bandwidth else None
    sim = await NetSim(target_host, target_port, rtt_ms=args.rtt_ms, bandwidth_bytes_per_s=rate,
                       host=host, port=port).start()
    print(f"netsim: {host}:{sim.port} -> {target_host}:{target_port}, +{args.rtt_ms:g} ms RTT"
          + (f", {rate} bytes/s each way" if rate else ""), flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await sim.close()
    return 0


def _bench_single(args) -> int:
    from meshinfer.app.bench_single import run_single, single_table

    dtypes = args.dtypes.split(",")
    for d in dtypes:
        if d not in PRECISION_NAMES:
            raise ValueError(f"precision {d!r} is not one of {', '.join(PRECISION_NAMES)}")
    rows = run_single(model=args.model, dtypes=dtypes, tokens=args.max_tokens, threads=args.threads,
                      llama_python=args.llama_python, transformers=not args.no_transformers,
                      join_times=not args.no_join, device=args.device,
                      progress=lambda line: print(line, file=sys.stderr))
    print(single_table(rows, tokens=args.max_tokens, threads=args.threads))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


def cmd_netsim(args) -> int:
    return _run(_netsim(args))


# --------------------------------------------------------------------------- bench
def cmd_bench(args) -> int:
    from meshinfer.app import bench

    if args.max_tokens is None:
        # --single measures fidelity on 8 prompts x 64 greedy tokens (issue 13) with the same count.
        args.max_tokens = 64 if args.single else 32
    if args.single:
        check_device_spec(args.device)
        return _bench_single(args)
    check_device_args(args.dtype, args.device)  # before any peer starts: a CPU-only precision on a GPU
    os.environ["MESHINFER_DEVICE"] = args.device  # the peers' `join --device` default

    splits = [int(x) for x in args.splits.split(",")]
    if args.concurrency:
        counts = [int(x) for x in args.concurrency.split(",")]
        if min(counts) < 1:
            raise ValueError(f"--concurrency takes conversation counts of at least 1, got {args.concurrency}")
        header, results = bench.run_concurrency_bench(model=args.model, splits=splits, concurrency=counts,
                                                      max_tokens=args.max_tokens, dtype=args.dtype,
                                                      base_port=args.base_port,
                                                      progress=lambda line: print(line, file=sys.stderr))
        print(header, bench.concurrency_table(results), sep="\n\n")
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        return 0
    suites = [x.strip() for x in args.suite.split(",") if x.strip()]
    unknown = sorted(set(suites) - {"splits", "speculative", "ttft"})
    if unknown or not suites:
        raise ValueError(f"--suite {args.suite!r}: choose from splits, speculative, ttft")
    common = dict(model=args.model, repeats=args.repeats, dtype=args.dtype, base_port=args.base_port,
                  progress=lambda line: print(line, file=sys.stderr))
    out = {}
    for suite in suites:
        if suite == "splits":
            header, rows = bench.run_bench(splits=splits, max_tokens=args.max_tokens, **common)
            table = bench.markdown_table(rows)
        elif suite == "speculative":
            header, rows = bench.run_spec_bench(rtts_ms=[float(x) for x in args.rtts.split(",")],
                                                max_tokens=args.max_tokens, draft_tokens=args.draft_tokens,
                                                prompts=bench.load_prompts(args.prompts) if args.prompts else None,
                                                draft_model=args.draft_model, draft_dtype=args.draft_dtype,
                                                draft_device=args.draft_device, draft_ahead=_draft_ahead(args),
                                                draft_threads=args.draft_threads or 1,
                                                modes=[m.strip() for m in args.modes.split(",") if m.strip()],
                                                **common)
            table = bench.spec_table(rows)
        else:
            header, rows = bench.run_ttft_bench(splits=[n for n in splits if n <= 2] or [1],
                                                long_tokens=args.long_prompt_tokens, **common)
            table = bench.ttft_table(rows)
        print(header, table, sep="\n\n", end="\n\n")
        out[suite] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(out if len(suites) > 1 else out[suites[0]], indent=1))
    return 0


# --------------------------------------------------------------------------- main
class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written; real defaults shown."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


#: Most ``--draft-threads``: torch's thread pool crashed (SIGSEGV) when asked for 100,000.
MAX_DRAFT_THREADS = 256


def _threads(text: str) -> int:
    """``--draft-threads``: a whole number of CPU threads, at least 1 (argparse type)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of threads") from None
    if not 1 <= n <= MAX_DRAFT_THREADS:
        raise argparse.ArgumentTypeError(f"must be 1-{MAX_DRAFT_THREADS}, got {n}")
    return n


def _add_draft_flags(s: argparse.ArgumentParser) -> None:
    """``--draft-model``, ``--draft-device``, ``--draft-dtype`` (chat, serve, bench)."""
    s.add_argument("--draft-model", default=_env("MESHINFER_DRAFT_MODEL"),
                   help="draft each decode step's tokens with this whole model (path or known name) at the "
                        "client, instead of prompt lookup; it must share the mesh model's vocabulary; output "
                        "is unchanged [$MESHINFER_DRAFT_MODEL]")
    s.add_argument("--draft-device", default=_env("MESHINFER_DRAFT_DEVICE", "cpu"),
                   help="device of the draft model: cpu, cuda, cuda:N or mps [$MESHINFER_DRAFT_DEVICE]")
    s.add_argument("--draft-dtype", default=_env("MESHINFER_DRAFT_DTYPE", DEFAULT_DRAFT_DTYPE),
                   choices=("auto", *PRECISION_NAMES),
                   help="precision of the draft model (quantized ones: CPU only); auto: gguf-a16 for a GGUF "
                        "file on a CPU, q8-bf16 for other CPU models, bf16 on a GPU [$MESHINFER_DRAFT_DTYPE]")
    s.add_argument("--draft-threads", type=_threads, default=_env("MESHINFER_DRAFT_THREADS"),
                   help="CPU threads of the draft model (default: torch's, one per core; `bench` uses 1, "
                        "since its peers share the machine) [$MESHINFER_DRAFT_THREADS]")
    s.add_argument("--draft-ahead", default=_env("MESHINFER_DRAFT_AHEAD", "auto"), choices=("auto", "on", "off"),
                   help="draft the next step's tokens while the mesh verifies a step: auto does when the "
                        "route's round trip holds a draft pass (measured 1.03x at 100 ms and 1.16x at 370 ms "
                        "against off, docs/benchmarks.md) [$MESHINFER_DRAFT_AHEAD]")


def _subcommand(sub, name: str, help_text: str, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text, description=help_text, epilog=EXAMPLES[name],
                          formatter_class=_Formatter, parents=parents)


def _shared_flags() -> dict[str, argparse.ArgumentParser]:
    """Parent parsers of the flags several subcommands take, by name; their defaults read the
    environment now. ``log``: every subcommand; ``model``, ``json``: those that load a model or
    print JSON; ``client``: the mesh clients (chat, serve, status); ``trust``: those and join;
    ``spot``: the subcommands that generate through the mesh (chat, serve)."""
    flags = {name: argparse.ArgumentParser(add_help=False)
             for name in ("log", "model", "json", "client", "trust", "spot")}
    flags["log"].add_argument("--log-format", choices=["text", "json"], default=_env("MESHINFER_LOG_FORMAT", "text"),
                              help="log lines on stderr: text, or JSON objects with conv/peer/seq fields "
                                   "[$MESHINFER_LOG_FORMAT]")
    flags["model"].add_argument("--model", default=_env("MESHINFER_MODEL", DEFAULT_MODEL),
                                help="path or known name [$MESHINFER_MODEL]")
    flags["json"].add_argument("--json", action="store_true", help="print one JSON object")
    flags["client"].add_argument("--peers", default=_env("MESHINFER_PEERS", DEFAULT_PEERS),
                                 help="peers to contact [$MESHINFER_PEERS]")
    flags["client"].add_argument("--insecure", action="store_true",
                                 help="allow plain ws:// to other machines (unencrypted)")
    flags["trust"].add_argument("--mesh-key-file", default=_env("MESHINFER_MESH_KEY_FILE"),
                                help="shared key of a private mesh [$MESHINFER_MESH_KEY_FILE]")
    flags["trust"].add_argument("--tls-ca", default=None,
                                help="PEM CA certificates that wss:// peers' certificates must chain to "
                                     "(on top of pinning)")
    flags["trust"].add_argument("--allow-keys", default=_env("MESHINFER_ALLOW_KEYS"),
                                help="file of peer ids or public keys allowed in the mesh, one a line "
                                     "[$MESHINFER_ALLOW_KEYS]")
    flags["spot"].add_argument("--spot-check-rate", type=float, default=None,
                               help="share of decode steps re-run on a second peer with the same layers, besides one "
                                    "check of every hop after each prompt; 0: none (default: 0.05, see "
                                    "docs/security.md)")
    return flags


def build_parser() -> argparse.ArgumentParser:
    """The ``meshinfer`` argument parser, one subparser a subcommand; flag defaults read the
    environment (``MESHINFER_*``) when it is built."""
    p = argparse.ArgumentParser(prog="meshinfer", description="Run one LLM split by layers across a mesh of peers.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging: -v info, -vv debug (join already logs info, so there -v gives debug)")
    sub = p.add_subparsers(dest="command", required=True)
    flags = _shared_flags()
    for add in (_add_pull, _add_generate, _add_join, _add_id, _add_chat, _add_serve, _add_status, _add_netsim,
                _add_bench):
        add(sub, flags)
    return p


def _add_pull(sub, flags: dict[str, argparse.ArgumentParser]) -> None:
    s = _subcommand(sub, "pull", "Download a known model into the cache, verify its sha256, print its path.",
                    [flags["log"]])
    s.add_argument("name", nargs="?", help="model name (default: the project's default model)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_pull)


def _add_generate(sub, flags: dict[str, argparse.ArgumentParser]) -> None:
    s = _subcommand(sub, "generate", "Generate greedily with the whole model in this process (the baseline).",
                    [flags["log"], flags["model"], flags["json"]])
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("-p", "--prompt", help="one user message")
    g.add_argument("--messages", help="JSON file with an OpenAI-style list of {role, content}")
    s.add_argument("--system", help="system message (with -p)")
    s.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    s.add_argument("--dtype", default="f32", choices=PRECISION_NAMES, help=DTYPE_HELP)
    s.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    s.add_argument("--no-warmup", action="store_true", help="time the first (cold) pass too")
    s.set_defaults(func=cmd_generate)


def _add_join(sub, flags: dict[str, argparse.ArgumentParser]) -> None:
    s = _subcommand(sub, "join", "Start a peer serving a layer range of a model.",
                    [flags["log"], flags["model"], flags["trust"]])
    s.add_argument("--layers", default=_env("MESHINFER_LAYERS"),
                   help="inclusive range, e.g. 0-11; auto: the range the mesh (--peers) serves least "
                        "(default: auto with --peers, else all) [$MESHINFER_LAYERS]")
    s.add_argument("--max-layers", type=int, default=None,
                   help="with --layers auto: take at most this many layers (default: as many as fit in "
                        "free memory beside the KV budget)")
    s.add_argument("--device", default=_env("MESHINFER_DEVICE", "cpu"), help="cpu, cuda, cuda:N or mps")
    s.add_argument("--dtype", default=_env("MESHINFER_DTYPE", "f32"), choices=PRECISION_NAMES,
                   help=DTYPE_HELP + " [$MESHINFER_DTYPE]")
    s.add_argument("--listen", default=_env("MESHINFER_LISTEN", "127.0.0.1:7700"),
                   help="HOST:PORT (port 0: any); none: open no socket, only dial --peers and be reached "
                        "through them (behind NAT)")
    s.add_argument("--public-addr", default=_env("MESHINFER_PUBLIC_ADDR"), help="wss://HOST:PORT others dial (ws:// without TLS)")
    s.add_argument("--peers", default=_env("MESHINFER_BOOTSTRAP", _env("MESHINFER_PEERS")),
                   help="bootstrap peers ws://A:P,ws://B:P [$MESHINFER_BOOTSTRAP, else $MESHINFER_PEERS]")
    s.add_argument("--kv-budget", default=_env("MESHINFER_KV_BUDGET", "auto"),
                   help="KV cache memory, e.g. 2GiB; auto: half the memory free at start")
    s.add_argument("--idle-timeout", type=float, default=300.0, help="free idle conversations after S seconds")
    s.add_argument("--max-batch", type=int, default=_env("MESHINFER_MAX_BATCH", "32"),
                   help="most conversations whose decode steps share one forward pass (1: no batching) "
                        "[$MESHINFER_MAX_BATCH]")
    s.add_argument("--batch-wait-ms", type=float, default=_env("MESHINFER_BATCH_WAIT_MS", "50"),
                   help="most a decode pass waits for the steps of conversations known to be coming, so "
                        "they share it; also at most half a recent pass (0: never wait) [$MESHINFER_BATCH_WAIT_MS]")
    s.add_argument("--max-connections-per-host", type=int, default=_env("MESHINFER_MAX_CONNECTIONS_PER_HOST", "256"),
                   help="connections one remote host (an IPv4 address or an IPv6 /64) may hold open to this peer; more get HTTP 503 at the "
                        "upgrade (raise it for many clients behind one NAT) [$MESHINFER_MAX_CONNECTIONS_PER_HOST]")
    s.add_argument("--key", default=_env("MESHINFER_KEY"), help="Ed25519 key file (created if missing)")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    _add_join_tls_flags(s)
    s.set_defaults(func=cmd_join)


def _add_join_tls_flags(s: argparse.ArgumentParser) -> None:
    """join's flags of its TLS certificate, plain websockets and its metrics server."""
    s.add_argument("--tls", choices=["self-signed", "auto"], default=None,
                   help="serve wss:// with a self-signed certificate kept next to --key (auto: the same); "
                        "dialers pin it by peer id")
    s.add_argument("--tls-cert", default=None, help="PEM certificate to serve wss:// with (with --tls-key)")
    s.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    s.add_argument("--insecure", action="store_true",
                   help="allow plain ws:// to or from other machines (unencrypted)")
    s.add_argument("--metrics-port", type=int, default=_env("MESHINFER_METRICS_PORT", "0"),
                   help="serve Prometheus metrics at http://LISTEN-HOST:PORT/metrics; 0: off "
                        "[$MESHINFER_METRICS_PORT]")
    s.add_argument("--metrics-host", default=_env("MESHINFER_METRICS_HOST"),
                   help="address the metrics server listens on (default: the --listen host; 127.0.0.1 keeps "
                        "a public peer's metrics private) [$MESHINFER_METRICS_HOST]")


def _add_id(sub, flags: dict[str, argparse.ArgumentParser]) -> None:
    s = _subcommand(sub, "id", "Print this peer's id and public key (for other peers' --allow-keys files).",
                    [flags["log"], flags["json"]])
    s.add_argument("--key", default=_env("MESHINFER_KEY"),
                   help="Ed25519 key file (default: the one join uses on port 7700) [$MESHINFER_KEY]")
    s.add_argument("--create", action="store_true", help="create the key file if it does not exist")
    s.set_defaults(func=cmd_id)


def _add_chat(sub, flags: dict[str, argparse.ArgumentParser]) -> None:
    s = _subcommand(sub, "chat", "Chat with the model through the mesh (REPL without -p).",
                    [flags["log"], flags["client"], flags["trust"], flags["json"], flags["spot"]])
    g = s.add_mutually_exclusive_group()
    g.add_argument("-p", "--prompt", help="ask one question and exit")
    g.add_argument("--messages", help="JSON file with an OpenAI-style list of {role, content}")
    s.add_argument("--system", help="system message")
    s.add_argument("--max-tokens", type=int, default=512, help="tokens to generate per reply")
    s.add_argument("--context", type=int, default=4096, help="tokens reserved for a REPL conversation")
    s.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=None,
                   help="verify drafts (prompt lookup, or --draft-model's) in each greedy decode step; the "
                        "output is unchanged (default: on) [$MESHINFER_SPECULATE]")
    s.add_argument("--draft-tokens", type=int, default=None,
                   help=f"most drafted tokens per decode step, 1-31 (default: {DEFAULT_DRAFT_TOKENS}; "
                        f"{DEFAULT_MODEL_DRAFT_TOKENS} with --draft-model) "
                        f"[$MESHINFER_DRAFT_TOKENS]")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sample on the last hop")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability")
    s.add_argument("--seed", type=int, default=None, help="seed of sampling (default: random)")
    s.add_argument("--precision", choices=PRECISION_NAMES, default=_env("MESHINFER_PRECISION"),
                   help="use only peers computing at this precision (default: the fastest complete "
                        "route at any) [$MESHINFER_PRECISION]")
    s.add_argument("--model", default=_env("MESHINFER_CHAT_MODEL"),
                   help="use only peers of this model, when the mesh serves several: a known model's name or "
                        "the start of its weights hash (`meshinfer status`, WEIGHTS) (default: the fastest "
                        "complete route of any) [$MESHINFER_CHAT_MODEL]")
    _add_draft_flags(s)
    s.set_defaults(func=cmd_chat)


def _add_serve(sub, flags: dict[str, argparse.ArgumentParser]) -> None:
    s = _subcommand(sub, "serve", "Serve an OpenAI-compatible HTTP API (chat completions, models) over the mesh.",
                    [flags["log"], flags["client"], flags["trust"], flags["spot"]])
    s.add_argument("--host", default=_env("MESHINFER_API_HOST", "127.0.0.1"),
                   help="address to listen on [$MESHINFER_API_HOST]")
    s.add_argument("--port", type=int, default=_env("MESHINFER_API_PORT", "8000"),
                   help="TCP port, 0: any [$MESHINFER_API_PORT]")
    s.add_argument("--api-key-file", default=_env("MESHINFER_API_KEY_FILE"),
                   help="file holding the key clients must send as 'Authorization: Bearer KEY' "
                        "[$MESHINFER_API_KEY_FILE]")
    s.add_argument("--default-max-tokens", type=int, default=512,
                   help="tokens generated when a request sets no max_tokens")
    s.add_argument("--max-requests-per-client", type=int, default=_env("MESHINFER_API_MAX_REQUESTS", "8"),
                   help="chat requests one client host (an IPv4 address or an IPv6 /64) may have in flight, beyond which it gets 429 "
                        "(0: no limit) [$MESHINFER_API_MAX_REQUESTS]")
    s.add_argument("--max-connections-per-client", type=int, default=_env("MESHINFER_API_MAX_CONNECTIONS", "64"),
                   help="connections one client host (an IPv4 address or an IPv6 /64) may hold open; more are answered 503 (0: no limit; "
                        "raise it behind a reverse proxy or a shared NAT) [$MESHINFER_API_MAX_CONNECTIONS]")
    _add_draft_flags(s)
    s.set_defaults(func=cmd_serve)


def _add_status(sub, flags: dict[str, argparse.ArgumentParser]) -> None:
    s = _subcommand(sub, "status", "Show the peer table and which complete routes exist.",
                    [flags["log"], flags["client"], flags["trust"], flags["json"]])
    s.add_argument("--require-route", action="store_true",
                   help="exit with status 1 when no complete route exists (for scripts and health checks)")
    s.set_defaults(func=cmd_status)


def _add_netsim(sub, flags: dict[str, argparse.ArgumentParser]) -> None:
    s = _subcommand(sub, "netsim", "Proxy TCP with added RTT and a bandwidth cap, to rehearse a WAN route.",
                    [flags["log"]])
    s.add_argument("--listen", default="127.0.0.1:7800", help="HOST:PORT to accept on")
    s.add_argument("--target", required=True, help="HOST:PORT to forward to (a peer)")
    s.add_argument("--rtt-ms", type=float, default=100.0, help="round-trip time to add, ms")
    s.add_argument("--bandwidth", help="per-direction cap per connection, bytes/s, e.g. 10MB")
    s.set_defaults(func=cmd_netsim)


def _add_bench(sub, flags: dict[str, argparse.ArgumentParser]) -> None:
    s = _subcommand(sub, "bench", "Benchmark a single peer against 2- and 3-peer splits on loopback.",
                    [flags["log"], flags["model"]])
    s.add_argument("--splits", default="1,2,3", help="peer counts to measure")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="tokens generated per run [32; with --single 64, also the greedy tokens of each "
                        "fidelity prompt]")
    s.add_argument("--repeats", type=int, default=3, help="timed runs per setup, after one warm-up")
    s.add_argument("--dtype", default="f32", choices=PRECISION_NAMES, help=DTYPE_HELP)
    s.add_argument("--base-port", type=int, default=7800, help="first loopback port for the peers")
    s.add_argument("--suite", default="splits",
                   help="comma list of: splits (1/2/3 peers), speculative (plain vs speculative through netsim), "
                        "ttft (join to ready, cold vs steady TTFT, long-prompt TTFT for 1 and 2 peers)")
    s.add_argument("--rtts", default="0,100", help="speculative suite: RTTs to simulate, ms")
    s.add_argument("--draft-tokens", type=int, default=DEFAULT_DRAFT_TOKENS,
                   help="speculative suite: most drafts per step (each step's length is chosen within it)")
    s.add_argument("--prompts", help="speculative suite: JSON file with a list of OpenAI-style message lists "
                                     "(default: 8 built-in general chats); the code edit always runs too")
    s.add_argument("--modes", default="plain,lookup,draft",
                   help="speculative suite: comma list of plain, lookup, draft, draft-serial (the draft model "
                        "without drafting ahead); plain always runs")
    _add_draft_flags(s)
    s.add_argument("--long-prompt-tokens", type=int, default=1000, help="ttft suite: tokens of the long prompt")
    s.add_argument("--concurrency", help="instead: aggregate tok/s of N conversations at once on one route, "
                                         "for each N listed, e.g. 1,4,16,32")
    s.add_argument("--out", help="also write the results as JSON here")
    s.add_argument("--single", action="store_true",
                   help="instead: one machine, whole model, each --dtypes precision vs llama.cpp and transformers: "
                        "decode tok/s (the median of the 8 fidelity chats' decodes, which the engines take turns on; "
                        "--repeats does not apply), vs llama.cpp as the median of the chats' ratios, fidelity "
                        "against f32, TTFT, peak RSS")
    s.add_argument("--dtypes", default="f32,q8-bf16,gguf,gguf-a16,gguf-a8", help="with --single: precisions to measure")
    s.add_argument("--threads", type=int, default=2, help="with --single: CPU threads for every engine")
    s.add_argument("--llama-python", default=None,
                   help="with --single: python with llama_cpp [$MESHINFER_LLAMA_PYTHON, else .venv-llama/bin/python from deploy/install-llama-cpp.sh]")
    s.add_argument("--no-transformers", action="store_true", help="with --single: skip transformers")
    s.add_argument("--device", default=_env("MESHINFER_DEVICE", "cpu"),
                   help="cpu, cuda, cuda:N or mps: the device of the peers the suites start, and with --single of "
                        "meshinfer's --dtypes and transformers (fidelity is always against f32 on the CPU) "
                        "[$MESHINFER_DEVICE]")
    s.add_argument("--no-join", action="store_true", help="with --single: skip the join-to-ready timings")
    s.set_defaults(func=cmd_bench)


#: libgomp's spin count (``GOMP_SPINCOUNT``: iterations a worker thread polls before it
#: sleeps) that :func:`openmp_wait_policy` sets: about 0.06 ms of polling on the 2-core EPYC
#: test machine (a C program's CPU time per idle gap between parallel regions: 0.11 ms with no
#: spin, the wake itself, 0.16 ms at 1000 polls, 0.41 ms at 5000, 1.30 ms at 20000). Measured there, 2026-12-03 (``tests/benchmarks/decode_step.py
#: --dtype gguf-a8 --threads 2``, runs alternated; docs/troubleshooting.md): on a quiet machine a
#: gguf-a8 decode step took 33-37 ms against 42-56 ms with no spin, since a decode step makes
#: about 120 parallel regions and the wake of a sleeping vCPU costs more than the region's work;
#: f32 (fewer, longer regions) 88 against 91 ms. Spinning longer gained nothing more (5000 and
#: 200000 measured the same as 1000).
OPENMP_SPIN_COUNT = "1000"


def openmp_wait_policy(env: MutableMapping[str, str], platform: str = sys.platform) -> None:
    """How OpenMP worker threads wait between parallel regions, set in ``env`` (the process's
    environment, before torch or the kernels load an OpenMP runtime) unless the user chose:
    a short spin, then sleep.

    - GNU OpenMP (libgomp: torch's Linux wheels, the kernels built by gcc): ``GOMP_SPINCOUNT`` =
      :data:`OPENMP_SPIN_COUNT` polls (about 0.06 ms here), with ``OMP_WAIT_POLICY=ACTIVE``.
      The policy matters only for libgomp's *throttled* spin, the one it uses once a process
      holds more OpenMP threads than CPUs, as a peer does (its main thread and its device
      thread each keep a team): 100 polls under PASSIVE, 1,000 under ACTIVE, at most
      ``GOMP_SPINCOUNT`` under both (libgomp's ``env.c``). Under PASSIVE a peer's threads slept
      at nearly every barrier of a step: layers 12-23 of the default model at gguf-a8 took 30-55 ms a
      decode step on a device thread against 23-31 ms under ACTIVE, and a 2-peer loopback split
      decoded at 0.65-0.77x a single peer against 0.84-0.94x (docs/performance.md).
    - LLVM's libomp (torch's macOS wheels) spins for ever under ACTIVE: ``KMP_BLOCKTIME=0``
      there (sleep at once), and on macOS ``OMP_WAIT_POLICY=PASSIVE`` instead of ACTIVE.

    Why not libgomp's default spin (about 11 ms here): several peers often share one machine
    (a local mesh, a test, a bench), and a machine often runs other work; threads that spin for
    long after each region steal the cores another process computes on (a user measured
    generate at 0.6 tok/s with the default spin against 5.5 tok/s sleeping, on a busy 2-core
    machine), while threads that sleep at once wake late for the next region of the same step.

    Nothing is set when ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``KMP_BLOCKTIME`` is already
    set: the user's choice is kept whole."""
    if any(name in env for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")):
        return
    env["OMP_WAIT_POLICY"] = "PASSIVE" if platform == "darwin" else "ACTIVE"
    env["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT
    env["KMP_BLOCKTIME"] = "0"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshinfer`` console script."""
    args = build_parser().parse_args(argv)
    if args.command in ("join", "generate") or getattr(args, "draft_model", None) or args.command == "bench":
        # Peers, a client's draft model (chat, serve) and the bench's client often share one
        # machine. Must be set before torch loads its OpenMP runtime.
        openmp_wait_policy(os.environ)
    _setup_logging(args.verbose + (1 if args.command == "join" else 0), getattr(args, "log_format", "text"))
    if getattr(args, "max_tokens", None) is not None and args.max_tokens < 1:
        print("error: --max-tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (MeshError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}{_hint(args, exc)}", file=sys.stderr)
        if getattr(args, "json", False):  # a script reading stdout gets the error too
            print(json.dumps({"error": {"message": str(exc), "code": getattr(exc, "code", "invalid_input")}}))
        return 2


def _hint(args, exc: BaseException) -> str:
    """What to do next, for the errors a new user meets first ("" for the others)."""
    text = str(exc)
    if text.startswith("no bootstrap peer answered") and getattr(args, "peers", None) == DEFAULT_PEERS:
        return (f" (no --peers given, so {DEFAULT_PEERS} was tried: start a peer with `meshinfer join --model "
                f"FILE` or point --peers at one)")
    if text.startswith("no route:") and "no ready peer" in text and "unreachable" not in text:
        return " (start a peer for the missing layers: `meshinfer join --layers FIRST-LAST --peers ADDRESS`)"
    return ""


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

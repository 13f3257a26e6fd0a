"""TLS for peer links: certificates, SSL contexts, fingerprints and the plain-ws policy.

A peer serves ``wss://`` with a certificate it is given (``--tls-cert/--tls-key``) or a
self-signed one it makes on first start (``--tls self-signed``). Dialers do not check a CA or
a host name; they pin the certificate by peer id instead: the SHA-256 of the certificate the
server presented must equal the ``tls_fingerprint`` in the peer's signed advert, and the
peer's Ed25519 welcome proof covers that fingerprint, so a man in the middle that presents
its own certificate cannot produce a valid welcome. With a CA file (``--tls-ca``) the
certificate must also chain to one of its CAs and name the host dialed. See docs/security.md.

Plain ``ws://`` is allowed on loopback addresses only, unless the caller passes ``insecure``.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import ssl
from pathlib import Path
from urllib.parse import urlsplit

from meshinfer.core.errors import InvalidInput

log = logging.getLogger(__name__)

#: Days a self-signed certificate is valid; pinning, not expiry, is what makes it trusted.
SELF_SIGNED_DAYS = 3650


def is_loopback(host: str) -> bool:
    """True for what ``discovery.host_scope`` calls loopback: loopback IP addresses in any
    spelling (127.0.0.0/8, ::1, ``::ffff:127.0.0.1``, ``0x7f.1``) and the names that mean this
    machine whatever a resolver says (``discovery.LOOPBACK_NAMES``, ``*.localhost``); not the
    unspecified 0.0.0.0 and ::, which a listener binds on every interface."""
    from meshinfer.wire.discovery import host_scope, ip_literal

    return ip_literal(host) not in ("0.0.0.0", "::") and host_scope(host) == "loopback"


def check_plain_url(url: str, *, insecure: bool) -> None:
    """Refuse a plain ``ws://`` URL to a non-loopback host unless ``insecure``.

    Raises:
        InvalidInput: ``url`` is ``ws://`` to another machine and ``insecure`` is False.
    """
    parts = urlsplit(url)
    if parts.scheme != "ws" or is_loopback(parts.hostname or ""):
        return
    if not insecure:
        raise InvalidInput(f"{url} is plain ws:// to another machine: frames would travel unencrypted; "
                           f"use a wss:// peer or pass --insecure")
    log.info("plain ws:// to %s: frames travel unencrypted", url)  # the CLI warns once, at start


def check_listen(host: str, *, tls: bool, insecure: bool) -> None:
    """Refuse to listen without TLS on a non-loopback ``host`` unless ``insecure``.

    Raises:
        InvalidInput: naming the flags that fix it.
    """
    if not tls and not insecure and not is_loopback(host):
        raise InvalidInput(f"refusing to listen on {host} without TLS: pass --tls self-signed "
                           f"(or --tls-cert/--tls-key), or --insecure to serve plain ws://")


def fingerprint(cert_der: bytes) -> str:
    """Hex SHA-256 of a DER certificate (what adverts carry as ``tls_fingerprint``)."""
    return hashlib.sha256(cert_der).hexdigest()


def cert_fingerprint(cert_path: str | os.PathLike) -> str:
    """:func:`fingerprint` of the first certificate of a PEM file."""
    der = ssl.PEM_cert_to_DER_cert(Path(cert_path).read_text())
    return fingerprint(der)


def self_signed(stem: str | os.PathLike, common_name: str) -> tuple[Path, Path]:
    """(cert, key) PEM files ``STEM.tls-cert.pem`` and ``STEM.tls-key.pem``: kept when present,
    else made (the key with mode 0600). ``stem`` is usually the peer's Ed25519 key file.

    The key is ECDSA P-256; the certificate names ``common_name`` (the peer id) and is valid
    for :data:`SELF_SIGNED_DAYS` days.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    base = Path(stem).expanduser()
    cert_path, key_path = Path(f"{base}.tls-cert.pem"), Path(f"{base}.tls-key.pem")
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path
    base.parent.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS)).sign(key, hashes.SHA256()))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def server_context(cert_path: str | os.PathLike, key_path: str | os.PathLike) -> ssl.SSLContext:
    """A server SSL context (TLS 1.2 or newer) serving ``cert_path`` with ``key_path``.

    Raises:
        InvalidInput: the files cannot be read or do not match.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_path, key_path)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidInput(f"cannot load TLS certificate {cert_path} with key {key_path}: {exc}") from exc
    return ctx


def client_context(ca_file: str | os.PathLike | None = None) -> ssl.SSLContext:
    """A client SSL context for dialing ``wss://`` peers.

    Without ``ca_file`` it checks no CA and no host name: the caller must pin the server's
    certificate (:func:`peer_fingerprint`) against the peer's signed fingerprint, which the
    handshake does. With ``ca_file`` the certificate must also chain to one of its CAs and
    name the host dialed (for meshes whose peers hold CA-signed certificates).

    Raises:
        InvalidInput: ``ca_file`` cannot be read.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file is None:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidInput(f"cannot load CA certificates from {ca_file}: {exc}") from exc
    return ctx


def peer_fingerprint(ws) -> str:
    """Hex SHA-256 of the certificate the server of connection ``ws`` presented; "" over plain ws."""
    ssl_object = ws.transport.get_extra_info("ssl_object") if ws.transport is not None else None
    if ssl_object is None:
        return ""
    der = ssl_object.getpeercert(binary_form=True)
    return fingerprint(der) if der else ""

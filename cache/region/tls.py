"""The region's own TLS: a CA and a server certificate made at first start, the swarm
CA that signs peer certificates, and the node token, kept in the region's state folder.

    paths = ensure_region_tls(folder, host, names)   # -> RegionTLS(ca, cert, key)
    token = ensure_node_token(path)
    tokens = NodeTokens(token); tokens.token_for("gpu001"); tokens.identify(presented)
    swarm = PeerCA(folder); cert, ttl = swarm.issue(public_key_pem, torrent_name, node)

Contract:
- `folder` is created 0700; private keys and the token are written 0600, by rename, so a
  crash never leaves half a key. The CA (`ca.pem`, `ca.key`) is made once and kept: nodes
  pin `ca.pem`. The server certificate (`server.pem`, `server.key`) is made again when
  the names it must cover change (its subjectAltNames are recorded in `server.names`).
- Names covered: the listen host (an IP or a DNS name), `names`, and for a wildcard
  listen address (0.0.0.0, ::) this host's name and addresses plus loopback.
- ECDSA P-256 keys; the CA lives 10 years, the server certificate 1 year (made again at
  the start after it has less than 30 days left).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import socket
import ssl
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.errors import ShoalError

if TYPE_CHECKING:  # cryptography is imported where it is used: the region may run without it
    from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes

TOKEN_HEADER = "X-Shoal-Node-Token"  # the region's node token, on swarm calls and bad-bytes reports
BACKGROUND_HEADER = "X-Shoal-Background"  # "1": nobody waits on this blob read now (cache.source.BACKGROUND)
NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")  # a node's name, as Slurm names nodes
NODE_TOKEN_PREFIX = "shoal-node"
ANY_NODE = "*"  # NodeTokens.identify: the shared token, which names no node
_CA_DAYS = 3650
_SERVER_DAYS = 365
_RENEW_DAYS = 30


@dataclass(frozen=True)
class RegionTLS:
    ca: str  # the CA certificate nodes pin ("" for a certificate configured by the operator)
    cert: str
    key: str

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def client_context(ca: str) -> ssl.SSLContext:
    """A client context that trusts only `ca` (or the system store for "")."""
    return ssl.create_default_context(cafile=ca or None)


def names_for(host: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The subjectAltNames a server listening on `host` must carry (see the module doc)."""
    out = [host]
    if host in ("0.0.0.0", "::", ""):
        out = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
        try:
            out += [str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None)]
        except OSError:
            pass
    out += [str(n) for n in extra]
    seen: list[str] = []
    for n in out:
        n = n.strip("[]")
        if n and n not in ("0.0.0.0", "::") and n not in seen:
            seen.append(n)
    return seen


def ensure_region_tls(folder: str, host: str, names: list[str] | tuple[str, ...] = ()) -> RegionTLS:
    """The region's CA and a server certificate for `host` and `names` (see the module doc)."""
    try:
        from cryptography import x509  # noqa: F401
    except ImportError:
        raise ShoalError("the region's own certificate needs the cryptography package: install shoal with "
                         "the node extras (pip install 'shoal[node]'), or configure tls_cert and tls_key") from None
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    ca_pem, ca_key = os.path.join(folder, "ca.pem"), os.path.join(folder, "ca.key")
    cert, key = os.path.join(folder, "server.pem"), os.path.join(folder, "server.key")
    marker = os.path.join(folder, "server.names")
    if not (os.path.exists(ca_pem) and os.path.exists(ca_key)):
        _make_ca(ca_pem, ca_key)
    want = names_for(host, names)
    try:
        with open(marker) as fh:
            have = json.load(fh)
    except (OSError, ValueError):
        have = None
    if have != want or not os.path.exists(cert) or not os.path.exists(key) or _expiring(cert):
        _make_server(ca_pem, ca_key, cert, key, want)
        _write(marker, json.dumps(want).encode(), 0o600)
    return RegionTLS(ca_pem, cert, key)


class PeerCA:
    """The region's swarm CA (`swarm-ca.pem`, `swarm-ca.key` in the state folder, made at
    first start): its certificate goes into every torrent's info dict (`ssl-cert`), and
    issue() signs a peer certificate for one torrent. Peers of an SSL torrent accept
    only each other's certificates signed by it whose subjectAltName is the torrent's
    name (libtorrent checks both), so a certificate for one blob opens no other."""

    def __init__(self, folder: str, ttl: float = 3600.0) -> None:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self.cert_path = os.path.join(folder, "swarm-ca.pem")
        key_path = os.path.join(folder, "swarm-ca.key")
        if not (os.path.exists(self.cert_path) and os.path.exists(key_path)):
            _make_ca(self.cert_path, key_path, "shoal swarm CA")
        from cryptography import x509

        with open(self.cert_path, "rb") as fh:
            self.pem = fh.read()
        self._cert = x509.load_pem_x509_certificate(self.pem)
        self._key = _ca_key(key_path)
        self.ttl = ttl
        self.issued = 0

    def issue(self, public_key_pem: bytes, name: str, subject: str) -> tuple[bytes, float]:
        """(PEM certificate, seconds valid) for the peer key `public_key_pem` in the torrent
        named `name`; `subject` (the node's address) is its common name, for logs.
        ValueError for a key that is not a PEM public key."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, rsa
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = serialization.load_pem_public_key(public_key_pem)
        if not isinstance(key, (ec.EllipticCurvePublicKey, rsa.RSAPublicKey)):
            raise ValueError("want an EC or RSA public key")  # noqa: TRY004 - the caller answers 400 to any bad key
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject[:64] or "peer")]))
                .issuer_name(self._cert.subject).public_key(key)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(seconds=self.ttl))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH,
                                                      ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(self._key, hashes.SHA256()))
        self.issued += 1
        from cryptography.hazmat.primitives.serialization import Encoding

        return cert.public_bytes(Encoding.PEM), self.ttl


def peer_key() -> tuple[bytes, bytes]:
    """A new peer key: (private key PEM, public key PEM)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return _key_pem(key), public


def ensure_node_token(path: str) -> str:
    """The secret nodes present to the region's swarm service: read from `path`, or made
    (32 random bytes, hex) and written there 0600 at first start."""
    try:
        with open(path) as fh:
            token = fh.read().strip()
    except FileNotFoundError:
        token = ""
    except OSError as exc:
        raise ShoalError(f"node token {path}: {exc.strerror or exc}") from None
    if token:
        return token
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    token = secrets.token_hex(32)
    _write(path, (token + "\n").encode(), 0o600)
    return token


class NodeTokens:
    """Who presents a node token. The region's node secret (`[nodes] token_file`) is the
    key of every node's own token, `shoal-node:NAME:HEX`, HEX = HMAC-SHA256(secret, NAME)
    (`token_for`, what `shoal region --node-token NAME` prints): it proves NAME, so a
    node cannot speak for another (register, poll or report under its name), and one name
    can be revoked (`revoked`) without touching the others. The secret itself is the
    shared token: given to every node (one Kubernetes Secret for a DaemonSet), it proves
    only that the caller is one of the region's nodes; `shared=False` refuses it.

    identify(presented) -> NAME, ANY_NODE (the shared token, or no secret set: none
    asked), or None (refused). Comparisons are constant-time; pure, thread-safe."""

    def __init__(self, secret: str, shared: bool = True, revoked: list[str] | tuple[str, ...] = ()) -> None:
        self.secret = secret
        self.shared = shared
        self.revoked = frozenset(revoked)

    def token_for(self, name: str) -> str:
        if not NODE_NAME_RE.match(name):
            raise ShoalError(f"{name[:80]!r} is not a node name (letters, digits, '.', '_', '-')")
        if not self.secret:
            raise ShoalError("the region has no node secret to make node tokens from")
        return f"{NODE_TOKEN_PREFIX}:{name}:{self._mac(name)}"

    def _mac(self, name: str) -> str:
        return hmac.new(self.secret.encode(), b"shoal node token\0" + name.encode(), hashlib.sha256).hexdigest()

    def identify(self, presented: str) -> str | None:
        if not self.secret:
            return ANY_NODE
        if presented.startswith(NODE_TOKEN_PREFIX + ":"):
            name, _, mac = presented[len(NODE_TOKEN_PREFIX) + 1:].rpartition(":")
            if not NODE_NAME_RE.match(name) or name in self.revoked:
                return None
            return name if hmac.compare_digest(mac.encode(), self._mac(name).encode()) else None
        if self.shared and hmac.compare_digest(presented.encode(), self.secret.encode()):
            return ANY_NODE
        return None


def read_token(path: str) -> str:
    """A node's copy of the region's token (one line), or ShoalError naming the file."""
    try:
        with open(path) as fh:
            token = fh.read().strip()
    except OSError as exc:
        raise ShoalError(f"region token file {path}: {exc.strerror or exc}") from None
    if not token:
        raise ShoalError(f"region token file {path} is empty")
    return token


def _write(path: str, data: bytes, mode: int) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _make_ca(ca_pem: str, ca_key: str, title: str = "shoal region CA") -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{title} {socket.gethostname()}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=_CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write(ca_key, _key_pem(key), 0o600)
    _write(ca_pem, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _make_server(ca_pem: str, ca_key: str, cert_path: str, key_path: str, names: list[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    with open(ca_pem, "rb") as fh:
        ca = x509.load_pem_x509_certificate(fh.read())
    ca_private = _ca_key(ca_key)
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0] if names else "shoal region")]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=_SERVER_DAYS))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_private.public_key()),
                           critical=False)
            .sign(ca_private, hashes.SHA256()))
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _ca_key(path: str) -> CertificateIssuerPrivateKeyTypes:
    """The CA's private key in `path` (PEM): EC, RSA, Ed25519 or Ed448 (DSA, which
    cryptography deprecates and TLS 1.3 does not sign with, is refused)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
    from cryptography.utils import CryptographyDeprecationWarning

    with open(path, "rb") as fh, warnings.catch_warnings():
        # (loading a DSA key warns of DSA's deprecation: it is refused below, in one line)
        warnings.simplefilter("ignore", CryptographyDeprecationWarning)
        key = serialization.load_pem_private_key(fh.read(), None)
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey, ed25519.Ed25519PrivateKey,
                            ed448.Ed448PrivateKey)):
        raise ShoalError(f"{path}: a {type(key).__name__.lstrip('_')} cannot be the region's CA key "
                         "(EC, RSA, Ed25519 or Ed448)")
    return key


def _expiring(cert_path: str) -> bool:
    from cryptography import x509

    try:
        with open(cert_path, "rb") as fh:
            cert = x509.load_pem_x509_certificate(fh.read())
    except (OSError, ValueError):
        return True
    left = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    return left < datetime.timedelta(days=_RENEW_DAYS)

"""TLS at the balancer's edge: the certificate and key HAProxy presents, checked on the
controller before anything reaches a host.

Either the operator's own pair (``invoke lb --cert F --key F``: PEM files on the controller), or,
when none is given, a self-signed pair made here with ``cryptography`` and kept in the
controller's cache (``<cache>/lb/<balancer host>/``: ``cert.pem``, ``key.pem`` 0600), reused on
every later run so clients keep trusting it. The self-signed certificate is its own CA: give
``cert.pem`` to a client (``curl --cacert``, ``httpx.Client(verify=...)``, the ``openai`` client's
``http_client``) and compare the SHA-256 fingerprint `invoke lb` prints. `bench --lb` uses it.

On the host the pair is one PEM (certificate, then key), root-only, handed to HAProxy like the
API key: a systemd credential, or a 0600 copy a managed process reads.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from playbooks.errors import VoltaforgeError

#: the self-signed certificate's life (a client that pins it re-trusts a new one after)
SELF_SIGNED_DAYS = 825


@dataclass(frozen=True)
class TlsPair:
    cert_pem: bytes
    key_pem: bytes
    origin: str  # where it came from, for messages ("self-signed, kept in ...", the files given)

    @property
    def pem(self) -> bytes:
        """What HAProxy's ``crt`` reads: the certificate, then its key."""
        return self.cert_pem.rstrip(b"\n") + b"\n" + self.key_pem.rstrip(b"\n") + b"\n"

    @property
    def fingerprint(self) -> str:
        cert = x509.load_pem_x509_certificate(self.cert_pem)
        return "SHA256:" + cert.fingerprint(hashes.SHA256()).hex(":").upper()


def _names(names: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for n in dict.fromkeys(names):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return out


def self_signed(names: list[str], now: datetime.datetime | None = None, days: int = SELF_SIGNED_DAYS) -> TlsPair:
    """A self-signed certificate (its own CA) for ``names`` (host names and addresses), with a
    P-256 key."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(_names(names)), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return TlsPair(cert.public_bytes(serialization.Encoding.PEM), key_pem, "self-signed")


def problem(pair: TlsPair, now: datetime.datetime | None = None) -> str | None:
    """Why HAProxy should not present this pair (one clause), or None."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    try:
        cert = x509.load_pem_x509_certificate(pair.cert_pem)
    except ValueError:
        return "the certificate is not a PEM certificate"
    try:
        key = serialization.load_pem_private_key(pair.key_pem, None)
    except (ValueError, TypeError):
        return "the key is not an unencrypted PEM private key"
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.PEM, pub) != cert.public_key().public_bytes(
        serialization.Encoding.PEM, pub
    ):
        return "the key does not match the certificate"
    if cert.not_valid_after_utc <= now:
        return f"the certificate expired on {cert.not_valid_after_utc:%Y-%m-%d}"
    if cert.not_valid_before_utc > now:
        return f"the certificate is not valid before {cert.not_valid_before_utc:%Y-%m-%d}"
    return None


def given_pair(cert: Path, key: Path) -> TlsPair:
    """The operator's own certificate and key, checked: one line naming the file otherwise."""
    try:
        pair = TlsPair(cert.read_bytes(), key.read_bytes(), f"{cert} and {key}")
    except OSError as exc:
        raise VoltaforgeError(f"--cert/--key: cannot read {exc.filename}: {exc.strerror}") from None
    why = problem(pair)
    if why:
        raise VoltaforgeError(f"--cert {cert} --key {key}: {why}")
    return pair


def kept_pair(where: Path, names: list[str]) -> TlsPair:
    """The balancer's self-signed pair kept on the controller at ``where``: reused while it is
    valid and covers ``names``, else made anew (key file 0600)."""
    cert_file, key_file = where / "cert.pem", where / "key.pem"
    if cert_file.exists() and key_file.exists():
        pair = TlsPair(cert_file.read_bytes(), key_file.read_bytes(), f"self-signed, kept in {where}")
        covered = {str(n.value) for n in _san(pair)}
        if problem(pair) is None and set(names) <= covered:
            return pair
    pair = self_signed(names)
    where.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pair.key_pem)
    cert_file.write_bytes(pair.cert_pem)
    return TlsPair(pair.cert_pem, pair.key_pem, f"self-signed, kept in {where}")


def _san(pair: TlsPair) -> list[x509.GeneralName]:
    cert = x509.load_pem_x509_certificate(pair.cert_pem)
    try:
        return list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        return []

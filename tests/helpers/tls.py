"""Certificates made in a test (cryptography): a CA, server and client certificates it signs,
written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    cert: Path
    key: Path
    serial: int


def _write(folder: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
           ) -> Issued:
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Issued(cert_path, key_path, cert.serial_number)


def _builder(common_name: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _sans(hosts: tuple[str, ...]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


class CA:
    """A certificate authority for one test."""

    def __init__(self, folder: Path, name: str = "test-ca") -> None:
        self.folder = folder
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (_builder(name, self.name, self.key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        self.issued = _write(folder, name, cert, self.key)
        self.cert = self.issued.cert

    def issue(self, name: str, *, client: bool = False,
              hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Issued:
        """A server certificate for `hosts` (or a client certificate) signed by this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = (_builder(name, self.name, key.public_key())
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if not client:
            builder = builder.add_extension(_sans(hosts), critical=False)
        return _write(self.folder, name, builder.sign(self.key, hashes.SHA256()), key)


def self_signed(folder: Path, name: str = "server",
                hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Issued:
    """A self-signed server certificate (its own CA: pass `cert` as the client's CA file)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(name, subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_sans(hosts), critical=False)
            .sign(key, hashes.SHA256()))
    return _write(folder, name, cert, key)

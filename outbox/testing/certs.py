"""A throw-away certificate authority for a test cluster's TLS listeners, made with `cryptography`.

`make_certificates(directory)` writes, in PEM (which Kafka and librdkafka read directly):

- ``ca.pem``: the authority's certificate, the trust store of brokers and clients;
- ``broker.pem``: the brokers' private key (PKCS#8, unencrypted) and certificate, for
  ``127.0.0.1`` and ``localhost``, signed by the authority (Kafka's PEM key store: key then chain);
- ``client.key`` and ``client.pem``: a client's key and certificate (CN ``client``), for mutual TLS;
- ``stranger.key`` and ``stranger.pem``: a certificate of another authority, which the brokers
  reject (a certificate the broker does not trust).

Valid for a day: a test cluster lives minutes. Needs the ``cryptography`` package.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
except ImportError as exc:  # the test bed's TLS needs it; a PLAINTEXT or SASL_PLAINTEXT cluster does not
    raise ImportError("a TLS test cluster needs the cryptography package: pip install cryptography") from exc


@dataclass(frozen=True)
class Certificates:
    """Where `make_certificates` wrote each file."""

    ca: Path
    broker: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path


def make_certificates(directory: Path) -> Certificates:
    """Write a new authority, the brokers' and a client's certificates into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _authority("kafka-outbox test CA")
    broker_key = _key()
    broker_cert = _signed(
        broker_key, "broker", ca_key, ca_cert.subject,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client_key = _key()
    client_cert = _signed(client_key, "client", ca_key, ca_cert.subject, [x509.DNSName("client")])
    other_key, other_ca = _authority("another CA")
    stranger_key = _key()
    stranger_cert = _signed(stranger_key, "stranger", other_key, other_ca.subject, [x509.DNSName("stranger")])
    files = Certificates(
        ca=directory / "ca.pem", broker=directory / "broker.pem", client_cert=directory / "client.pem",
        client_key=directory / "client.key", stranger_cert=directory / "stranger.pem",
        stranger_key=directory / "stranger.key",
    )
    files.ca.write_bytes(_pem(ca_cert))
    files.broker.write_bytes(_pem_key(broker_key) + _pem(broker_cert) + _pem(ca_cert))
    files.client_cert.write_bytes(_pem(client_cert))
    files.client_key.write_bytes(_pem_key(client_key))
    files.stranger_cert.write_bytes(_pem(stranger_cert))
    files.stranger_key.write_bytes(_pem_key(stranger_key))
    return files


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _authority(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _key()
    name = _name(common_name)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _signed(
    key: ec.EllipticCurvePrivateKey, common_name: str, ca_key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
    names: list[x509.GeneralName],
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(common_name)).issuer_name(issuer).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )

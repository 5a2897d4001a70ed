"""The sandbox's own TLS certificate: why its API is served over HTTPS at all.

A client of a real cluster sends its kubeconfig's credentials only over TLS: kubectl (client-go's
clientcmd) leaves a kubeconfig user's token out of every request to an `http://` server. A sandbox that
asks each request for its token (`Sandbox(require_token=True)`, what `olmo-ctl sandbox` serves) so
serves HTTPS, with a certificate it makes when it starts: self-signed, for the addresses it answers on
(127.0.0.1, ::1, localhost), its key never written anywhere but a private temporary directory for the
moment it is loaded. The kubeconfig carries the certificate as `certificate-authority-data`, so
kubectl, the `kubernetes` client and `sandbox fault` verify that they talk to this sandbox.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import ssl
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

VALID_DAYS = 365  # a new certificate each start: longer than any sandbox runs


def self_signed() -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) of a new self-signed certificate for the loopback addresses,
    usable as its own certificate authority."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "olmo-ctl sandbox")])
    now = datetime.now(UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=VALID_DAYS))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1")),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def server_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """The server side: TLS 1.2 or later with this certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="olmo-ctl-sandbox-tls-") as d:  # mode 0700
        cert, key = Path(d) / "tls.crt", Path(d) / "tls.key"
        cert.write_bytes(cert_pem)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem)
        ctx.load_cert_chain(cert, key)
    return ctx


def client_context(ca_data_b64: str) -> ssl.SSLContext:
    """A client trusting only the certificate a kubeconfig's `certificate-authority-data` holds."""
    return ssl.create_default_context(cadata=base64.b64decode(ca_data_b64).decode())

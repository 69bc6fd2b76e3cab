"""TLS certificates and SuperNode keys in the formats Flower 1.41 reads.

``make_tls``: a private CA plus one server certificate (PEM) whose subject alternative
names cover every name the SuperLinks are reached by. ``make_node_key``: an EC P-384 key
pair in OpenSSH format, what ``flower-supernode --auth-supernode-private-key`` and
``flwr supernode register`` expect.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hfl.deploy.private import private_dir, write_private
from hfl.output.paths import confined_name

VALID_DAYS = 365
TLS_FILES = {"ca": "ca.crt", "ca_key": "ca.key", "cert": "server.pem", "key": "server.key"}


class KeyExistsError(RuntimeError):
    """A key (or CA) is already where a new one would go: replacing it is the operator's call."""


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _taken(paths: Sequence[Path]) -> list[str]:
    """The paths something already stands at (a file, a folder, a symlink, even a dangling one)."""
    return [p.name for p in paths if os.path.lexists(p)]


def make_tls(out: str | Path, names: Sequence[str], *, replace_ca: bool = False) -> dict[str, Path]:
    """Write ca.crt, ca.key, server.pem, server.key into ``out``; the server certificate is
    valid for ``names`` plus localhost and 127.0.0.1. A folder that already holds any of them is
    refused (KeyExistsError) unless ``replace_ca``: a new CA silently cuts off every SuperNode
    that trusts the old one. The keys are created 0600, a symlink at their path never followed."""
    out = private_dir(out)
    paths = {role: out / name for role, name in TLS_FILES.items()}
    taken = _taken(list(paths.values()))
    if taken and not replace_ca:
        raise KeyExistsError(f"{out} already holds {', '.join(taken)}: a new CA would cut off every SuperNode that "
                             "trusts the old one; pass --replace-ca to replace them, or choose another --out")
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder().subject_name(_name("hfl CA")).issuer_name(_name("hfl CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    all_names = [*names, "localhost", "127.0.0.1"]
    cert = (
        x509.CertificateBuilder().subject_name(_name(all_names[0])).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(_san(all_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    # Written through private temporary files renamed into place (the certificates too, then
    # made 0644: a symlink planted at any of the four paths is replaced, never written through).
    write_private(paths["ca_key"], _key_bytes(ca_key), replace=True)
    write_private(paths["ca"], ca.public_bytes(serialization.Encoding.PEM), replace=True, mode=0o644)
    write_private(paths["key"], _key_bytes(key), replace=True)
    write_private(paths["cert"], cert.public_bytes(serialization.Encoding.PEM), replace=True, mode=0o644)
    return paths


def make_node_key(out: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``name`` (OpenSSH private key, 0600 from its creation) and ``name.pub``; returns
    both paths. ``name`` is one file name; a key (or anything, a symlink included) already at
    either path is refused (KeyExistsError): the SuperLink may have its public key registered."""
    name = confined_name("--name", name)
    out = private_dir(out)
    private, public = out / name, out / f"{name}.pub"
    taken = _taken([private, public])
    if taken:
        raise KeyExistsError(f"{out} already holds {', '.join(taken)}: remove it to make a new key (a SuperLink may "
                             "have its public key registered), or choose another --name")
    key = ec.generate_private_key(ec.SECP384R1())
    try:  # O_EXCL|O_NOFOLLOW: one planted between the check and here is refused too
        write_private(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                 serialization.NoEncryption()))
    except FileExistsError as exc:
        raise KeyExistsError(f"{private} appeared while the key was made; nothing was written") from exc
    write_private(public, key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                        serialization.PublicFormat.OpenSSH) + b"\n",
                  replace=True, mode=0o644)
    return private, public

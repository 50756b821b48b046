"""The controller's certificate authority: the cell trusts it, so the proxy can read a request to a secret's host.

A cell that holds a secret only ever holds its placeholder (`agnsup-secret:NAME`);
the proxy swaps in the value on the way out (intercept.py). To see the request
it must terminate the cell's TLS, so it shows the cell a certificate for the
requested name signed by this authority, which the cell's CA bundle includes
(the cell's trust is written by the cell's setup, never by the cell).

- One Authority per controller, made at its first cell with a secret
  (`authority()`): EC P-256, valid for a week from a minute ago. The key lives in
  this process's memory only: it is never written anywhere, so it never enters a
  cell's view, the state root or a receipt. Rotation = a new controller start
  (`agnsup serve` restart, a new Supervisor, each `agnsup run`): the old
  certificate on disk then trusts nothing anyone can sign.
- The certificate (public) is written to `<state>/ca/<controller id>.pem`.
- Leaves: one per requested name (a DNS name or an IP address SAN), signed on
  first use and cached with its ssl.SSLContext; ALPN offers only http/1.1
  (the interception speaks HTTP/1.1; an HTTP/2-only client fails closed).

`cryptography` (a dependency since issue 32) is imported here only, so the run
path of a cell without secrets never pays for it (tests/test_startup_cost.py).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import tempfile
import threading
from contextlib import suppress

from ..errors import UsageError

VALID_DAYS = 7
_lock = threading.Lock()
_authorities: dict[tuple[str, str], "Authority"] = {}


class Authority:
    """A CA whose key never leaves this process; leaves for names on demand."""

    def __init__(self, controller_id: str):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        self.controller_id = controller_id
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=1)
        self._name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agnsup"),
                                x509.NameAttribute(NameOID.COMMON_NAME, f"agnsup egress CA {controller_id}"[:64])])
        ski = x509.SubjectKeyIdentifier.from_public_key(self._key.public_key())
        self._cert = (
            x509.CertificateBuilder().subject_name(self._name).issuer_name(self._name)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(self._key, hashes.SHA256()))
        self.cert_pem: bytes = self._cert.public_bytes(serialization.Encoding.PEM)
        self._ski = ski
        self._x509, self._hashes, self._ser, self._ec, self._eku = x509, hashes, serialization, ec, ExtendedKeyUsageOID
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())  # one key for every leaf: signing is the cost
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._lock = threading.Lock()

    def write_cert(self, ca_dir: str) -> str:
        """The certificate (public) at `<ca_dir>/<controller id>.pem`, written atomically; its path."""
        path = os.path.join(ca_dir, f"{self.controller_id}.pem")
        try:
            os.makedirs(ca_dir, mode=0o755, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=ca_dir, prefix=".ca-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(self.cert_pem)
                os.chmod(tmp, 0o644)
                os.replace(tmp, path)
            except BaseException:
                with suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            raise UsageError(f"the CA directory {ca_dir} is not writable: {e.strerror or e}") from None
        return path

    def leaf_pem(self, host: str) -> tuple[bytes, bytes]:
        """(certificate chain PEM, key PEM) of a leaf for `host`: a DNS name or an IP address."""
        x509, hashes, ser = self._x509, self._hashes, self._ser
        from cryptography.x509.oid import NameOID
        name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            san: object = x509.IPAddress(ipaddress.ip_address(name))
        except ValueError:
            san = x509.DNSName(name.rstrip(".").lower())
        now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=1)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64] or "agnsup")]))
            .issuer_name(self._name).public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(min(now + datetime.timedelta(days=VALID_DAYS),
                                                       self._cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([self._eku.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(self._ski), critical=False)
            .sign(self._key, hashes.SHA256()))
        key = self._leaf_key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())
        return cert.public_bytes(ser.Encoding.PEM) + self.cert_pem, key

    def server_context(self, host: str) -> ssl.SSLContext:
        """The TLS server side for `host` (cached per host): our leaf, HTTP/1.1 only by ALPN."""
        key = host.lower()
        with self._lock:
            ctx = self._contexts.get(key)
            if ctx is not None:
                return ctx
        chain, keypem = self.leaf_pem(host)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])
        # load_cert_chain reads files only: anonymous memory files (memfd_create(2)), so no
        # key ever touches a file system
        fds = [os.memfd_create("agnsup-leaf", os.MFD_CLOEXEC) for _ in (chain, keypem)]
        try:
            for fd, data in zip(fds, (chain, keypem)):
                os.write(fd, data)
            ctx.load_cert_chain(*(f"/proc/self/fd/{fd}" for fd in fds))
        finally:
            for fd in fds:
                os.close(fd)
        with self._lock:
            return self._contexts.setdefault(key, ctx)

    def __repr__(self) -> str:
        return f"<Authority of controller {self.controller_id}>"


def authority(state_root: str, controller_id: str) -> Authority:
    """The controller's one Authority (made on first call, kept for the process's life)."""
    k = (os.path.abspath(state_root), controller_id)
    with _lock:
        a = _authorities.get(k)
        if a is None:
            a = _authorities[k] = Authority(controller_id)
        return a

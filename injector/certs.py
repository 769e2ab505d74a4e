"""Self-signed TLS for the webhook, created at install time (`spotguard injector certgen`).

`make_certificate` builds a CA and a serving certificate for the webhook Service's DNS names.
`ensure_secret_and_ca_bundle` (run once by the install Job) stores them in the TLS Secret the
manifests pre-create (empty) unless it holds a certificate already, and writes the CA into the
MutatingWebhookConfiguration's caBundle. With cert-manager present, use the `cert-manager` overlay
instead and skip the Job.
"""
from __future__ import annotations

import base64
import datetime
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from spotguard.kube.api import JSON_PATCH, MUTATING_WEBHOOKS, SECRETS, STRATEGIC_MERGE_PATCH, Kube, NotFound
from spotguard.kube.conflict import retry_on_conflict


@dataclass(frozen=True)
class TlsMaterial:
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes


def service_dns_names(service: str, namespace: str) -> list[str]:
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def make_certificate(dns_names: list[str], ip_addresses: Sequence[str] = (), days: int = 3650) -> TlsMaterial:
    """A fresh CA and a serving certificate (ECDSA P-256) for `dns_names` and `ip_addresses`."""
    import ipaddress

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spotguard-injector-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    common_name = dns_names[0] if dns_names else "spotguard"
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return TlsMaterial(
        ca_pem=ca.public_bytes(serialization.Encoding.PEM),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
    )


TLS_KEYS = ("tls.crt", "tls.key", "ca.crt")


class MissingSecret(RuntimeError):
    """The TLS Secret the manifests pre-create is absent (certgen may not create Secrets)."""


def ensure_secret_and_ca_bundle(api_client, namespace: str, secret_name: str, service: str,
                                webhook_name: str) -> bool:
    """Fills the pre-created TLS Secret unless it holds a certificate already, then patches the
    webhook's caBundle from it.

    The Secret is created (empty) by the manifests, never here: certgen may only get and patch
    that one Secret, so it cannot mint a Secret of another type (a service-account token).
    The fill is conditional on the read resourceVersion: a concurrent certgen run makes it a 409,
    and the re-read finds that run's certificate, which is kept (`retry_on_conflict`).
    Returns True when a new certificate was made. Raises MissingSecret when the Secret is absent.
    Blocking (Kubernetes client): call in a thread.
    """
    kube = Kube(api_client)
    made: list[bytes] = []

    def fill_or_read() -> bytes:
        try:
            secret = kube.get(SECRETS, namespace, secret_name)
        except NotFound:
            raise MissingSecret(f"secret {namespace}/{secret_name} is missing: the manifests create it "
                                "(kubectl apply -k daemonset/)") from None
        data = secret.get("data") or {}
        if all(data.get(k) for k in TLS_KEYS):
            return base64.b64decode(data["ca.crt"])
        material = make_certificate(service_dns_names(service, namespace))
        body = {"metadata": {"resourceVersion": (secret.get("metadata") or {}).get("resourceVersion")},
                "data": {"tls.crt": base64.b64encode(material.cert_pem).decode(),
                         "tls.key": base64.b64encode(material.key_pem).decode(),
                         "ca.crt": base64.b64encode(material.ca_pem).decode()}}
        kube.patch(SECRETS, namespace, secret_name, body, content_type=STRATEGIC_MERGE_PATCH)
        made.append(material.ca_pem)
        return material.ca_pem

    ca_pem = retry_on_conflict(fill_or_read)
    config = kube.get(MUTATING_WEBHOOKS, None, webhook_name)
    ops = [{"op": "replace" if ((w.get("clientConfig") or {}).get("caBundle") or None) else "add",
            "path": f"/webhooks/{i}/clientConfig/caBundle",
            "value": base64.b64encode(ca_pem).decode()} for i, w in enumerate(config.get("webhooks") or [])]
    if ops:
        kube.patch(MUTATING_WEBHOOKS, None, webhook_name, ops, content_type=JSON_PATCH)
    return bool(made)

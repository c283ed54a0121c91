"""TLS at the balancer's edge (steps/serve/tls.py, conduct/balancer.py edge_tls): real key pairs
made with `cryptography`, checked as HAProxy would need them; a bad pair is one line before any
host is contacted. HAProxy presenting the pair to the official client: tests/test_keyed_real.py."""

from __future__ import annotations

import datetime
import stat

import pytest
import yaml

from playbooks.cli.balancer import run_lb
from playbooks.conduct.balancer import edge_tls, tls_dir
from playbooks.conduct.settings import Settings
from playbooks.config.inventory import HostSpec
from playbooks.errors import VoltaforgeError
from playbooks.steps.serve.tls import TlsPair, kept_pair, problem, self_signed
from tests.testhosts import free_port

LB = HostSpec(name="lb-01", host="10.0.0.5")


def test_a_self_signed_pair_is_made_once_and_kept(tmp_path):
    pair = kept_pair(tmp_path / "lb", ["10.0.0.5", "lb-01", "localhost", "127.0.0.1"])
    assert problem(pair) is None and pair.fingerprint.startswith("SHA256:") and len(pair.fingerprint) == 7 + 95
    assert stat.S_IMODE((tmp_path / "lb" / "key.pem").stat().st_mode) == 0o600
    assert pair.pem.count(b"-----BEGIN") == 2  # the certificate, then its key: HAProxy's crt
    again = kept_pair(tmp_path / "lb", ["10.0.0.5", "lb-01"])
    assert again.fingerprint == pair.fingerprint  # clients keep trusting it
    other = kept_pair(tmp_path / "lb", ["10.0.0.6"])  # a name it does not cover: a new pair
    assert other.fingerprint != pair.fingerprint


def test_a_pair_haproxy_should_not_present_is_named():
    now = datetime.datetime.now(datetime.timezone.utc)
    a, b = self_signed(["a"]), self_signed(["b"])
    assert problem(TlsPair(a.cert_pem, b.key_pem, "")) == "the key does not match the certificate"
    old = self_signed(["a"], now=now - datetime.timedelta(days=900), days=30)
    assert problem(old).startswith("the certificate expired on ")
    assert problem(TlsPair(b"junk", a.key_pem, "")) == "the certificate is not a PEM certificate"


def test_tls_beyond_loopback_by_default_and_plain_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    assert edge_tls(LB, "127.0.0.1", None, None, None) is None
    pair = edge_tls(LB, "0.0.0.0", None, None, None)
    assert pair is not None and (tls_dir("lb-01") / "cert.pem").exists()
    assert edge_tls(LB, "0.0.0.0", False, None, None) is None  # the operator's choice
    assert edge_tls(LB, "127.0.0.1", True, None, None) is not None


@pytest.mark.parametrize(
    ("which", "why"),
    [
        ("mismatched", "the key does not match the certificate"),
        ("expired", "the certificate expired on "),
        ("cert-only", "--cert and --key go together"),
    ],
)
def test_a_bad_pair_is_one_line_before_any_host_is_touched(tmp_path, which, why):
    now = datetime.datetime.now(datetime.timezone.utc)
    good, other = self_signed(["lb-01"]), self_signed(["x"])
    expired = self_signed(["lb-01"], now=now - datetime.timedelta(days=400), days=10)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    pair = {"mismatched": (good.cert_pem, other.key_pem), "expired": (expired.cert_pem, expired.key_pem)}
    c, k = pair.get(which, (good.cert_pem, good.key_pem))
    cert.write_bytes(c)
    key.write_bytes(k)
    inv = tmp_path / "inventory.yaml"  # a closed port: touching the host would fail otherwise
    inv.write_text(yaml.safe_dump({"hosts": {"lb-01": {"host": "127.0.0.1", "port": free_port()}}}))
    with pytest.raises(VoltaforgeError, match=why) as err:
        run_lb(
            "lb-01", ["lb-01"], "tiny-cpu", "0.0.0.0", 8443, settings=Settings(inventory=inv),
            cert=str(cert), key=None if which == "cert-only" else str(key),
        )  # fmt: skip
    assert "\n" not in str(err.value)

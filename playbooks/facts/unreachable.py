"""Did a download fail because a server could not be reached? Read from the tools' own output.

pip says it in its retry warnings (urllib3's ``Retrying (Retry(total=4, ...)) after
connection broken by 'NewConnectionError(...: [Errno -2] Name or service not known)':
/whl/cu118/torch/``, five times, then a misleading ``No matching distribution found``);
huggingface_hub (through requests) in a ``ConnectionError: (MaxRetryError(...))``. These parsers
turn that into a short cause and the places pip named, so a step can say in one line which
index it could not reach and how to stage the file instead. Captured outputs:
tests/fixtures/thishost-pip-*.txt, tests/fixtures/thishost-hub-fetch-*.txt.

A pip configured with ``retries = 0`` says nothing about the connection at its default
verbosity (only "No matching distribution found"): that failure keeps pip's own words.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Unreachable:
    cause: str  # "Name or service not known", "Connection refused", "proxy: ...", "TLS failed (...)"
    where: tuple[str, ...]  # what pip named: paths (/whl/cu118/torch/) or URLs, first seen first


# pip >= 20: a retry per attempt, the URL's path at the end
_RETRY = re.compile(r"Retrying \(Retry\(.*?\)\) after connection broken by '(?P<err>.*)': (?P<where>\S+)\s*$")
# pip < 20 and a few paths of newer ones: the whole URL
_FETCH = re.compile(r"Could not fetch URL (?P<where>\S+?): (?P<err>.*)")
# the index answered but a file did not come: "Could not install packages due to an OSError: HTTPSConnectionPool(...)"
_OSERROR = re.compile(r"due to an OSError: (?P<err>.*(?:Max retries exceeded|ConnectionPool).*)")
_POOL_HOST = re.compile(r"ConnectionPool\(host='(?P<host>[^']+)'")
# what pip ends with when it found nothing to install (the index gave it nothing)
_NOT_FOUND = (
    "No matching distribution found",
    "Could not find a version that satisfies",
    "ResolutionImpossible",
    "conflicting dependencies",
)
_NETWORK_WORDS = (
    "NewConnectionError",
    "NameResolutionError",
    "ConnectTimeout",
    "ReadTimeout",
    "timed out",
    "ProxyError",
    "SSLError",
    "Max retries exceeded",
    "Connection aborted",
    "RemoteDisconnected",
    "Connection reset",
)


def network_cause(text: str) -> str:
    """The short reason in a urllib3/requests error text: "Name or service not known",
    "Connection refused", "proxy: Connection refused", "TLS failed (CertificateError)", ...
    (what comes before its first colon, an exception's name, when none is recognised)."""
    if "OfflineModeIsEnabled" in text or "offline mode is enabled" in text:
        return "offline mode is enabled (HF_HUB_OFFLINE)"
    errno = re.search(r"\[Errno -?\d+\] ([^'\"\\)\]]+)", text)
    resolve = re.search(r"Failed to resolve '([^'\\]+)'", text)
    reason = errno.group(1).strip() if errno else None
    if resolve and not reason:
        reason = f"cannot resolve {resolve.group(1)}"
    if "ProxyError" in text:
        return f"proxy: {reason}" if reason else "cannot connect to the proxy"
    if "SSLError" in text:
        kind = re.search(r"SSLError\((\w+)", text)
        return f"TLS failed ({kind.group(1)})" if kind else "TLS failed"
    if reason:
        return reason
    if "timed out" in text or "Timeout" in text:
        return "timed out"
    first = text.strip().splitlines()[0] if text.strip() else "no output"
    return first.split(":")[0][:80]


def pip_unreachable(stderr: str) -> Unreachable | None:
    """When a failed pip run failed because an index (or a file's host) could not be reached:
    the cause and what pip named; None when it failed for another reason (a build error, a
    version the index does not have)."""
    causes: list[str] = []
    where: list[str] = []
    not_found = any(word in stderr for word in _NOT_FOUND)
    for line in stderr.splitlines():
        m = _RETRY.search(line) or _FETCH.search(line)
        if m and any(word in m.group("err") for word in _NETWORK_WORDS):
            causes.append(network_cause(m.group("err")))
            if m.group("where") not in where:
                where.append(m.group("where"))
            continue
        m = _OSERROR.search(line)
        if m:
            host = _POOL_HOST.search(m.group("err"))
            causes.append(network_cause(m.group("err")))
            if host and host.group("host") not in where:
                where.append(host.group("host"))
            not_found = True
    if not causes or not not_found:
        return None
    return Unreachable(causes[-1], tuple(where))

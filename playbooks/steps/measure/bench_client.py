"""The benchmark's client: streamed completions from an OpenAI-compatible server (llama-server
and TabbyAPI both speak it), timed per token, with the server's own counts.

One request is one :class:`Sample`: when it was sent, when each content chunk arrived, and what
the server said it did (``usage``: tokens in and out; llama-server's ``timings``: its own
prefill and decode rates). Token counts come from the server, never from counting chunks (a
chunk can hold several tokens, or none). Every way a request can go wrong becomes an ``error``
string on its sample, never an exception: the sweep reports errors per level.

httpx does the HTTP (async, one connection per in-flight request, no retries: a retry would
hide the failure the gate exists to see).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from playbooks.plan.engines import engine_of_server

if TYPE_CHECKING:
    import httpx

#: the path of the OpenAI completions endpoint (raw prompt: its length is exact, no template)
COMPLETIONS = "/v1/completions"


@dataclass
class Sample:
    """One streamed request, as the client saw it and as the server reported it."""

    sent: float = 0.0  # monotonic seconds
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with content
    done: float = 0.0
    text: str = ""
    prompt_tokens: int | None = None  # usage, from the server
    completion_tokens: int | None = None
    timings: dict[str, float] = field(default_factory=dict)  # llama-server's own
    finish_reason: str | None = None
    error: str | None = None
    requested: int = 0  # max_tokens asked for: with EOS ignored, exactly what should come back

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def e2e(self) -> float | None:
        return self.done - self.sent if self.done else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first over the time after the first: the client's decode rate."""
        n = self.completion_tokens
        if not n or n < 2 or len(self.chunks) < 2:
            return None
        span = self.chunks[-1] - self.chunks[0]
        return (n - 1) / span if span > 0 else None


@dataclass
class Sent:
    """Every request a run sent one server, its probe and warm-ups included, and the tokens that
    came back: what the server's own counters should show for the run (Prometheus's view of it,
    steps/monitor/bench_view.py)."""

    requests: int = 0
    completion_tokens: int = 0

    def add(self, samples: Sequence[Sample]) -> None:
        self.requests += len(samples)
        self.completion_tokens += sum(s.completion_tokens or 0 for s in samples)


def request_body(prompt: str, max_tokens: int, seed: int, kind: str, model: str | None = None) -> dict[str, Any]:
    """A completion of exactly ``max_tokens`` (EOS ignored where the server allows), seeded;
    ``model``: the served name it asks for (a router serving a model set routes by it; a single
    server answers whatever it serves)."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": seed,
        "temperature": 0.8,
    }
    body.update(engine_of_server(kind).ignore_eos)
    if model:
        body["model"] = model
    return body


def _chunk_text(data: dict[str, Any]) -> str:
    choices = data.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    first = choices[0]
    return str(first.get("text") or (first.get("delta") or {}).get("content") or "")


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout: float) -> Sample:
    """One streamed completion; whatever happens, a Sample (with ``error`` when it failed)."""
    import httpx

    s = Sample(sent=time.monotonic(), requested=int(body.get("max_tokens") or 0))
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                detail = (await r.aread())[:200].decode("utf-8", "replace").strip()
                s.error = f"POST {COMPLETIONS} answered {r.status_code}" + (f": {detail}" if detail else "")
                return s
            ctype = r.headers.get("content-type", "")
            if "text/event-stream" not in ctype:
                s.error = (
                    f"POST {COMPLETIONS} answered {ctype or 'no content type'}, not an event stream: not OpenAI-shaped"
                )
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                try:
                    data = json.loads(payload)
                except ValueError:
                    s.error = f"a stream chunk is not JSON: {payload[:120]}"
                    return s
                if not isinstance(data, dict):
                    continue
                if "error" in data:
                    s.error = f"the server reported: {str(data['error'])[:200]}"
                    return s
                text = _chunk_text(data)
                if text:
                    s.chunks.append(time.monotonic())
                    s.text += text
                choices = data.get("choices") or []
                if choices and isinstance(choices[0], dict) and choices[0].get("finish_reason"):
                    s.finish_reason = str(choices[0]["finish_reason"])
                usage = data.get("usage")
                if isinstance(usage, dict):
                    s.prompt_tokens = usage.get("prompt_tokens")
                    s.completion_tokens = usage.get("completion_tokens")
                timings = data.get("timings")
                if isinstance(timings, dict):
                    s.timings = {k: float(v) for k, v in timings.items() if isinstance(v, (int, float))}
    except httpx.TimeoutException:
        s.error = f"no answer within {timeout:g} s"
    except httpx.ConnectError as exc:
        s.error = f"cannot connect: {exc}"
    except httpx.HTTPError as exc:
        s.error = f"the connection broke: {type(exc).__name__}: {exc}"[:300]
    s.done = time.monotonic()
    if s.error is None and s.completion_tokens is None:
        s.error = "the stream ended without usage (stream_options.include_usage): not OpenAI-shaped"
    return s


def tls_context(verify: str | bool) -> ssl.SSLContext | bool:
    """A CA file as httpx wants it (an SSL context); True: the system's trust store."""
    return ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify


def auth_headers(api_key: str | None) -> dict[str, str]:
    """A keyed server's header (the key held in memory, from the host's secret file:
    steps/serve/secrets.py); none for a server without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def run_level(
    base_url: str,
    prompts: Sequence[str],
    concurrency: int,
    max_tokens: int,
    seed: int,
    kind: str,
    timeout: float,
    api_key: str | None = None,
    verify: str | bool = True,
    model: str | None = None,
) -> tuple[list[Sample], float]:
    """Every prompt once, ``concurrency`` in flight at a time; the samples and the wall time."""
    import httpx  # here, not at the top: a command that sends no request (a no-op) skips its import

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = auth_headers(api_key)
    # verify: a balancer's self-signed certificate (its CA file), else the system's trust store
    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, trust_env=False, headers=headers, verify=tls_context(verify)
    ) as client:

        async def one(i: int, prompt: str) -> Sample:
            async with gate:
                body = request_body(prompt, max_tokens, seed + i, kind, model)
                return await stream_one(client, COMPLETIONS, body, timeout)

        t0 = time.monotonic()
        samples = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return list(samples), time.monotonic() - t0


def probe_prompt_tokens(
    base_url: str,
    prompt: str,
    kind: str,
    timeout: float,
    api_key: str | None = None,
    verify: str | bool = True,
    model: str | None = None,
    max_tokens: int = 2,
) -> Sample:
    """One short request: does the server answer, and how many tokens is this prompt? (A model
    set's gate times its first token too: the load of a member not resident.)"""
    return asyncio.run(_probe(base_url, prompt, kind, timeout, api_key, verify, model, max_tokens))


async def _probe(
    base_url: str,
    prompt: str,
    kind: str,
    timeout: float,
    api_key: str | None,
    verify: str | bool,
    model: str | None,
    max_tokens: int,
) -> Sample:
    import httpx

    headers = auth_headers(api_key)
    async with httpx.AsyncClient(
        base_url=base_url, trust_env=False, headers=headers, verify=tls_context(verify)
    ) as client:
        return await stream_one(client, COMPLETIONS, request_body(prompt, max_tokens, 1, kind, model), timeout)

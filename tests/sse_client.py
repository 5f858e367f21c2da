"""An SSE client that resumes as any standard one can: it reads each event's `id:`, and when its stream is cut
it sends the same request (same X-Request-Id) to the next router with `Last-Event-ID`."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import requests


@dataclass
class Event:
    data: str
    id: str | None = None


@dataclass
class Streamed:
    """What a client read of one stream: its events' JSON (in order), the ids, the resumes it took."""
    chunks: list[dict] = field(default_factory=list)
    ids: list[str | None] = field(default_factory=list)
    resumes: int = 0
    done: bool = False

    @property
    def text(self) -> str:
        return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                       for chunk in self.chunks for c in chunk.get("choices", []))

    @property
    def token_ids(self) -> list[int]:
        return [t for chunk in self.chunks for c in chunk.get("choices", []) for t in c.get("token_ids") or []]

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for chunk in self.chunks for c in chunk.get("choices", []) if c.get("finish_reason")]


def events(lines):
    """SSE events from a response's lines (the fields this server sends: id and data)."""
    data, event_id = [], None
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line:
            if data:
                yield Event("\n".join(data), event_id)
            data, event_id = [], None
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif line.startswith("id:"):
            event_id = line[3:].lstrip(" ")


def stream(base_urls: list[str], path: str, body: dict, request_id: str, out: Streamed | None = None,
           on_event=None, max_resumes: int = 5, timeout: float = 120, headers: dict | None = None) -> Streamed:
    """POST a streamed request; resume it on the next base URL whenever its connection breaks."""
    out = out or Streamed()
    last_id: str | None = None
    deadline = time.monotonic() + timeout
    current = 0
    while True:
        head = {"Accept": "text/event-stream", "X-Request-Id": request_id, **(headers or {})}
        if last_id is not None:
            head["Last-Event-ID"] = last_id
        try:
            with requests.post(base_urls[current] + path, json=body, headers=head, stream=True,
                               timeout=max(deadline - time.monotonic(), 1)) as resp:
                if resp.status_code != 200:
                    raise AssertionError(f"HTTP {resp.status_code}: {resp.text}")
                for event in events(resp.iter_lines()):
                    out.ids.append(event.id)
                    last_id = event.id if event.id is not None else last_id
                    if event.data == "[DONE]":
                        out.done = True
                        return out
                    chunk = json.loads(event.data)
                    assert "error" not in chunk, chunk
                    out.chunks.append(chunk)
                    if on_event is not None:
                        on_event(out)
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
            pass
        if out.resumes >= max_resumes or time.monotonic() > deadline:
            raise AssertionError(f"stream {request_id} not finished after {out.resumes} resume(s)")
        out.resumes += 1
        current = (current + 1) % len(base_urls)
        time.sleep(0.1)

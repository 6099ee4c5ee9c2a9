#!/usr/bin/env python3
"""The HTTP side of scripts/compose_check.sh: standard library only, so it runs on a bare host.

  check_client.py chat URL                      one chat completion; prints the reply text
  check_client.py submit URL MAX_TOKENS         submits a job (ignore_eos); prints its id
  check_client.py job URL JOB_ID                prints the job's view (JSON)
  check_client.py follow URL JOB_ID OUT         follows the job's SSE stream to its `done` event,
                                                reconnecting with Last-Event-ID if the connection
                                                drops; writes one line per token (index and
                                                event id) to OUT, then a `done` line
  check_client.py verify OUT                    every token index 0..n-1 exactly once, event ids
                                                strictly increasing, n = completion_tokens
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request


def _request(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.load(reply)


def chat(base: str) -> int:
    reply = _request(f"{base}/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    text = reply["choices"][0]["message"]["content"]
    print(json.dumps(text))
    return 0 if text.strip() and reply["usage"]["completion_tokens"] > 0 else 1


def submit(base: str, max_tokens: str) -> int:
    reply = _request(f"{base}/v1/jobs", {
        "model": "smollm2", "prompt": "Once upon a time, in a city of many machines,",
        "max_tokens": int(max_tokens), "ignore_eos": True, "temperature": 0})
    print(reply["job_id"])
    return 0


def job(base: str, job_id: str) -> int:
    print(json.dumps(_request(f"{base}/v1/jobs/{job_id}", timeout=30)))
    return 0


def follow(base: str, job_id: str, out_path: str) -> int:
    last_id = None
    deadline = time.monotonic() + 600
    with open(out_path, "w") as out:
        while time.monotonic() < deadline:
            headers = {"Accept": "text/event-stream"}
            if last_id:
                headers["Last-Event-ID"] = last_id
            request = urllib.request.Request(f"{base}/v1/jobs/{job_id}/stream", headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=120) as reply:
                    if reply.status == 204:
                        return 0
                    event, event_id, data = "", None, ""
                    for raw in reply:
                        line = raw.decode().rstrip("\r\n")
                        if line.startswith("event:"):
                            event = line[6:].strip()
                        elif line.startswith("id:"):
                            event_id = line[3:].strip()
                        elif line.startswith("data:"):
                            data += line[5:].strip()
                        elif not line and data:
                            payload = json.loads(data)
                            last_id = event_id or last_id
                            if event == "token":
                                out.write(f"token {payload['index']} {event_id}\n")
                            elif event == "done":
                                out.write(f"done {json.dumps(payload)}\n")
                                return 0
                            out.flush()
                            event, event_id, data = "", None, ""
            except (urllib.error.URLError, OSError, ValueError) as exc:
                print(f"stream dropped ({exc}); resuming after {last_id}", file=sys.stderr)
                time.sleep(1)
    return 1


def verify(out_path: str) -> int:
    indexes, ids, done = [], [], None
    for line in open(out_path):
        kind, _, rest = line.partition(" ")
        if kind == "token":
            index, entry_id = rest.split()
            indexes.append(int(index))
            ms, seq = entry_id.split("-")
            ids.append((int(ms), int(seq)))
        elif kind == "done":
            done = json.loads(rest)
    if done is None:
        print("no done event")
        return 1
    expected = done["usage"]["completion_tokens"]
    ok = (indexes == list(range(expected)) and ids == sorted(set(ids))
          and done["finish_reason"] == "length" and not done["error"])
    print(f"{len(indexes)} token events, completion_tokens={expected}, "
          f"indexes 0..{expected - 1} each once: {indexes == list(range(expected))}, "
          f"ids increasing: {ids == sorted(set(ids))}, finish_reason={done['finish_reason']}")
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    commands = {"chat": chat, "submit": submit, "job": job, "follow": follow, "verify": verify}
    if len(argv) < 2 or argv[1] not in commands:
        print(__doc__)
        return 2
    return commands[argv[1]](*argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))

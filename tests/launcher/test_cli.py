"""The `carpool` command as a newcomer meets it: submit --watch prints only the answer."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from launcher import cli

JOB_ID = "0123abcd"


def _sse(events: list[tuple[str, dict[str, object]]]) -> bytes:
    return "".join(f"event: {kind}\nid: 0-{i + 1}\ndata: {json.dumps(data)}\n\n"
                   for i, (kind, data) in enumerate(events)).encode()


@pytest.fixture
def fake_api(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[httpx.Request]]:
    """Routes the module's httpx calls to an in-process handler that plays the jobs API."""
    seen: list[httpx.Request] = []
    stream = _sse([("token", {"index": 0, "token_id": 5, "text": "The answer"}),
                   ("token", {"index": 1, "token_id": 6, "text": " is 4."}),
                   ("done", {"finish_reason": "stop", "usage": {"completion_tokens": 2}})])

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "POST":
            return httpx.Response(202, json={"job_id": JOB_ID})
        return httpx.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    monkeypatch.setattr(httpx, "post", lambda url, **kw: client.post(url, **kw))
    monkeypatch.setattr(httpx, "stream", lambda method, url, **kw: client.stream(method, url, **kw))
    yield seen


def test_submit_watch_prints_only_the_answer(fake_api: list[httpx.Request],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["submit", "--chat", "What is 2+2?", "--watch", "--api-url", "http://x"]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == ("The answer is 4.\n", "")
    assert json.loads(fake_api[0].content)["messages"] == [{"role": "user", "content": "What is 2+2?"}]
    assert str(fake_api[1].url) == f"http://x/v1/jobs/{JOB_ID}/stream"


def test_submit_verbose_adds_the_job_and_usage_on_stderr(fake_api: list[httpx.Request],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["submit", "hi", "--watch", "--verbose", "--api-url", "http://x"]) == 0
    out, err = capsys.readouterr()
    assert out == "The answer is 4.\n"
    assert f"job {JOB_ID}\n" in err and '[stop] {"completion_tokens": 2}' in err


def test_submit_without_watch_prints_the_job_id(fake_api: list[httpx.Request],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["submit", "hi", "--api-url", "http://x"]) == 0
    assert capsys.readouterr().out == f"{JOB_ID}\n"


def test_an_unreachable_api_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["submit", "hi", "--api-url", "http://127.0.0.1:9"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: cannot reach the API at http://127.0.0.1:9 (")


class _ExitedChild:
    """A child process that has already exited cleanly: `carpool up` stops at once."""

    def __init__(self, command: list[str], **kwargs: object) -> None:
        self.command = command
        self.env = kwargs.get("env")

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0


@pytest.mark.parametrize("secret", ["", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"])
def test_up_starts_the_webhook_dispatcher_only_when_a_secret_is_set(
        monkeypatch: pytest.MonkeyPatch, secret: str) -> None:
    started: list[_ExitedChild] = []

    class _Redis:
        def describe(self) -> str:
            return "test"

        def stop(self) -> None:
            pass

    def spawn(command: list[str], **kwargs: object) -> _ExitedChild:
        started.append(_ExitedChild(command, **kwargs))
        return started[-1]

    monkeypatch.setattr(cli.LocalRedis, "ensure", lambda url, data_dir: _Redis())
    monkeypatch.setattr(cli, "_prepare_model", lambda model: 0)
    monkeypatch.setattr(cli, "_wait_until_ready", lambda url, children, is_stopping: False)
    monkeypatch.setattr(cli.subprocess, "Popen", spawn)
    monkeypatch.setattr(cli.signal, "signal", lambda signum, handler: None)  # pytest keeps its own
    monkeypatch.setenv("CARPOOL_WEBHOOK_SECRET", secret)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    assert cli.main(["up", "--redis-url", "redis://127.0.0.1:6399/0"]) == 0
    modules = [child.command[2] for child in started]
    assert modules == (["api", "worker", "webhooks"] if secret else ["api", "worker"])
    # The worker starts without transformers' loading progress bar at the default log level.
    assert started[1].env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    if secret:
        assert started[-1].env["CARPOOL_REDIS_URL"] == "redis://127.0.0.1:6399/0"


@pytest.mark.parametrize(("level", "preset", "expected"), [
    ("warning", None, "1"), ("error", None, "1"), ("info", None, None), ("debug", None, None),
    ("warning", "0", "0"),  # the user's own setting stands
])
def test_the_workers_loading_progress_bar_shows_only_below_warning(
        monkeypatch: pytest.MonkeyPatch, level: str, preset: str | None, expected: str | None) -> None:
    if preset is None:
        monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", preset)
    assert cli._worker_env(level).get("HF_HUB_DISABLE_PROGRESS_BARS") == expected

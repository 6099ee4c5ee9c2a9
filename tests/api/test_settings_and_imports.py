"""ApiSettings from the environment, the command line, and the no-torch rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from api_support import CHAT_TEMPLATE

from api.__main__ import main
from api.chat_template import render_chat
from api.settings import ApiSettings
from protocol import ModelCard

ROOT = Path(__file__).resolve().parents[2]


def test_api_keys_come_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARPOOL_API_KEYS", "key1, key2,,")
    monkeypatch.setenv("CARPOOL_MAX_QUEUE_DEPTH", "5")
    settings = ApiSettings()
    assert settings.api_keys == ["key1", "key2"]
    assert settings.max_queue_depth == 5


def test_no_keys_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CARPOOL_API_KEYS", raising=False)
    assert ApiSettings().api_keys == []


def test_command_line_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def fake_run(app: object, host: str, port: int, log_level: str,
                 timeout_keep_alive: int) -> None:
        seen.update(host=host, port=port, redis_url=app.state.context.settings.redis_url,  # type: ignore[attr-defined]
                    keep_alive=timeout_keep_alive)

    monkeypatch.setenv("CARPOOL_PORT", "9000")
    monkeypatch.setenv("CARPOOL_HTTP_KEEP_ALIVE_S", "120")
    monkeypatch.setattr("api.__main__.uvicorn.run", fake_run)
    assert main(["--host", "0.0.0.0", "--redis-url", "redis://example:6380/2"]) == 0
    assert seen == {"host": "0.0.0.0", "port": 9000, "redis_url": "redis://example:6380/2",
                    "keep_alive": 120}


def test_idle_connections_outlive_a_burst_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # uvicorn's own 5 s lost a POST to the keep-alive close race in the 1,000-job burst
    # (tests/reliability/test_api_load.py failed 2 runs of 3 with ReadError; 0 of 4 at 75 s).
    monkeypatch.delenv("CARPOOL_HTTP_KEEP_ALIVE_S", raising=False)
    assert ApiSettings().http_keep_alive_s == 75


def test_api_never_imports_torch_or_transformers() -> None:
    code = ("import sys, api.app, api.__main__; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chat_template_renders_like_the_model() -> None:
    card = ModelCard(name="m", max_model_len=8, chat_template=CHAT_TEMPLATE)
    text, exact = render_chat(card, [{"role": "user", "content": "hi"}])
    assert exact
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_without_a_template_is_approximated() -> None:
    card = ModelCard(name="m", max_model_len=8, chat_template=None)
    text, exact = render_chat(card, [{"role": "user", "content": "hi"}])
    assert not exact
    assert "hi" in text


def test_smollm2_template_when_its_files_are_here() -> None:
    from worker.model.loader import DEFAULT_CACHE_DIR

    template_file = DEFAULT_CACHE_DIR / "smollm2" / "chat_template.jinja"
    if not template_file.is_file():
        pytest.skip("the converted SmolLM2 is not cached on this machine")
    card = ModelCard(name="smollm2", max_model_len=8192, chat_template=template_file.read_text())
    text, exact = render_chat(card, [{"role": "user", "content": "What is 2+2?"}])
    assert exact
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")

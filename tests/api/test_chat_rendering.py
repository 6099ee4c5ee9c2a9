"""vLLM's chat rendering fields (add_generation_prompt, continue_final_message,
chat_template_kwargs): the API's rendering (it counts the prompt, and renders tool templates into
token ids) matches transformers' apply_chat_template, which the worker renders with; the fields
are checked and travel with the job."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import CHAT_TEMPLATE, Harness
from rq.job import Job
from rq.serializers import JSONSerializer

from api.chat_template import ChatTemplateError, render_chat, template_kwargs_for
from protocol import FinishReason, ModelCard

# A template that trims each message's content (as some models' do): the continued text then
# ends without the trailing space the client wrote, as transformers renders it.
TRIMMING_TEMPLATE = CHAT_TEMPLATE.replace("{{ message['content'] }}", "{{ message['content'] | trim }}")
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Name a fruit"}, {"role": "assistant", "content": "The fruit is"}],
    [{"role": "user", "content": "Name a fruit"}, {"role": "assistant", "content": "The fruit is "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: one, two,"}],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("template", ["model", TRIMMING_TEMPLATE], ids=["smollm2", "trimming"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["plain", "trailing-space", "user-last"])
def test_a_continued_chat_renders_as_transformers_renders_it(tokenizer: Any, template: str,
                                                             messages: list[dict[str, Any]]) -> None:
    source = tokenizer.chat_template if template == "model" else template
    card = ModelCard(name="m", max_model_len=8192, chat_template=source)
    for add, cont in ((True, False), (False, False), (False, True)):
        text, exact = render_chat(card, messages, add_generation_prompt=add, continue_final_message=cont)
        expected = tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                 add_generation_prompt=add, continue_final_message=cont)
        assert exact and text == expected, (add, cont)


def test_a_template_that_drops_the_last_message_cannot_continue_it() -> None:
    dropping = "{% for message in messages[:-1] %}{{ message['content'] }}{% endfor %}"
    card = ModelCard(name="m", max_model_len=64, chat_template=dropping)
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        render_chat(card, CONVERSATIONS[0], continue_final_message=True)


def test_without_a_template_the_approximation_continues_too() -> None:
    card = ModelCard(name="m", max_model_len=64, chat_template=None)
    text, exact = render_chat(card, CONVERSATIONS[0], add_generation_prompt=False,
                              continue_final_message=True)
    assert not exact and text.endswith("<|im_start|>assistant\nThe fruit is")



@pytest.mark.anyio
async def test_the_job_carries_the_rendering_and_counts_the_continued_prompt(
        harness: Harness, client: httpx.AsyncClient) -> None:
    specs = []
    for fields in ({"continue_final_message": True}, {}):
        worker = asyncio.create_task(harness.serve_next_job(["!"]))
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}],
            "max_tokens": 2, **fields})
        job_id = await worker
        assert response.status_code == 200, response.text
        specs.append(Job.fetch(job_id, connection=harness.context.sync,
                               serializer=JSONSerializer).args[0])
    continued, plain = specs
    assert (continued["add_generation_prompt"], continued["continue_final_message"]) == (False, True)
    assert "add_generation_prompt" not in plain and "continue_final_message" not in plain


@pytest.mark.anyio
@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
     "must be false"),
    ({"continue_final_message": "yes"}, "continue_final_message", "valid boolean"),
    ({"add_generation_prompt": 1}, "add_generation_prompt", "valid boolean"),
])
async def test_bad_rendering_fields_are_400_naming_them(client: httpx.AsyncClient,
                                                        fields: dict[str, Any], param: str,
                                                        words: str) -> None:
    response = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}], **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


@pytest.mark.anyio
async def test_tokenize_continues_the_final_message(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    opened = (await client.post("/tokenize", json={"messages": messages})).json()
    continued = (await client.post("/tokenize", json={"messages": messages,
                                                      "continue_final_message": True})).json()
    # <|im_start|> user hello <|im_end|> <|im_start|> assistant world [<|im_end|> <|im_start|> assistant]
    assert continued["tokens"] == opened["tokens"][:len(continued["tokens"])]
    assert opened["count"] - continued["count"] == 3


# A template reading one more variable, as Qwen3's reads enable_thinking.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_template_kwargs_render_as_transformers_passes_them(tokenizer: Any) -> None:
    card = ModelCard(name="m", max_model_len=8192, chat_template=THINKING_TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}]
    kwargs = template_kwargs_for(card, {"enable_thinking": False, "not_read": 1})
    assert kwargs == {"enable_thinking": False}  # what the template does not read is dropped
    text, _ = render_chat(card, messages, template_kwargs=kwargs)
    assert text.endswith("<think>\n\n</think>\n\n")
    assert text == tokenizer.apply_chat_template(messages, chat_template=THINKING_TEMPLATE,
                                                 tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=False)
    assert template_kwargs_for(ModelCard(name="m", max_model_len=8, chat_template=None),
                               {"enable_thinking": False}) == {}


@pytest.mark.anyio
async def test_the_job_carries_the_template_kwargs_its_model_reads(harness: Harness,
                                                                   client: httpx.AsyncClient) -> None:
    async def serve(model: str) -> str:
        job_id = await harness.take_job(model=model)
        harness.publish_tokens(job_id, ["!"])
        harness.publish_done(job_id, 1, FinishReason.LENGTH, 3, text="!")
        return job_id

    specs = []
    for model, template in (("thinking", THINKING_TEMPLATE), ("plain", CHAT_TEMPLATE)):
        harness.register_model(name=model, chat_template=template)
        worker = asyncio.create_task(serve(model))
        response = await client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False, "not_read": [1, 2]}})
        job_id = await worker
        assert response.status_code == 200, response.text
        specs.append(Job.fetch(job_id, connection=harness.context.sync,
                               serializer=JSONSerializer).args[0])
    thinking, plain = specs
    assert thinking["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in plain  # a model whose template reads neither


@pytest.mark.anyio
async def test_template_kwargs_may_not_set_what_the_request_sets(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}],
        "chat_template_kwargs": {"add_generation_prompt": False}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and "set by the request itself" in error["message"]

"""The prefill-heavy workload (long documents that share no prefix, the same for the same seed), the
decode-heavy one (the chat questions, every answer the same length) and the shared-prefix one (one
long system prompt before each chat question)."""

from __future__ import annotations

from loadgen.workload import build_workload, long_answer_workload, long_prompt_workload, shared_prefix_workload


def test_long_prompts_are_distinct_documents_repeated_by_seed() -> None:
    items = long_prompt_workload(4, words=300, max_tokens=16, seed=1)
    texts = [item.messages[0]["content"] for item in items]
    assert [text.split("\n")[0] for text in texts] == [f"Document {i}:" for i in range(4)]
    assert [len(text.split("\n")[1].split()) for text in texts] == [300] * 4
    assert all(text.endswith("\n\nSummarize the document above in one sentence.") for text in texts)
    assert len({text.split("\n")[1] for text in texts}) == 4
    assert [item.max_tokens for item in items] == [16] * 4
    assert long_prompt_workload(4, words=300, max_tokens=16, seed=1) == items
    assert long_prompt_workload(4, words=300, max_tokens=16, seed=2) != items


def test_long_answers_ask_the_chat_questions_at_one_length() -> None:
    items = long_answer_workload(6, max_tokens=512)
    assert [item.messages for item in items] == [item.messages for item in build_workload(6)]
    assert [item.max_tokens for item in items] == [512] * 6


def test_shared_prefix_puts_one_system_prompt_before_each_chat_question() -> None:
    items = shared_prefix_workload(5, words=200)
    chat = build_workload(5)
    systems = {item.messages[0]["content"] for item in items}
    assert len(systems) == 1 and all(item.messages[0]["role"] == "system" for item in items)
    (system,) = systems
    assert system.startswith("You are the assistant of a help desk. Keep to these notes:\n")
    assert len(system.split("\n", 1)[1].split()) == 200
    assert [item.messages[1:] for item in items] == [item.messages for item in chat]
    assert [item.max_tokens for item in items] == [item.max_tokens for item in chat]
    assert shared_prefix_workload(5, words=200) == items

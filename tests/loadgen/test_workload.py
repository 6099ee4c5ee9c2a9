"""The prefill-heavy workload (long documents that share no prefix, the same for the same seed) and
the decode-heavy one (the chat questions, every answer the same length)."""

from __future__ import annotations

from loadgen.workload import build_workload, long_answer_workload, long_prompt_workload


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

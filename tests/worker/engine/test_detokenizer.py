"""Incremental detokenization with the real SmolLM2 tokenizer (byte-level BPE). No torch."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from worker.engine.detokenizer import Detokenizer, make_decode


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


def stream(tokenizer: Any, prompt: list[int], output: list[int], stop: tuple[str, ...] = (),
           include_stop: bool = False) -> tuple[list[str], bool]:
    detokenizer = Detokenizer(make_decode(tokenizer), prompt, stop, include_stop=include_stop)
    deltas = []
    for token_id in output:
        text, stopped = detokenizer.step(token_id)
        deltas.append(text)
        if stopped:
            return deltas, True
    deltas[-1] += detokenizer.flush()
    return deltas, False


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def full_decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


TEXTS = [
    "Hello, world! How are you today?",
    " leading space, then\nnew lines\n\n  and  double  spaces",
    "héllo wörld — naïve café",
    "emoji 😀🎉👍🏽 and flags 🇫🇷 in a row",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "mixed: 42 + 7 = 49; ∑ ∫ √ ∞ ≠ ≤",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_decoded_output(tokenizer: Any, text: str) -> None:
    prompt = encode(tokenizer, "User said:")
    output = encode(tokenizer, text)
    deltas, stopped = stream(tokenizer, prompt, output)
    assert not stopped
    assert "".join(deltas) == full_decode(tokenizer, output) == text
    assert all("\ufffd" not in delta for delta in deltas)


def test_multibyte_characters_split_across_tokens_are_held_back(tokenizer: Any) -> None:
    output = encode(tokenizer, "a😀b")
    pieces = [tokenizer.decode([t]) for t in output]
    assert sum("\ufffd" in piece for piece in pieces) >= 2, "the emoji should span byte tokens"
    deltas, _ = stream(tokenizer, encode(tokenizer, "x"), output)
    assert "😀" in "".join(deltas) and all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # held back while the emoji was incomplete


def test_random_token_streams_decode_consistently(tokenizer: Any) -> None:
    rng = random.Random(0)
    for _ in range(30):
        prompt = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(1, 8))]
        output = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(1, 40))]
        deltas, _ = stream(tokenizer, prompt, output)
        # (A last character still missing bytes is not shown: see the test below.)
        assert "".join(deltas) == full_decode(tokenizer, output).rstrip("\ufffd")


def test_an_output_that_ends_inside_a_character_does_not_show_its_replacement_char(
        tokenizer: Any) -> None:
    # max_tokens reached between an emoji's byte tokens: vLLM and OpenAI show the text before it.
    output = encode(tokenizer, "sea 🌊")[:-1]
    assert full_decode(tokenizer, output).endswith("\ufffd")
    deltas, _ = stream(tokenizer, encode(tokenizer, "x"), output)
    assert "".join(deltas) == "sea " and all("\ufffd" not in delta for delta in deltas)


def test_leading_space_of_the_first_token_is_kept(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "Hello")
    output = encode(tokenizer, " world and more")
    deltas, _ = stream(tokenizer, prompt, output)
    assert deltas[0] == " world"


def test_special_tokens_are_not_emitted(tokenizer: Any) -> None:
    output = encode(tokenizer, "done") + [tokenizer.eos_token_id]
    deltas, _ = stream(tokenizer, [5], output)
    assert "".join(deltas) == "done" and deltas[-1] == ""


def test_stop_string_and_what_follows_are_not_emitted(tokenizer: Any) -> None:
    output = encode(tokenizer, "The answer is 42. END of story")
    deltas, stopped = stream(tokenizer, [5], output, stop=("END",))
    assert stopped and "".join(deltas) == "The answer is 42. "


def test_include_stop_str_in_output_keeps_the_stop_string_and_nothing_after(tokenizer: Any) -> None:
    output = encode(tokenizer, "The answer is 42. END of story")
    deltas, stopped = stream(tokenizer, [5], output, stop=("END",), include_stop=True)
    assert stopped and "".join(deltas) == "The answer is 42. END"
    # The first stop string the text completes ends it ("is 4" before "END")...
    deltas, _ = stream(tokenizer, [5], output, stop=("END", "is 4"), include_stop=True)
    assert "".join(deltas) == "The answer is 4"
    # ...and of two completed by the same token from the same place, the longer one.
    assert "ĠEND" in tokenizer.convert_ids_to_tokens(output)  # one token: both complete at once
    deltas, _ = stream(tokenizer, [5], output, stop=("EN", "END"), include_stop=True)
    assert "".join(deltas) == "The answer is 42. END"


def test_stop_string_spanning_two_tokens(tokenizer: Any) -> None:
    output = encode(tokenizer, "alpha beta gamma delta")
    pieces = [tokenizer.decode([t]) for t in output]
    stop = "ta gam"  # the end of " beta" and the start of " gamma"
    assert not any(stop in piece for piece in pieces)
    deltas, stopped = stream(tokenizer, [5], output, stop=(stop,))
    assert stopped and "".join(deltas) == "alpha be"


def test_a_possible_stop_prefix_is_held_then_released(tokenizer: Any) -> None:
    output = encode(tokenizer, "one two three")
    held = Detokenizer(make_decode(tokenizer), [5], stop=("three!",))
    texts = [held.step(t)[0] for t in output]
    assert texts[-1] == " " and "".join(texts) == "one two "  # "three" may yet become "three!"
    assert held.flush() == "three"  # the request ended: it was not a stop string after all
    ruled_out = Detokenizer(make_decode(tokenizer), [5], stop=("twelve",))
    texts = [ruled_out.step(t)[0] for t in output]
    assert "".join(texts) == "one two three" and ruled_out.flush() == ""


def test_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    output = encode(tokenizer, "red green blue")
    deltas, stopped = stream(tokenizer, [5], output, stop=("blue", "green"))
    assert stopped and "".join(deltas) == "red "


@pytest.mark.parametrize("split", [1, 3, 7, 12])
def test_a_resumed_detokenizer_continues_identically(tokenizer: Any, split: int) -> None:
    prompt = encode(tokenizer, "Tell me:")
    output = encode(tokenizer, "héllo 😀 世界 and a stop-ish tail EN")
    whole, _ = stream(tokenizer, prompt, output, stop=("END",))
    resumed = Detokenizer(make_decode(tokenizer), prompt, ("END",))
    for token_id in output[:split]:
        resumed.step(token_id)
    rest = [resumed.step(t)[0] for t in output[split:]]
    rest[-1] += resumed.flush()
    assert rest == whole[split:]
    assert "".join(whole[:split]) + "".join(rest) == full_decode(tokenizer, output)

from __future__ import annotations

import json

import pytest

from protocol import (
    FinishReason,
    JobResult,
    JobSpec,
    JobState,
    JobStatus,
    Priority,
    SamplingParams,
    StreamEntry,
    TokenLogprobs,
    stream_ids,
)
from tests.protocol.conftest import make_spec


def test_job_spec_round_trips_through_dict_and_json() -> None:
    spec = make_spec(stop=["\n"], seed=7, priority=Priority.HIGH,
                     messages=None, prompt="Hi")
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert JobSpec.from_json(spec.to_json()) == spec
    assert spec.to_dict()["priority"] == "high"
    json.dumps(spec.to_dict())  # plain JSON, nothing else


@pytest.mark.parametrize("data, message", [
    ([], "must be a JSON object"),
    ({"job_id": "j", "model": "m", "prompt": "x", "bogus": 1}, "unknown fields: bogus"),
    ({"job_id": "", "model": "m", "prompt": "x"}, "non-empty string 'job_id'"),
    ({"job_id": "j", "prompt": "x"}, "non-empty string 'model'"),
    ({"job_id": "j", "model": "m"}, "exactly one of 'prompt', 'messages' and 'prompt_token_ids'"),
    ({"job_id": "j", "model": "m", "prompt": "x", "messages": []}, "exactly one of"),
    ({"job_id": "j", "model": "m", "prompt": "x", "priority": "urgent"}, "unknown priority"),
    ({"job_id": "j", "model": "m", "prompt": "x", "deadline_at": "soon"},
     "deadline_at must be a number of seconds since the epoch"),
    ({"job_id": "j", "model": "m", "prompt": "x", "queue_deadline_at": -1},
     "queue_deadline_at must be a number"),
    ({"job_id": "j", "model": "m", "messages": [], "continue_final_message": 1},
     "'continue_final_message' must be true or false"),
    ({"job_id": "j", "model": "m", "messages": [], "continue_final_message": True},
     "needs add_generation_prompt false"),
    ({"job_id": "j", "model": "m", "messages": [], "chat_template_kwargs": [1]},
     "'chat_template_kwargs' must be a JSON object"),
])
def test_job_spec_rejects_malformed_payloads_with_value_error(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JobSpec.from_dict(data)  # type: ignore[arg-type]


def test_a_continued_chat_round_trips_and_the_defaults_stay_out_of_the_payload() -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello,"}]
    continued = JobSpec(job_id="j", model="m", messages=messages, add_generation_prompt=False,
                        continue_final_message=True, chat_template_kwargs={"enable_thinking": False})
    assert JobSpec.from_json(continued.to_json()) == continued
    assert continued.to_dict()["continue_final_message"] is True
    plain = JobSpec(job_id="j", model="m", messages=messages)
    # Workers that predate the fields read plain chats as before.
    assert "add_generation_prompt" not in plain.to_dict()
    assert "continue_final_message" not in plain.to_dict()
    assert "chat_template_kwargs" not in plain.to_dict()
    assert JobSpec.from_dict(plain.to_dict()) == plain


def test_job_spec_expiry_says_which_limit_passed() -> None:
    spec = JobSpec(job_id="j", model="m", prompt="x", queue_deadline_at=100.0, deadline_at=200.0)
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert spec.expiry(99.0, has_started=False) == ""
    assert spec.expiry(100.0, has_started=False) == "queue timeout"
    assert spec.expiry(150.0, has_started=True) == ""  # the queue timeout binds only unstarted
    assert spec.expiry(200.0, has_started=True) == "deadline"
    assert JobSpec(job_id="j", model="m", prompt="x").expiry(1e12, has_started=False) == ""


def test_job_spec_from_json_rejects_bad_json() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        JobSpec.from_json("{nope")


def test_job_state_round_trips_with_token_ids() -> None:
    state = JobState(job_id="j", status=JobStatus.FINISHED, finish_reason=FinishReason.STOP,
                     text="hé", token_ids=(5, 6, 7), prompt_tokens=3, completion_tokens=3,
                     created_at=1.5, num_preemptions=2, num_recoveries=1, execution="j:e1")
    fields = state.to_fields()
    assert fields["token_ids"] == "[5,6,7]"
    assert fields["finish_reason"] == "stop"
    encoded = {k.encode(): v.encode() for k, v in fields.items()}
    assert JobState.from_fields(encoded) == state


def test_job_state_result_carries_the_outcome() -> None:
    state = JobState(job_id="j", status=JobStatus.FINISHED, finish_reason=FinishReason.LENGTH,
                     text="ab", token_ids=(1, 2), prompt_tokens=4, completion_tokens=2)
    result = state.result()
    assert result.token_ids == [1, 2]
    data = result.to_dict()
    assert data["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert data["status"] == "finished" and data["finish_reason"] == "length"
    assert JobResult.from_dict(json.loads(json.dumps(data))) == result


def test_stream_entry_ids_make_redis_order_tokens() -> None:
    assert stream_ids.token_entry_id(0) == "0-1"
    assert stream_ids.done_entry_id(3) == "0-4"
    token = StreamEntry(kind=StreamEntry.TOKEN, index=2, token_id=9, text="x")
    assert StreamEntry.from_fields(token.to_fields()) == token
    done = StreamEntry(kind=StreamEntry.DONE, finish_reason=FinishReason.ERROR, error="boom",
                       prompt_tokens=3, completion_tokens=0)
    assert StreamEntry.from_fields(done.to_fields()) == done


def test_job_spec_with_token_ids_round_trips_and_old_specs_omit_the_field() -> None:
    from protocol import JobSpec

    spec = JobSpec(job_id="j", model="m", prompt_token_ids=[1, 2, 3])
    assert JobSpec.from_json(spec.to_json()) == spec
    assert "prompt_token_ids" not in JobSpec(job_id="j", model="m", prompt="hi").to_dict()
    for bad in ([], [1, -2], [1, True], "1 2"):
        with pytest.raises(ValueError, match="'prompt_token_ids' must be a non-empty list"):
            JobSpec.from_dict({"job_id": "j", "model": "m", "prompt_token_ids": bad})


def test_generation_defaults_take_vllms_fields_only() -> None:
    from protocol.generation_defaults import generation_defaults

    config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 512,
              "repetition_penalty": 1.05, "do_sample": True, "bos_token_id": 1, "min_p": "0.1"}
    assert generation_defaults(config) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                           "max_tokens": 512, "repetition_penalty": 1.05}
def test_sampling_fields_round_trip_with_logit_bias_as_openai_object() -> None:
    sampling = SamplingParams(max_tokens=8, stop_token_ids=(5, 9), min_tokens=2,
                              presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.1,
                              logit_bias=((3, -100.0), (17, 2.5)), min_p=0.1, top_k=4, seed=1,
                              logprobs=3)
    data = sampling.to_dict()
    assert data["logit_bias"] == {"3": -100.0, "17": 2.5}
    assert data["stop_token_ids"] == [5, 9]
    assert "has_extras" not in data and sampling.has_extras
    assert not SamplingParams(top_k=5, min_p=0.5, seed=3).has_extras  # nothing for the processing
    assert set(SamplingParams().to_dict()) == {"max_tokens", "temperature", "top_p", "top_k", "seed",
                                               "stop", "ignore_eos"}  # what older workers read
    assert SamplingParams.from_dict(json.loads(json.dumps(data))) == sampling
    spec = make_spec()
    spec = JobSpec.from_dict({**spec.to_dict(), "sampling": data})
    assert spec.sampling == sampling
    assert SamplingParams.from_fields({"logit_bias": {"17": 2.5, "3": 1}}).logit_bias == ((3, 1), (17, 2.5))
    truncated = SamplingParams(truncate_prompt_tokens=10)
    assert SamplingParams.from_dict(truncated.to_dict()) == truncated
    assert [truncated.truncated_prompt_length(n, 64) for n in (4, 10, 50)] == [4, 10, 10]
    whole_context = SamplingParams(truncate_prompt_tokens=-1)
    assert [whole_context.truncated_prompt_length(n, 64) for n in (4, 100)] == [4, 64]
    assert SamplingParams().truncated_prompt_length(100, 64) == 100
    kept = SamplingParams(stop=("END",), include_stop_str_in_output=True)
    assert kept.to_dict()["include_stop_str_in_output"] is True
    assert SamplingParams.from_dict(kept.to_dict()) == kept


@pytest.mark.parametrize("fields, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a bool"),
    ({"skip_special_tokens": 0}, "skip_special_tokens must be a bool"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be None, -1 or an int at least 1"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be None, -1"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number above 0"),
    ({"min_p": 1.5}, "min_p must be in"),
    ({"typical_p": 0.0}, "typical_p must be in"),
    ({"min_tokens": -1}, "min_tokens must be an int at least 0"),
    ({"logprobs": -1}, "logprobs must be None or an int"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids must hold non-negative ints"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias values must be in"),
    ({"logit_bias": [[1, 2.0]]}, "logit_bias entries must be"),
])
def test_sampling_fields_reject_bad_values(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(fields)


@pytest.mark.parametrize(("given", "used"), [(1e-300, 0.0), (9e-6, 0.0), (1e-5, 0.01), (0.003, 0.01),
                                             (0.01, 0.01), (0.5, 0.5), (0.0, 0.0)])
def test_a_temperature_too_small_to_divide_by_is_greedy_or_the_least_that_samples(
        given: float, used: float) -> None:
    # logits / 1e-300 overflow to inf and their logprobs to NaN, which no JSON answer can carry.
    assert SamplingParams(temperature=given).temperature == used


def test_typical_p_travels_only_when_set() -> None:
    assert "typical_p" not in SamplingParams().to_dict()
    typical = SamplingParams(typical_p=0.9)
    assert typical.to_dict()["typical_p"] == 0.9
    assert SamplingParams.from_dict(typical.to_dict()) == typical


def test_token_entries_carry_logprobs_through_the_stream_fields() -> None:
    logprobs = TokenLogprobs(-0.25, ((9, -0.25), (4, -1.5)))
    token = StreamEntry(kind=StreamEntry.TOKEN, index=0, token_id=9, text="x", logprobs=logprobs)
    fields = token.to_fields()
    assert json.loads(fields["lp"]) == [-0.25, [[9, -0.25], [4, -1.5]]]
    assert StreamEntry.from_fields(fields) == token
    plain = StreamEntry(kind=StreamEntry.TOKEN, index=0, token_id=9, text="x")
    assert "lp" not in plain.to_fields()

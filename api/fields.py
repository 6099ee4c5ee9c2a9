"""Request field types shared by the jobs API and the OpenAI routes: one limit, one description.

Numbers are strict (no "0.5" strings, no true-as-1): a client sending the wrong type hears so.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field

# Stop strings: as many as the worker takes (16), past OpenAI's 4, as vLLM takes more (evaluation
# harnesses send a task's every delimiter).
from protocol.generation import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_STOP_STRINGS,
)
from protocol.messages import MAX_CACHE_SALT_CHARS

# The worker's own limits (protocol/generation.py): a job the API accepts past them would only
# fail on the worker, after a 202. tests/reliability checks the two stay equal.
MAX_STOP_STRING_CHARS = 256
SEED_MIN = 0
SEED_MAX = 2**63 - 1
# The worker's own limits again (protocol/generation.py), so the API refuses what would fail there.
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0


def _stop_as_list(value: Any) -> Any:
    # OpenAI accepts one string or a list of them; everything downstream wants the list.
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return value


def _valid_unicode(value: str) -> str:
    # JSON may carry a lone surrogate ("\\ud800"); it is not text, and no tokenizer takes it.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("contains an unpaired surrogate (not valid Unicode text)") from exc
    return value


# Text that reaches the tokenizer, Redis and the worker (length checked on the str itself, so
# the message says "at least 1 character").
Text = Annotated[str, Field(strict=True), AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(strict=True, min_length=1), AfterValidator(_valid_unicode)]

Temperature = Annotated[float, Field(
    strict=True, ge=0.0, le=2.0,
    description="Sampling temperature, 0 to 2; 0 picks the most likely token every time.")]
TopP = Annotated[float, Field(
    strict=True, gt=0.0, le=1.0,
    description="Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p.")]
TopK = Annotated[int, Field(
    strict=True, ge=0, description="Keep only the k most likely tokens; 0 disables the filter.")]
Seed = Annotated[int | None, Field(
    strict=True, ge=SEED_MIN, le=SEED_MAX,
    description="Seed for sampling, 0 to 2**63-1: the same seed, prompt and parameters give the "
                "same tokens.")]
StopString = Annotated[str, Field(strict=True, min_length=1, max_length=MAX_STOP_STRING_CHARS),
                       AfterValidator(_valid_unicode)]
StopStrings = Annotated[
    list[StopString],
    # The documented input is what _stop_as_list takes (null, one string or a list), so that the
    # OpenAPI spec admits exactly what the route accepts.
    BeforeValidator(_stop_as_list, json_schema_input_type=StopString | list[StopString] | None),
    Field(max_length=MAX_STOP_STRINGS,
          description=f"Up to {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} "
                      "characters; generation stops before any of them (one string or a list)."),
]


def _not_zero(value: int | None) -> int | None:
    if value == 0:
        raise ValueError("0 would keep no prompt: give at least 1, or -1 for the model's context")
    return value


IgnoreEos = Annotated[bool, Field(
    strict=True, description="Keep generating past the end-of-sequence token (for benchmarks).")]
TruncatePromptTokens = Annotated[
    Annotated[int, AfterValidator(_not_zero), Field(strict=True, ge=-1)] | None,
    Field(description="vLLM's: keep only the prompt's last k tokens (after the chat template); -1: "
                      "as many as the model's context holds; default: the whole prompt.")]
ParallelToolCalls = Annotated[bool | None, Field(
    strict=True, description="With tool_choice required: allow more than one call (default true).")]
SkipSpecialTokens = Annotated[bool, Field(
    strict=True, description="vLLM's: leave special tokens' text out of the output (the default); "
                             "false writes it (the end-of-sequence token that ends the text "
                             "aside).")]
# What the logprobs of generated tokens are of, for the fields that ask for them.
LOGPROBS_DISTRIBUTION = (
    "Of the model's own distribution, whatever the temperature, penalties or bias (vLLM's "
    "raw_logprobs); a worker started with --logprobs-mode processed_logprobs gives those of the "
    "distribution sampled from, after them and the temperature, before top-k/top-p/min-p "
    "truncation.")
IncludeReasoning = Annotated[bool, Field(
    strict=True, description="vLLM's: accepted; no effect here, as no reasoning parser is served "
                             "(the reasoning, if the model writes one, stays in the content).")]
IncludeStopStr = Annotated[bool, Field(
    strict=True, description="vLLM's: keep the stop string that ended the text at its end.")]
MaxTokens = Annotated[int, Field(
    strict=True, ge=1,
    description="Most tokens to generate, 1 up to the model's context length minus the prompt.")]
# /v1/completions also takes 0 with echo, as OpenAI's legacy API and vLLM do: the prompt scored.
CompletionMaxTokens = Annotated[int, Field(
    strict=True, ge=0,
    description="Most tokens to generate, 1 up to the model's context length minus the prompt; "
                "0 with echo: true scores the prompt (its text and, with logprobs, its tokens' "
                "logprobs, nothing generated shown).")]
# A week: past that a deadline is a typo, not a plan (and finished jobs are kept a day).
MAX_DEADLINE_S = 7 * 24 * 3600.0
QueueTimeoutS = Annotated[float | None, Field(
    strict=True, gt=0.0, le=MAX_DEADLINE_S,
    description="Seconds the job may wait for a worker, from submission: a job not started by "
                "then is never started (it ends with finish_reason 'expired'). Default: none.")]
DeadlineS = Annotated[float | None, Field(
    strict=True, gt=0.0, le=MAX_DEADLINE_S,
    description="Seconds the whole job may take, from submission: past it the job is never "
                "started, or ends at the next step with what it generated so far "
                "(finish_reason 'expired'). Default: none.")]
MAX_RETENTION_S = 30 * 24 * 3600
RetentionS = Annotated[int | None, Field(
    strict=True, ge=1, le=MAX_RETENTION_S,
    description="Seconds the job (status, result, token stream) is kept after it ends, finished, "
                "canceled or failed alike. Default: the server's CARPOOL_RESULT_TTL_S (failed: "
                "CARPOOL_FAILURE_TTL_S).")]

WebhookUrl = Annotated[str | None, Field(
    min_length=1, max_length=2048,
    description="Carpool's extension: an http(s) URL that gets the job's final event "
                "(job.completed, job.failed, job.canceled or job.expired) as a signed POST "
                "(Standard Webhooks; README, Webhooks). Its host must pass the server's "
                "CARPOOL_WEBHOOK_ALLOWED_HOSTS (400 otherwise). Default: none.")]

# The job spec's own check (protocol/messages.py) again, so a bad salt is a 400/422 naming it.
# (pydantic's str already refuses a lone surrogate: "unable to parse raw data as a unicode string".)
_SaltText = Annotated[str, Field(strict=True, min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
CacheSalt = Annotated[_SaltText | None, Field(
    description="vLLM's: salts the prefix cache for this request. Only requests with the same "
                "salt share cached prompt blocks (none: only unsalted ones), so another client "
                "cannot tell from `cached_tokens` or latency what you sent. Use a random secret, "
                f"e.g. 43 base64 characters (256 bits); 1 to {MAX_CACHE_SALT_CHARS} characters.")]


def _small_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    # OpenAI's limits on metadata, wherever an object keeps some.
    if value is None:
        return value
    if len(value) > 16:
        raise ValueError(f"at most 16 pairs (got {len(value)})")
    for key, item in value.items():
        if len(key) > 64 or len(item) > 512:
            raise ValueError(f"keys are at most 64 characters and values 512 (key '{key[:64]}')")
    return value


Metadata = Annotated[dict[str, str] | None, AfterValidator(_small_metadata), Field(
    description="Up to 16 key-value pairs (keys up to 64 characters, values up to 512), kept "
                "with the object.",
    # The same limits, documented (the validator above words their errors).
    json_schema_extra={"maxProperties": 16, "propertyNames": {"maxLength": 64},
                       "additionalProperties": {"maxLength": 512}})]


def _logit_bias_keys(value: dict[str, float] | None) -> dict[str, float] | None:
    # JSON object keys are strings: each must spell a token id (vocabulary checked per model).
    seen: set[int] = set()
    for key in value or {}:
        if not key.isascii() or not key.isdigit():
            raise ValueError(f"keys must be token ids (non-negative integers); got {key!r}")
        if int(key) in seen:
            raise ValueError(f"token id {int(key)} is given twice")
        seen.add(int(key))
    return value


StopTokenIds = Annotated[list[Annotated[int, Field(strict=True, ge=0)]], Field(
    max_length=MAX_STOP_TOKEN_IDS,
    description=f"Up to {MAX_STOP_TOKEN_IDS} token ids that end the generation like EOS (the "
                "token is kept in the output).")]
MinTokens = Annotated[int, Field(
    strict=True, ge=0,
    description="Generate at least this many tokens before EOS, stop_token_ids or a stop string "
                "may end the generation; at most max_tokens.")]
PresencePenalty = Annotated[float, Field(
    strict=True, ge=-MAX_PENALTY, le=MAX_PENALTY,
    description="-2 to 2: subtracted once from the logit of every token already generated.")]
FrequencyPenalty = Annotated[float, Field(
    strict=True, ge=-MAX_PENALTY, le=MAX_PENALTY,
    description="-2 to 2: subtracted from a token's logit once per time it was generated.")]
RepetitionPenalty = Annotated[float, Field(
    strict=True, ge=0.01, le=100.0,
    description="0.01 to 100 (1: off): for tokens of the prompt or output, positive logits are divided "
                "by it and negative ones multiplied (vLLM's and transformers' formula).")]
_LogitBiasMap = Annotated[
    dict[str, Annotated[float, Field(strict=True, ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
    Field(max_length=MAX_LOGIT_BIAS_ENTRIES,
          json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}})]
LogitBias = Annotated[
    _LogitBiasMap | None,
    AfterValidator(_logit_bias_keys),
    Field(description="Token id (as a string) to a bias from -100 to 100 added to its logit "
                      "before sampling: -100 bans the token, 100 all but forces it.")]
MinP = Annotated[float, Field(
    strict=True, ge=0.0, le=1.0,
    description="0 to 1 (0: off): drop tokens less likely than min_p times the most likely one.")]
TypicalP = Annotated[float, Field(
    strict=True, gt=0.0, le=1.0,
    description="Typical decoding, (0, 1] (1: off; TGI's and transformers' typical_p): keep the "
                "tokens whose surprise is nearest the distribution's entropy, up to this "
                "probability mass.")]
AllowedTokenIds = Annotated[
    Annotated[list[Annotated[int, Field(strict=True, ge=0)]],
              Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None,
    Field(description=f"vLLM's: only these token ids (1 to {MAX_ALLOWED_TOKEN_IDS} ids of the "
                      "model's vocabulary) may be generated: every other token's logit is -inf "
                      "before any other processing. Default: any token.")]


def _not_blank(value: str) -> str:
    # The worker tokenizes a bad word with its leading whitespace stripped (as vLLM): a blank one
    # would be no tokens, which vLLM refuses too.
    if not value.strip():
        raise ValueError("a bad word needs some text other than whitespace")
    return value


BadWord = Annotated[str, Field(strict=True, min_length=1, max_length=MAX_BAD_WORD_CHARS),
                    AfterValidator(_valid_unicode), AfterValidator(_not_blank)]
BadWords = Annotated[list[BadWord], Field(
    max_length=MAX_BAD_WORDS,
    description=f"vLLM's: up to {MAX_BAD_WORDS} words (of at most {MAX_BAD_WORD_CHARS} characters) "
                "the output may not contain. Each is tokenized as is and after a space; the last "
                "token of either is banned whenever the generated tokens so far end with its "
                "other tokens (a one-token word is never generated).")]

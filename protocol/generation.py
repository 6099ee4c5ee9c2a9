"""What a generation asks for (SamplingParams), what it yields (TokenEntry) and how it ends
(FinishReason).

The one sampling spec: the HTTP schemas build it, it travels inside the JobSpec through Redis,
and the engine's scheduler and sampler read it as is. A new knob is a field here, a field in the
schemas, and the code that honours it (the sampler): nothing copies fields by hand in between.
Pure standard library, so the engine may import it (the only protocol module it may).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, cast

from protocol.closed_objects import close_objects

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stubs only

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
# allowed_token_ids: vLLM sets no cap; this one bounds the per-step mask build and the job's size.
MAX_ALLOWED_TOKEN_IDS = 16384
# bad_words: each word bans up to two token sequences (with and without a leading space), so 64
# words stay within vLLM's VLLM_MAX_NUM_BAD_WORDS (128 sequences).
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
# vLLM's guard against temperatures so small that logits / temperature overflow to inf and the
# logprobs to NaN: below GREEDY_BELOW_TEMPERATURE a temperature means greedy, below
# MIN_SAMPLING_TEMPERATURE it samples at that (vLLM's _SAMPLING_EPS and _MAX_TEMP).
GREEDY_BELOW_TEMPERATURE = 1e-5
MIN_SAMPLING_TEMPERATURE = 1e-2
MAX_STRUCTURED_OUTPUT_CHARS = 256 * 1024  # a schema or grammar longer than this is refused


class FinishReason(str, Enum):
    """How a job (and its sequence) ended; the one vocabulary of engine, Redis and API."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens, or the context (max_model_len, or a KV pool too small for it)
    CANCELED = "canceled"  # canceled by its client, or aborted in the engine
    ERROR = "error"  # the job failed; the final stream entry carries the message
    EXPIRED = "expired"  # its deadline (or, before it started, its queue timeout) passed

    @property
    def openai_name(self) -> str:
        """The name OpenAI-compatible servers give it (vLLM says "abort" for a canceled request)."""
        return "abort" if self is FinishReason.CANCELED else self.value


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The log-probability of a sampled token and of the most likely tokens at its position.

    Of the distribution the sampler drew from after the request's processing (min_tokens masking,
    logit_bias, repetition/frequency/presence penalties, then temperature; greedy counts as
    temperature 1), before the top-k, top-p and min-p truncation: vLLM's `processed_logprobs`
    without the truncation. A token masked out (min_tokens) reads -9999.0, as in vLLM, not -inf.
    """

    logprob: float  # of the sampled token
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    # The token's rank in its distribution (1: the most likely), for vLLM's prompt_logprobs;
    # only prompt logprobs carry it (0: not computed).
    rank: int = dataclasses.field(default=0, compare=False)

    def encode(self) -> str:
        """Compact JSON for a stream entry field: [logprob, [[id, logprob], ...]]."""
        return json.dumps([self.logprob, [list(pair) for pair in self.top]], separators=(",", ":"))

    @classmethod
    def decode(cls, payload: str) -> TokenLogprobs:
        logprob, top = json.loads(payload)
        return cls(float(logprob), tuple((int(i), float(lp)) for i, lp in top))


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A job's prompt logprobs: the prompt's token ids (as the worker tokenized it) and, per
    token, its logprob given the tokens before it with the most likely there (the raw model
    distribution); the first token has none (nothing precedes it)."""

    token_ids: tuple[int, ...]
    entries: tuple[TokenLogprobs | None, ...]

    def encode(self) -> str:
        """Compact JSON for the job's state hash: [[id, ...], [null, [logprob, [[id, lp], ...], rank], ...]]."""
        return json.dumps([list(self.token_ids),
                           [None if e is None else [e.logprob, [list(pair) for pair in e.top], e.rank]
                            for e in self.entries]], separators=(",", ":"))

    @classmethod
    def decode(cls, payload: str) -> PromptLogprobs:
        token_ids, entries = json.loads(payload)
        return cls(tuple(int(i) for i in token_ids), tuple(
            None if e is None else TokenLogprobs(float(e[0]), tuple((int(i), float(lp)) for i, lp in e[1]),
                                                 int(e[2]))
            for e in entries))


@dataclass(frozen=True, slots=True)
class TokenEntry:
    """One generated token: what the engine emits and what a job's stream records."""

    index: int  # position in the request's output, 0-based
    token_id: int
    # The text this token releases: "" while held back (a partial UTF-8 character or the possible
    # start of a stop string); it may carry held-back text of earlier tokens.
    text: str
    logprobs: TokenLogprobs | None = None  # only when the request asked for logprobs


class StructuredOutputKind(str, Enum):
    """What a structured-output constraint's `spec` holds (the grammar engine's format names)."""

    JSON_SCHEMA = "json_schema"  # a JSON schema, as JSON text
    REGEX = "regex"
    CHOICE = "choice"  # a JSON array of the strings allowed, as JSON text
    GRAMMAR = "grammar"  # a Lark or GBNF grammar


# How a JSON-schema constraint is compiled (llguidance's JSON compile options): whitespace between
# JSON tokens is bounded, since small models otherwise spin in newlines until max_tokens; 32 still
# fits deeply indented JSON. A schema's own "x-guidance" may change it.
JSON_COMPILE_DEFAULTS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}"}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the generated text: the sampler masks every token that would leave it.

    Plain text both ways so that it hashes (the worker caches compiled grammars by it) and
    crosses Redis as is; the API compiles it once at submit, so a worker never meets a bad one.
    """

    kind: StructuredOutputKind
    spec: str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, StructuredOutputKind):
            raise ValueError(f"structured_output kind must be a StructuredOutputKind, got {self.kind!r}")
        if not isinstance(self.spec, str) or not self.spec:
            raise ValueError(f"structured_output spec must be a non-empty string, got {self.spec!r}")
        if len(self.spec) > MAX_STRUCTURED_OUTPUT_CHARS:
            raise ValueError(f"structured_output spec may be at most {MAX_STRUCTURED_OUTPUT_CHARS} "
                             f"characters, got {len(self.spec)}")

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind.value, "spec": self.spec}

    @classmethod
    def from_dict(cls, data: Any) -> StructuredOutput:
        if not isinstance(data, dict) or set(data) != {"kind", "spec"}:
            raise ValueError(f"structured_output must be an object with kind and spec, got {data!r}")
        try:
            kind = StructuredOutputKind(data["kind"])
        except ValueError:
            kinds = [kind.value for kind in StructuredOutputKind]
            raise ValueError(f"structured_output kind must be one of {kinds}, got {data['kind']!r}") from None
        return cls(kind, data["spec"])


def grammar_of(constraint: StructuredOutput) -> str:
    """The llguidance grammar `constraint` compiles to (JSON schemas with JSON_COMPILE_DEFAULTS,
    their objects closed: protocol.closed_objects):
    the one compile the API checks a constraint with at submit and the worker runs, so a
    constraint the API accepts is one the worker compiles. ValueError where it does not compile.
    llguidance is imported on first use: a process that never sees a constraint runs without it."""
    import llguidance

    if constraint.kind is StructuredOutputKind.JSON_SCHEMA:
        try:
            spec = json.dumps(close_objects(json.loads(constraint.spec)))
        except (ValueError, RecursionError):
            # Not JSON, or nested past Python's stack: llguidance's own error names what is wrong.
            spec = constraint.spec
        return llguidance.LLMatcher.grammar_from_json_schema(
            spec, defaults=cast("JsonCompileOptions", JSON_COMPILE_DEFAULTS))
    return llguidance.grammar_from(constraint.kind.value, constraint.spec)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0.0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended it is kept
    skip_special_tokens: bool = True  # vLLM's: false writes special tokens' text (not EOS's)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # end the generation like EOS (the token is kept)
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end it before this many
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # over prompt and output: positive logits / it, negative * it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), by id
    min_p: float = 0.0  # drop tokens below min_p times the most likely token's probability
    # Typical decoding (Meister et al., 2022; TGI's typical_p): keep the tokens whose surprise is
    # nearest the distribution's entropy, up to this much probability mass; 1.0 is off.
    typical_p: float = 1.0
    # vLLM's: only these token ids may be drawn (every other logit is -inf); None: any.
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: texts the output may not contain; the worker tokenizes each (as is and after a
    # space) and bans a sequence's last token whenever the output so far ends with the rest.
    bad_words: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k most likely
    # vLLM's: keep only the prompt's last k tokens (left truncation, after any chat template);
    # -1: as many as the model's context holds; None: the whole prompt.
    truncate_prompt_tokens: int | None = None
    # None: none; k: each prompt token's logprob given the tokens before it (the raw model
    # distribution), with the k most likely there; the first prompt token has none.
    prompt_logprobs: int | None = None
    # Whether the sampler has any of the above to do (processing or logprobs): computed once here,
    # so that a step of plain requests pays one attribute read per row to learn it has none.
    has_extras: bool = dataclasses.field(init=False, repr=False, compare=False, default=False)
    structured_output: StructuredOutput | None = None  # None: any text

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be at least 0.0, got {self.temperature}")
        if 0.0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0 if self.temperature < GREEDY_BELOW_TEMPERATURE
                               else MIN_SAMPLING_TEMPERATURE)
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0.0, 1.0], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int, got {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be at least 0 (0 turns it off), got {self.top_k}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an int or None, got {self.seed!r}")
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")
        if isinstance(self.stop, str) or not isinstance(self.stop, tuple):
            raise ValueError(f"stop must be a tuple of strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop strings must be non-empty strings, got {text!r}")
            if len(text) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters, got {len(text)}"
                )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput, got {self.structured_output!r}")
        self._check_processing()
        object.__setattr__(self, "has_extras", self.is_processed or self.logprobs is not None)

    def _check_processing(self) -> None:
        """The logits processing fields (penalties, bias, min_tokens, min_p, logprobs)."""
        if isinstance(self.stop_token_ids, str) or not isinstance(self.stop_token_ids, tuple):
            raise ValueError(f"stop_token_ids must be a tuple of ints, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"stop_token_ids must hold non-negative ints, got {token_id!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int at least 0, got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}")
        if (not _is_real(self.repetition_penalty) or not math.isfinite(self.repetition_penalty)
                or self.repetition_penalty <= 0.0):
            raise ValueError(f"repetition_penalty must be a finite number above 0, "
                             f"got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, tuple):
            raise ValueError(f"logit_bias must be a tuple of (token id, bias) pairs, got {self.logit_bias!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                             f"got {len(self.logit_bias)}")
        seen: set[int] = set()
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
            token_id, bias = pair
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias token ids must be non-negative ints, got {token_id!r}")
            if token_id in seen:
                raise ValueError(f"logit_bias names token {token_id} twice")
            seen.add(token_id)
            if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias!r} for token {token_id}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0.0, 1.0], got {self.min_p!r}")
        if not _is_real(self.typical_p) or not 0.0 < self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0.0, 1.0], got {self.typical_p!r}")
        self._check_allowed_token_ids()
        self._check_bad_words()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be None or an int at least 0, got {value!r}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (not _is_int(truncate) or (truncate < 1 and truncate != -1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an int at least 1, "
                             f"got {truncate!r}")

    def _check_allowed_token_ids(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is None:
            return
        if isinstance(allowed, str) or not isinstance(allowed, tuple):
            raise ValueError(f"allowed_token_ids must be None or a tuple of ints, got {allowed!r}")
        if not allowed:  # vLLM refuses it too: an empty whitelist leaves nothing to draw
            raise ValueError("allowed_token_ids must hold at least one token id (None: any token)")
        if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"allowed_token_ids may hold at most {MAX_ALLOWED_TOKEN_IDS} ids, "
                             f"got {len(allowed)}")
        for token_id in allowed:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"allowed_token_ids must hold non-negative ints, got {token_id!r}")

    def _check_bad_words(self) -> None:
        words = self.bad_words
        if isinstance(words, str) or not isinstance(words, tuple):
            raise ValueError(f"bad_words must be a tuple of strings, got {words!r}")
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words may hold at most {MAX_BAD_WORDS} strings, got {len(words)}")
        for word in words:
            # vLLM tokenizes a word with its leading whitespace stripped: one that is all
            # whitespace tokenizes to nothing, which vLLM refuses as it refuses "".
            if not isinstance(word, str) or not word.lstrip():
                raise ValueError(f"bad_words must hold strings with some non-whitespace text, "
                                 f"got {word!r}")
            if len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad_words strings may be at most {MAX_BAD_WORD_CHARS} "
                                 f"characters, got {len(word)}")

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def is_processed(self) -> bool:
        """Whether its logits need more than temperature and truncation (penalties, bias, a
        min_tokens mask, allowed_token_ids or bad_words): batches where no row does skip that work."""
        return (self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0
                or self.allowed_token_ids is not None or bool(self.bad_words))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def truncated_prompt_length(self, length: int, context: int) -> int:
        """How many of a `length`-token prompt's tokens the model sees (truncate_prompt_tokens)
        with a `context`-token model: the prompt's last ones."""
        keep = context if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return length if keep is None else min(length, keep)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (tuples as lists; logit_bias as OpenAI's {"id": bias} object).
        The logits-processing fields and the structured output are left out at their defaults, so
        a job that uses none of them reads the same to a worker that predates them."""
        data = {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)
                if f.init and (f.name not in _OMITTED_AT_DEFAULT or getattr(self, f.name) != f.default)}
        if "logit_bias" in data:
            data["logit_bias"] = {str(token_id): bias for token_id, bias in self.logit_bias}
        if self.structured_output is None:
            del data["structured_output"]
        else:
            data["structured_output"] = self.structured_output.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Inverse of to_dict; unknown or bad fields raise ValueError naming them."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling params must be a JSON object, got {type(data).__name__}")
        return cls.from_fields(data, strict=True)

    @classmethod
    def from_fields(cls, source: dict[str, Any], strict: bool = False) -> SamplingParams:
        """Build from the sampling fields of a larger mapping (a request body's fields, say); the
        others are left alone unless `strict`. Lists become tuples."""
        names = cls.field_names()
        if strict and (unknown := sorted(set(source) - names)):
            raise ValueError(f"sampling params have unknown fields: {', '.join(unknown)}")
        values: dict[str, Any] = {name: tuple(v) if isinstance(v := source[name], list) else v
                  for name in names if name in source}
        if "logit_bias" in values:
            values["logit_bias"] = _bias_pairs(values["logit_bias"])
        if isinstance(values.get("structured_output"), dict):
            values["structured_output"] = StructuredOutput.from_dict(values["structured_output"])
        return cls(**values)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls) if f.init)


_OMITTED_AT_DEFAULT = frozenset({
    "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
    "stop_token_ids", "min_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p",
    "typical_p", "logprobs", "prompt_logprobs", "allowed_token_ids", "bad_words"})


def _bias_pairs(value: Any) -> Any:
    """OpenAI's {"token id": bias} object (or None) as sorted (id, bias) pairs; other shapes are
    left for the checks to name."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        return value
    pairs = []
    for key, bias in value.items():
        if isinstance(key, str):
            try:
                key = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        pairs.append((key, bias))
    return tuple(sorted(pairs, key=lambda pair: pair[0] if _is_int(pair[0]) else -1))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

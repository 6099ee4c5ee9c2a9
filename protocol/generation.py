"""What a generation asks for (SamplingParams), what it yields (TokenEntry) and how it ends
(FinishReason).

The one sampling spec: the HTTP schemas build it, it travels inside the JobSpec through Redis,
and the engine's scheduler and sampler read it as is. A new knob is a field here, a field in the
schemas, and the code that honours it (the sampler): nothing copies fields by hand in between.
Pure standard library, so the engine may import it (the only protocol module it may).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_STRUCTURED_OUTPUT_CHARS = 256 * 1024  # a schema or grammar longer than this is refused


class FinishReason(str, Enum):
    """How a job (and its sequence) ended; the one vocabulary of engine, Redis and API."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens, or the context (max_model_len, or a KV pool too small for it)
    CANCELED = "canceled"  # canceled by its client, or aborted in the engine
    ERROR = "error"  # the job failed; the final stream entry carries the message

    @property
    def openai_name(self) -> str:
        """The name OpenAI-compatible servers give it (vLLM says "abort" for a canceled request)."""
        return "abort" if self is FinishReason.CANCELED else self.value


@dataclass(frozen=True, slots=True)
class TokenEntry:
    """One generated token: what the engine emits and what a job's stream records."""

    index: int  # position in the request's output, 0-based
    token_id: int
    # The text this token releases: "" while held back (a partial UTF-8 character or the possible
    # start of a stop string); it may carry held-back text of earlier tokens.
    text: str


class StructuredOutputKind(str, Enum):
    """What a structured-output constraint's `spec` holds (the grammar engine's format names)."""

    JSON_SCHEMA = "json_schema"  # a JSON schema, as JSON text
    REGEX = "regex"
    CHOICE = "choice"  # a JSON array of the strings allowed, as JSON text
    GRAMMAR = "grammar"  # a Lark or GBNF grammar


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


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0.0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
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
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput, got {self.structured_output!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (tuples as lists)."""
        data = {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}
        # Left out when unset, so unconstrained jobs read the same as before the field existed.
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
        if isinstance(values.get("structured_output"), dict):
            values["structured_output"] = StructuredOutput.from_dict(values["structured_output"])
        return cls(**values)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

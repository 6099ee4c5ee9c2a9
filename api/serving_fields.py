"""OpenAI's request fields about how a request is served rather than what is generated, shared
by chat completions and responses: the service tier (which picks a Carpool queue), and the
prompt-cache, safety and moderation settings.

Those that cannot change an answer here are accepted (a client that always sends them works);
moderation, which OpenAI applies to the input and output, is refused: ignoring it would let
through what the client asked to have blocked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, field_validator

from api.errors import InvalidRequestError
from protocol import Priority

ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]

# OpenAI's priority processing (and its `fast` alias) is Carpool's high queue, flex processing
# (cheaper, slower) the low one; the others are the standard tier, which leaves `priority` alone.
_TIER_QUEUES: dict[str, Priority] = {"priority": Priority.HIGH, "fast": Priority.HIGH,
                                     "flex": Priority.LOW}
# The tier an answer names, as OpenAI's do: the processing actually used.
_TIER_SERVED: dict[str, str] = {"auto": "default", "default": "default", "scale": "default",
                                "flex": "flex", "priority": "priority", "fast": "priority"}


class ServingFields(BaseModel):
    """Mixed into a request schema that has a `priority` field."""

    service_tier: ServiceTier | None = Field(
        None, description="OpenAI's processing tier as a Carpool queue: priority (or fast) waits "
                          "in the high queue, flex in the low one; auto, default and scale leave "
                          "`priority` as given. The answer names the tier used.")
    safety_identifier: str | None = Field(None, description="Accepted and ignored.")
    prompt_cache_key: str | None = Field(
        None, description="Accepted and ignored (the prefix cache works on every request).")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="Accepted and ignored (cached prefixes stay while the KV pool has room).")
    prompt_cache_options: dict[str, Any] | None = Field(
        None, description="Accepted and ignored, as prompt_cache_retention.")
    moderation: dict[str, Any] | None = Field(
        None, description="Not available: moderation of the input and output is not run here.")

    if TYPE_CHECKING:
        priority: Priority

    @field_validator("moderation")
    @classmethod
    def _no_moderation(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise ValueError("moderation is not available on this server: leave it out")
        return value

    def queue_priority(self) -> Priority:
        """The queue the request waits in: its service tier's, else its `priority`. Both given
        and naming different queues is a 400: neither can be chosen over the other silently."""
        queue = _TIER_QUEUES.get(self.service_tier or "")
        if queue is None:
            return self.priority
        if "priority" in self.model_fields_set and self.priority is not queue:
            raise InvalidRequestError(
                f"'service_tier' {self.service_tier!r} waits in the {queue.value} queue but "
                f"'priority' asks for {self.priority.value}: send one of them",
                param="service_tier")
        return queue

    @property
    def tier_served(self) -> str | None:
        """The service_tier the answer names; None (left out) when the request named none."""
        return None if self.service_tier is None else _TIER_SERVED[self.service_tier]

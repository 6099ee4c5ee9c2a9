"""Per-API-key policies: the key's fair-share weight and its limits (queued jobs, tokens per
minute), from the settings, looked up by owner id (the hash of the key that JobSpec.owner holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from api.auth import owner_id


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    weight: float = 1.0  # share of seats when keys compete (worker/jobs/fair_share.py)
    max_queued_jobs: int = 0  # jobs of the key waiting in a model's queues; 0: no limit
    tokens_per_minute: int = 0  # prompt + max_tokens admitted per minute; 0: no limit


@dataclass(frozen=True, slots=True)
class KeyPolicies:
    default: KeyPolicy = KeyPolicy()
    by_owner: dict[str, KeyPolicy] = field(default_factory=dict)

    def for_owner(self, owner: str) -> KeyPolicy:
        return self.by_owner.get(owner, self.default)

    @classmethod
    def build(cls, api_keys: list[str], default: KeyPolicy, weights: dict[str, float],
              max_queued_jobs: dict[str, int], tokens_per_minute: dict[str, int]) -> KeyPolicies:
        """Each key's policy: the default, with the key's own settings over it (keys are the raw
        bearer keys, as in CARPOOL_API_KEYS)."""
        by_owner = {}
        for key in api_keys:
            by_owner[owner_id(key)] = KeyPolicy(
                weight=weights.get(key, default.weight),
                max_queued_jobs=max_queued_jobs.get(key, default.max_queued_jobs),
                tokens_per_minute=tokens_per_minute.get(key, default.tokens_per_minute))
        return cls(default, by_owner)

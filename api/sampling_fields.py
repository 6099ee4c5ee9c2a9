"""The sampling fields every generating route declares alike: /v1/jobs, /v1/completions,
/v1/chat/completions and, as vLLM's extras there, /v1/responses. Declared once, so that their
bounds, defaults and documentation are the same on each."""

from __future__ import annotations

from pydantic import BaseModel

from api.fields import (
    CacheSalt,
    FrequencyPenalty,
    IgnoreEos,
    IncludeStopStr,
    LogitBias,
    MinP,
    PresencePenalty,
    RepetitionPenalty,
    Seed,
    SkipSpecialTokens,
    StopStrings,
    StopTokenIds,
    TopK,
)


class SharedSamplingFields(BaseModel):
    top_k: TopK = 0
    min_p: MinP = 0.0
    presence_penalty: PresencePenalty = 0.0
    frequency_penalty: FrequencyPenalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    seed: Seed = None
    stop: StopStrings = []
    stop_token_ids: StopTokenIds = []
    ignore_eos: IgnoreEos = False
    logit_bias: LogitBias = None
    skip_special_tokens: SkipSpecialTokens = True
    include_stop_str_in_output: IncludeStopStr = False
    cache_salt: CacheSalt = None

"""The webhook dispatcher's one settings object (environment prefix CARPOOL_), built once."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from protocol.webhook_urls import WebhookAllowList
from webhooks.signing import secret_key


class DispatcherSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CARPOOL_", extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding the event stream.")
    keys_prefix: str = Field("carpool", description="Prefix of every Carpool key (protocol.Keys).")
    webhook_secret: str = Field(
        description="Signing secret, 'whsec_' + base64 of 24 to 64 random bytes (Standard "
                    "Webhooks); receivers verify webhook-signature with it.")
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Host patterns and networks webhooks may reach (protocol/webhook_urls.py); "
                    "empty: any public address.")
    webhook_max_attempts: int = Field(8, ge=1, le=100,
                                      description="Deliveries tried before the dead letter.")
    webhook_backoff_base_s: float = Field(
        2.0, gt=0, description="Wait before the 2nd attempt; doubled per attempt, with jitter.")
    webhook_backoff_max_s: float = Field(600.0, gt=0, description="Longest wait between attempts.")
    webhook_timeout_s: float = Field(10.0, gt=0, le=120, description="One POST's time limit.")
    webhook_claim_idle_s: float = Field(
        60.0, gt=0,
        description="An event pending this long with a consumer that is not waiting on its retry "
                    "time (a dead dispatcher's) is claimed by another (XAUTOCLAIM).")
    webhook_concurrency: int = Field(8, ge=1, le=256, description="Deliveries in flight at once.")
    webhook_batch: int = Field(32, ge=1, le=1000, description="Events read per XREADGROUP.")
    consumer_name: str = Field("", description="This dispatcher's consumer name; default host-pid.")
    log_level: str = Field("info")

    @field_validator("webhook_allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: object) -> object:
        if isinstance(value, str):
            return [entry.strip() for entry in value.split(",") if entry.strip()]
        return value

    @field_validator("webhook_secret")
    @classmethod
    def _valid_secret(cls, value: str) -> str:
        secret_key(value)
        return value

    @model_validator(mode="after")
    def _claim_after_timeout(self) -> DispatcherSettings:
        WebhookAllowList.parse(self.webhook_allowed_hosts)  # a bad entry fails at start
        if self.webhook_claim_idle_s <= 2 * self.webhook_timeout_s:
            # Else a live dispatcher's delivery still in flight could be claimed and sent twice.
            raise ValueError("CARPOOL_WEBHOOK_CLAIM_IDLE_S must exceed twice "
                             "CARPOOL_WEBHOOK_TIMEOUT_S")
        return self

    @property
    def allow_list(self) -> WebhookAllowList:
        return WebhookAllowList.parse(self.webhook_allowed_hosts)

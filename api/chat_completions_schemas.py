"""Stored chat completions' request bodies and the documented shapes of their answers, in
OpenAI's field names (api/routes_chat_completions.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from api.fields import Metadata
from api.item_pages import ItemList
from api.openai_schemas import ChatCompletion


class StoredChatCompletionObject(ChatCompletion):
    metadata: dict[str, str] = Field(description="The metadata kept with it.")


class ChatCompletionList(ItemList):
    """A page of them: the list envelope every item list has, its items typed for the docs."""

    data: list[StoredChatCompletionObject] = Field(  # type: ignore[assignment]
        description="The stored completions.")


class ChatCompletionUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"metadata": {"topic": "demo"}}]})

    metadata: Metadata = Field(description="The completion's new metadata (replaces the old; "
                                           "null clears it).")


class DeletedChatCompletion(BaseModel):
    id: str = Field(description="The completion deleted.")
    object: Literal["chat.completion.deleted"] = Field("chat.completion.deleted",
                                                       description="The kind of object.")
    deleted: bool = Field(description="Always true.")

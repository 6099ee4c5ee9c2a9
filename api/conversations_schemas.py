"""The Conversations API's request bodies and the documented shapes of its answers, in OpenAI's
field names. Items are the Responses input's kinds (messages, function calls and their outputs),
checked and normalized as a Responses input is (api/responses_schemas.py), at most 20 a request
as OpenAI takes them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from api.fields import Metadata
from api.responses_schemas import normalized_item

MAX_ITEMS_PER_REQUEST = 20


def _items(value: Any) -> Any:
    if not isinstance(value, list):
        raise ValueError("give a list of items (messages, function calls, function call outputs)")
    if len(value) > MAX_ITEMS_PER_REQUEST:
        raise ValueError(f"at most {MAX_ITEMS_PER_REQUEST} items a request (got {len(value)})")
    return [normalized_item(item, f"items[{number}]") for number, item in enumerate(value)]


Items = Annotated[list[dict[str, Any]], BeforeValidator(
    _items, json_schema_input_type=list[dict[str, Any]])]


class ConversationCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"items": [{"type": "message", "role": "user", "content": "Hello!"}],
         "metadata": {"topic": "demo"}},
    ]})

    items: Items | None = Field(None, description="Up to 20 items the conversation starts with.")
    metadata: Metadata = None


class ConversationUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metadata: Metadata = Field(description="The conversation's new metadata (replaces the old).")


class ItemsCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: Annotated[Items, Field(min_length=1)] = Field(
        description="1 to 20 items to add at the conversation's end.")


class ConversationObject(BaseModel):
    id: str = Field(description="conv_<hex>.")
    object: Literal["conversation"] = Field("conversation", description="The kind of object.")
    created_at: int = Field(description="Creation time, seconds since the epoch.")
    metadata: dict[str, str] = Field(description="As given.")


class DeletedConversation(BaseModel):
    id: str = Field(description="The conversation deleted.")
    object: Literal["conversation.deleted"] = Field("conversation.deleted",
                                                    description="The kind of object.")
    deleted: bool = Field(description="Always true.")


"""A multipart/form-data body (RFC 7578) parsed with the standard library's MIME parser, for the
one route that takes uploads (POST /v1/files): no extra dependency for a single form."""

from __future__ import annotations

import email.parser
import email.policy
from dataclasses import dataclass
from email.message import EmailMessage

from api.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class FormField:
    name: str
    value: bytes
    filename: str | None = None  # set for a file part


def parse_form(content_type: str, body: bytes) -> dict[str, FormField]:
    """The form's fields by name (the first of a repeated name); 400 naming what is wrong."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequestError(
            f"Send the file as multipart/form-data (fields 'file' and 'purpose'), not "
            f"'{content_type or 'no Content-Type'}'", param="file")
    # The parser reads a MIME document: the body with its Content-Type header in front.
    document = b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(document)
    if not isinstance(message, EmailMessage) or not message.is_multipart():
        raise InvalidRequestError("The multipart body could not be parsed: check its boundary",
                                  param="file")
    fields: dict[str, FormField] = {}
    for part in message.iter_parts():
        if not isinstance(part, EmailMessage):
            continue
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str) or name in fields:
            continue
        payload = part.get_payload(decode=True)
        fields[name] = FormField(name, payload if isinstance(payload, bytes) else b"",
                                 part.get_filename())
    return fields

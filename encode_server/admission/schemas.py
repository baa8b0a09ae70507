"""The HTTP request bodies (pydantic models) and the one function that turns errors into messages.

Types are strict: a string where an int belongs is a 400 naming the field, not a silent coercion.
Unknown fields are ignored, so routers that send extra keys (as SGLang's does) still work.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

MODALITIES = ("image", "audio", "video")


class EncodeRequest(BaseModel):
    """`POST /encode` (docs/CONTRACT.md, section 2)."""

    model_config = ConfigDict(extra="ignore")

    req_id: Annotated[StrictStr, Field(min_length=1, max_length=512)]
    modality: StrictStr
    mm_items: Annotated[list[Any], Field(min_length=1)]
    num_parts: Annotated[StrictInt, Field(ge=1)] = 1
    part_idx: Annotated[StrictInt, Field(ge=0)] = 0
    prefill_host: StrictStr | None = None
    embedding_port: StrictInt | list[StrictInt] | None = None
    return_embedding: StrictBool = False
    timeout_s: Annotated[StrictFloat | StrictInt, Field(gt=0)] | None = None
    priority: Annotated[StrictInt, Field(ge=0)] = 0  # higher first; the server caps it (--max-priority)

    @field_validator("modality")
    @classmethod
    def _known_modality(cls, value: str) -> str:
        lowered = value.lower()
        if lowered not in MODALITIES:
            raise ValueError(f"must be one of {', '.join(MODALITIES)}, got {value!r}")
        return lowered

    @model_validator(mode="after")
    def _part_in_range(self) -> EncodeRequest:
        if self.part_idx >= self.num_parts:
            raise ValueError(f"part_idx {self.part_idx} must be below num_parts {self.num_parts}")
        return self


class ReceiveUrlRequest(BaseModel):
    """`POST /scheduler_receive_url`: a prefill rank asks to be sent a request's embedding."""

    model_config = ConfigDict(extra="ignore")

    req_id: Annotated[StrictStr, Field(min_length=1, max_length=512)]
    receive_url: Annotated[StrictStr, Field(min_length=1, max_length=512)]
    receive_count: Annotated[StrictInt, Field(ge=1, le=4096)] = 1


def describe_validation_error(error: ValidationError) -> str:
    """`field: problem; field: problem` for the first few problems."""
    parts = []
    for item in error.errors()[:5]:
        location = ".".join(str(part) for part in item["loc"]) or "body"
        message = item["msg"].removeprefix("Value error, ")
        parts.append(f"{location}: {message}")
    more = len(error.errors()) - len(parts)
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


def request_id_of(payload: Any) -> str | None:
    """The `req_id` of a payload when it has a usable one (for error bodies)."""
    if isinstance(payload, dict) and isinstance(payload.get("req_id"), str):
        return payload["req_id"][:512]
    return None

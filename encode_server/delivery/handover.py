"""The hand-over: how an encoded part leaves the server, the one seam between the service and the ways
rows reach their consumers.

One `Handover` is chosen when the runtime is built, never per request: `destinations.Delivery` (rows
pushed over ZMQ to the request's destinations and registered receivers), unless a front's receivers pull
the rows themselves, in which case that front gives the runtime its own (SGLang's mooncake backend:
`fronts.sglang.mooncake.SglangMooncakeStager` stages the rows until each receiver rank pulls them). The
service calls it at three points of a request, each with the request's `Destinations`: `layouts_known`
before the forward, `hand_over` with the rows, `failed` when the request fails after admission.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

from encode_server.records import EncodedPart, EncodeError, LayoutsKnown, PartMeta


@dataclass(frozen=True)
class Destinations:
    """Where one request part goes, as its request said."""

    meta: PartMeta
    #: `tcp://host:port` endpoints the request named (`prefill_host` + `embedding_port`).
    endpoints: tuple[str, ...] = ()
    #: The caller gets the rows in the response (`return_embedding`).
    inline: bool = False
    #: Its receivers register through `/scheduler_receive_url` (`prefill_host` without `embedding_port`).
    registered: bool = False


@dataclass(frozen=True)
class HandedOver:
    """What a hand-over did: seconds spent moving rows (0.0: none moved yet), and fields the response adds."""

    transfer_s: float = 0.0
    fields: Mapping[str, int | float | str] = field(default_factory=dict)


class Handover(ABC):
    """Hands a part's rows to their consumers (or keeps them for the consumers to pull)."""

    def layouts_known(self, to: Destinations) -> LayoutsKnown | None:
        """What to call with the part's layouts once they are known, before the forward (receivers that
        size their buffers ahead); None: nothing (the default)."""
        return None

    @abstractmethod
    async def hand_over(self, to: Destinations, part: EncodedPart) -> HandedOver:
        """Hand the encoded part over; an `EncodeError` (502: a destination did not take it) fails the request."""

    @abstractmethod
    def failed(self, to: Destinations, error: EncodeError) -> None:
        """The request failed after admission (`error`): tell whoever waits for its rows, without waiting."""

"""The one router-side object of a request, from admission to its last byte."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.admission.admit import Admission
from router.edge.openai_types import ResponseFormat
from router.placement.place_call import Placement
from router.relay.progress import ChoiceProgress
from shared.wire import GenerationRequest


@dataclass
class RoutedRequest:
    """What was admitted (one GenerationRequest per choice), where each choice was placed, how
    its answer is shaped, and each choice's progress once the relay starts."""

    admission: Admission
    placements: list[Placement]
    fmt: ResponseFormat | None = None
    stream: bool = False
    include_usage: bool = False
    progress: list[ChoiceProgress] = field(default_factory=list)

    @property
    def gens(self) -> list[GenerationRequest]:
        return self.admission.requests

    @property
    def model(self) -> str:
        return self.gens[0].model

    def start_relay(self) -> list[ChoiceProgress]:
        """Each choice's progress (completions' `echo`: its prompt text comes first; a chat
        request's tool-call splitter, which admission made, splits each choice's text)."""
        echoes = self.admission.echo or [None] * len(self.gens)
        tools = self.admission.tool_streams
        self.progress = [
            ChoiceProgress(gen, tool_streams=tools, echo=echo, counted=i == 0)
            for i, (gen, echo) in enumerate(zip(self.gens, echoes, strict=True))
        ]
        return self.progress

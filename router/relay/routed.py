"""The one router-side object of a request, from admission to its last byte."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from router.admission.admit import Admission
from router.admission.tool_calls import ToolCallStream
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

    @property
    def tool_streams(self) -> Callable[[], ToolCallStream] | None:
        """A chat request with tools on a template whose tool-call format is known: makes each
        choice's splitter of its text into content and tool calls (router.admission.tool_calls)."""
        return self.admission.tool_streams

    def start_relay(self) -> list[ChoiceProgress]:
        """Each choice's progress (completions' `echo`: its prompt text comes first)."""
        echoes = self.admission.echo or [None] * len(self.gens)
        self.progress = [
            ChoiceProgress(gen, tool_streams=self.tool_streams, echo=echo, counted=i == 0)
            for i, (gen, echo) in enumerate(zip(self.gens, echoes, strict=True))
        ]
        return self.progress

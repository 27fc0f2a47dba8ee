"""rq intake for embedding jobs: the broker's RqIntake (dequeue, start, registries, endings),
reading an EmbeddingRequest from each job instead of a GenerationRequest."""

from __future__ import annotations

from dataclasses import dataclass

from rq.executions import Execution
from rq.job import Job

from shared.embedding_wire import EmbeddingRequest
from worker.broker.intake import RqIntake, TakenJob, _describe


@dataclass(eq=False)
class EmbeddingJob(TakenJob):
    """A taken embedding job: `embedding` is its request, None when its payload is malformed
    (`error` says why); a TakenJob, so the publisher ends it like any other."""

    embedding: EmbeddingRequest | None = None


class EmbeddingIntake(RqIntake):
    @staticmethod
    def _parse(job: Job, execution: Execution) -> TakenJob:
        try:
            kwargs = job.kwargs
            if not isinstance(kwargs, dict):
                raise ValueError(f"the job's kwargs are a {type(kwargs).__name__}, not a map")
            request = EmbeddingRequest.from_wire(kwargs.get("embedding"))
        except Exception as exc:  # any payload the router would not have written
            error = f"malformed embedding job payload: {_describe(exc)}"
            return EmbeddingJob(job, execution, None, error)
        return EmbeddingJob(job, execution, None, embedding=request)

"""The function name rq records for generation jobs (shared.wire.JOB_FUNC).

The batching worker (worker.broker.intake) runs these jobs in its engine and never calls this. It
exists so that a job picked up by a stock rq worker by mistake fails loudly instead of hanging.
"""


def generate(request: dict) -> None:
    raise RuntimeError(
        "mlxcel generation jobs run in an mlxcel-pool worker (`mlxcel-pool worker`), "
        "not in a stock rq worker"
    )

"""The function name rq records for embedding jobs (shared.embedding_wire.EMBED_JOB_FUNC).

The embedding worker runs these jobs in its own loop and never calls this: a stock rq worker
that picks one up by mistake fails it loudly instead of hanging."""


def embed(request: dict) -> None:
    raise RuntimeError(
        "mlxcel embedding jobs run in an mlxcel-pool embedding worker (`mlxcel-pool worker "
        "--model <an embedding model>`), not in a stock rq worker"
    )

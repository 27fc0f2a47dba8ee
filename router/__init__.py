"""The mlxcel-pool router: an OpenAI-compatible FastAPI front that tokenizes, admits, enqueues
(rq over Redis) and streams tokens back from worker-written Redis streams. Never imports mlx."""

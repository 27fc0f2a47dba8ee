"""The embedding worker: a worker whose model's config.json says `"mlxcel_task": "embedding"`
registers its model like a generation worker (roster, info hash with `task = embedding`, rq),
takes `/v1/embeddings` jobs from its model's queue and answers each with its inputs' pooled,
L2-normalized last hidden states (task.py decides, model.py computes, batcher.py batches,
intake.py reads jobs, loop.py runs it, main.py builds it)."""

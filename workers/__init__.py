"""A worker: four layers, each importing only those before it (docs/architecture.md, "Layers").

    workers/values/      plain values and their checks (no torch, Ray or Redis)
    workers/scheduling/  the scheduler, the policies, the KV block accounting (pure)
    workers/engine/      torch: models, the engine's step, model runner, sampling
    workers/actors/      Ray: the worker actor, its settings, tensor-parallel ranks

Nothing is re-exported here on purpose: import from the modules. `workers.policies`, `workers.scheduling_policy`,
`workers.scheduler` and `workers.kv_cache_manager` are the old names of `workers.scheduling`'s modules, kept for
code written against them.
"""

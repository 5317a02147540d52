"""Worker side: models, engine, model runner, KV cache manager, scheduler and policies, sampling.

Import from the modules (`workers.engine`, `workers.policies`, ...). Nothing is
re-exported here on purpose: the policies, scheduler and allocator are pure
and must import without torch, which the engine modules pull in.
"""

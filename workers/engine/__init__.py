"""The torch side of a worker: loading models, the engine's step, the model runner and its fast decoder, the
attention glue to `kv_kernels`, sampling, logprobs, KV export, tensor parallelism, the asyncio loop around it.

May import torch and the layers below (`workers.values`, `workers.scheduling`), never Ray actors or Redis, and
transformers only inside the functions that load a model or a tokenizer (docs/architecture.md, "Layers"). Nothing is re-exported here: the modules that only read settings
(`device`, `runtime`, `models`) import torch inside their functions, so the controller can read them.
"""

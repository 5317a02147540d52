"""The worker's decisions: which sequences run each step, how many KV blocks each holds, which to preempt and
how, what the policies plan by and learn, how long an answer is expected to run.

Pure: imports only `workers.values` and neither torch, Ray nor Redis, so the router, the controller, the
simulator and the tests run these decisions as the workers do (docs/architecture.md, "Layers").
"""

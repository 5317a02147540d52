"""Plain values and their checks, shared by every layer and every process: a request's sampling parameters, a
sequence's state, what an engine step returns, what crosses a process boundary, the settings machinery.

Imports nothing else from the repository and neither torch, Ray nor Redis (docs/architecture.md, "Layers").
"""

"""A worker as the controller sees it: its settings, its Ray actor, the rank actors of a tensor-parallel group.

Imports Ray, and torch only inside the actor's methods: the controller imports this layer to start workers
and never loads torch (docs/architecture.md, "Layers").
"""

"""The control plane: the controller actor, placement and scaling decisions, the Redis ledger, the embedded Redis.

Pure decision modules (`placement`, `scaling`) import neither Ray, Redis nor torch.
Import from the modules.
"""

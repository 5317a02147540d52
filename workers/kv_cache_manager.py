"""The name this module had before `workers/` was split into layers: it is `workers.scheduling.kv_cache_manager`.

Kept so that code written against the old path (a user's own policy, docs/policies.md) goes on importing; new code
imports `workers.scheduling.kv_cache_manager`.
"""

from workers.scheduling.kv_cache_manager import *  # noqa: F401,F403

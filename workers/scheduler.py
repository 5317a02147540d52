"""The name this module had before `workers/` was split into layers: it is `workers.scheduling.scheduler`.

Kept so that code written against the old path (a user's own policy, docs/policies.md) goes on importing; new code
imports `workers.scheduling.scheduler`.
"""

from workers.scheduling.scheduler import *  # noqa: F401,F403

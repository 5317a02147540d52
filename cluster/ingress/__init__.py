"""The HTTP ingress: the Serve router (OpenAI API), a request's trip through the cluster, errors, metrics, dashboard.

Runs in router replicas; talks to the controller and workers through Ray and
never loads the engine (no torch). Import from the modules.
"""

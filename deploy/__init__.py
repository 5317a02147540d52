"""Rollout entry points and manifests (operations issue)."""

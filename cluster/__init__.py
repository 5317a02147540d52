"""Cluster side: the Serve app (router), the controller actor, placement, the Redis store, the `s3serve` CLI.

Import from the modules (`cluster.app`, `cluster.control.placement`, ...). Nothing is re-exported
here on purpose: the pure modules (placement, reservation, text_stream) must import
without Ray, and the router module defines a Serve deployment at import.
"""

"""Cluster side: the Serve application (`app`), its settings (`config`), the HTTP ingress and the control plane.

    ingress/   router replicas: OpenAI API, a request's path, predictor client, errors, metrics, dashboard
    control/   the controller actor: control plane, ledger, worker pool, placement, scaling, Redis

Import from the modules (`cluster.app`, `cluster.control.placement`, ...). Nothing is re-exported
here on purpose: the pure modules (placement, scaling, messages, text_stream) must import
without Ray, and the router module defines a Serve deployment at import.
"""

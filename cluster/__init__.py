"""Cluster side: the `s3serve` CLI and labelling (router, controller and placement land with the cluster issue)."""

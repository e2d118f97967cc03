"""Artifact bundles: manifests, trust checks, the registry and region matching (pure)."""

"""Routed experts: where their weights live and how they are fetched."""

from colibri_core.experts.store import ExpertStore, ExpertWeights

__all__ = ["ExpertStore", "ExpertWeights"]

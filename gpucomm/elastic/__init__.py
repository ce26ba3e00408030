"""Elastic training's worker side: the rounds a worker joins, and the host-change notice."""

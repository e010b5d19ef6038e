"""Sharding plans and mesh construction, installed as dtrain.parallelize; the only place that knows DTensor placements."""

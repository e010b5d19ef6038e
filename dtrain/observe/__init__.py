"""Seeing what a run does: the compile report and the portable compile cache, profiler windows and operator tables."""

"""What keeps a run safe when things go wrong: the launcher and the parent watch, the run lock, run-folder checks,
durable writes."""

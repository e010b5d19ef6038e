"""From a config to a finished run: pre-flight checks, the world, the layout, the model and its state, the loop and
its hooks, validation."""

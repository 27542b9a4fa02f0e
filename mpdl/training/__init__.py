"""Training: the data-parallel loop, checkpoints, the Chrome-trace timeline and the model zoo."""

"""Training: the data-parallel loop, checkpoints and the Chrome-trace timeline (the models it
trains are in `mpdl.models`)."""

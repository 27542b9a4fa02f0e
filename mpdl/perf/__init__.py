"""Measuring and modelling: bench's timing loop, calibrate's measuring and fitting, the simulator.

The `mpdl bench`, `mpdl calibrate` and `mpdl simulate` verbs parse flags and print; the work is
here, so benchmarks, notebooks and tests use it without the CLI. Import the submodules
(`mpdl.perf.bench`, `mpdl.perf.calibrate`, `mpdl.perf.simulate`, `mpdl.perf.units`) directly.
"""

"""tskv's benchmark, a tool beside the library (nothing in the library imports it): one module
per section, run by `python -m benchmarks`, `nox -s bench` or `tskv bench`."""

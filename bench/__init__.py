"""Benchmarks of the disaggregated H3 setup (CPU, embedded tiny model). Entry point: `python bench/run.py`."""

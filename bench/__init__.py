"""Benchmarks behind `visor bench ...`; each prints one JSON object with baseline, optimised and
their ratio, timed in the same run."""

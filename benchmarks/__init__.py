"""Benchmarks and research scripts: run from a checkout (`python -m benchmarks.<name>`), not shipped in the wheel."""

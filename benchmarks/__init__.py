"""sluice's benchmarks: one runner (`python -m benchmarks list | run NAME | table`), a registry of benchmark
functions (`registry.py`), one results folder (`results/`) and one record schema for new results (`runner.py`).
Run from the repository root; the measured `sluice` is whichever one Python imports (PYTHONPATH=src for this tree)."""

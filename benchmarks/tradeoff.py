"""Moved to benchmarks/e2e/tradeoff.py; this path stays because docs and users call it."""

if __name__ == "__main__":
    import _paths

    _paths.run_moved("e2e/tradeoff.py")

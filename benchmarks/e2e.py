"""Moved to benchmarks/e2e/e2e.py; this path stays because docs and users call it."""

if __name__ == "__main__":
    import _paths

    _paths.run_moved("e2e/e2e.py")

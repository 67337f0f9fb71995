"""Helpers shared by more than one test folder (importable as `helpers.*`: pyproject puts tests/
on the path). Each module holds one kind: factories, routing cases, clocks, tolerances."""

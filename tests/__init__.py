"""ringmaster's tests, laid out like the code: tests/<room>/... holds the unit tests of <room>/..., tests/cluster/ the
tests that need a real Ray cluster (marked integration), tests/house/ the checks on the tree itself, tests/support/
what tests share."""

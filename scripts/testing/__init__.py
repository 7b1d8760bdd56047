"""The engine of `make test`: its rows and units (testrun), what it remembers and
reuses (testcache, testdeps, testblocks and the read tracker in reads/, a plain folder
put on PYTHONPATH), the prefix worktrees, the fork servers, and `mutate`."""

"""The RLHF runtime: a single controller over SPMD worker groups, built on :mod:`engine`."""

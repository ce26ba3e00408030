"""The rank side of multi-process tests: what each rank runs (functions for ``tests.harness.run_ranks``,
scripts for ``run_rank_scripts`` and launchers); the ``test_*.py`` files beside this folder hold
the assertions."""

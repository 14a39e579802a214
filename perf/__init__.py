"""Performance on paper and in practice: chip table, FLOP counts, dry run, benchmark, MLPerf logging."""

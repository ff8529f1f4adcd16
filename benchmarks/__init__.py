"""Side-by-side measurements; each script prints a table and writes it to BENCHMARKS.md."""

"""`speckernel bench`: side-by-side measurements, one module per scenario."""

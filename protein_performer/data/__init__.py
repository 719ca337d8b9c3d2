"""Data: splits, datasets, collation and Lightning data modules."""

"""protein-performer."""

"""Memory: one byte ledger and the prompt cache."""

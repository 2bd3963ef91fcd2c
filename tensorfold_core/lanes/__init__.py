"""The lane core: streams, windows, rounds, verify and accept."""

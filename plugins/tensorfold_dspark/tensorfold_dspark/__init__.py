"""tensorfold-dspark: the DSpark drafter, reading an LFM2 target's taps."""

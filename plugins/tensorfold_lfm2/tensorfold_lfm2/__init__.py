"""tensorfold-lfm2: the LFM2 and LFM2-MoE families (short-conv and attention hybrids, exact under speculation)."""

"""tensorfold family plugin: llama and mistral-style checkpoints, dense or MLX affine-quantized."""

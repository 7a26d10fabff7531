"""File I/O below every stage: atomic writes and output locks, model files and their hashes, and the codecs of
every weight format (safetensors, GGUF, MLX, compressed-tensors, GPTQ v1). Nothing here knows a drafter."""

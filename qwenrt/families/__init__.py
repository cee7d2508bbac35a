"""The related model families qwenrt runs as Qwen3.5: each module holds what one family does differently (the config
keys it maps, the tensors it splits or renames at load), so the model code, the native kernels and decode plans,
quantization, the engine and the server apply to it unchanged."""

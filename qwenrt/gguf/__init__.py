"""GGUF files (llama.cpp's format) mapped to and from qwenrt's parameters: the `qwen35` and `qwen35moe`
architectures, as llama.cpp's converter writes them."""

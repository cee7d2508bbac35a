"""The related families' differences from Qwen3.5, one module each (as mlx-lm's model files): what their configs
and checkpoints hold that qwenrt's own parameters express differently, mapped at load, and the few layers of their
own. The ops, layers and engine they share live where Qwen3.5's do."""

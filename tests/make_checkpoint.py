"""Write a tiny random checkpoint to try the CLI without downloads (needs the test extra).

    python -m tests.make_checkpoint DIR [--kind chat|vlm-chat|dense|moe|vlm|published|qwen3-vl|qwen3-vl-moe|qwen3-next]
"""

import argparse
from pathlib import Path

from tests import checkpoints

BUILDERS = {"chat": checkpoints.build_chat_model, "vlm-chat": checkpoints.build_chat_vlm, "dense": checkpoints.build_dense,
            "moe": checkpoints.build_moe, "vlm": checkpoints.build_vlm, "published": checkpoints.build_published_moe,
            "qwen3-vl": checkpoints.build_qwen3_vl,
            "qwen3-vl-moe": lambda path: checkpoints.build_qwen3_vl(path, moe=True, published=True),
            "qwen3-next": checkpoints.build_qwen3_next_chat}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--kind", choices=BUILDERS, default="chat")
    args = parser.parse_args()
    BUILDERS[args.kind](args.dir)
    print(f"wrote a tiny random {args.kind} checkpoint to {args.dir}")

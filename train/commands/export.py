"""`zerotrain export CHECKPOINT OUT_DIR`: a resumable checkpoint (any world size, any ZeRO
stage) -> Hugging Face safetensors weights, offline, on CPU (train/checkpoint/weights.py does it).
A LoRA checkpoint (model.lora) gives PEFT's adapter directory, or with --merge the base weights
with the adapter merged in (train/checkpoint/adapter.py)."""

from __future__ import annotations

import argparse
import sys
import time

from zerotrain.train.checkpoint import files as ckpt_files
from zerotrain.train.checkpoint.adapter import export_lora_checkpoint
from zerotrain.train.checkpoint.weights import EXPORT_DTYPES, export_checkpoint
from zerotrain.train.errors import user_errors


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="zerotrain export",
                                 description="Consolidate a resumable checkpoint (any world size, any ZeRO stage) into "
                                             "Hugging Face safetensors weights. Runs on CPU, one process.")
    ap.add_argument("checkpoint", help="checkpoint directory (runs/x/checkpoints/step_N) or a run directory (newest)")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), help="default: the run's checkpoint.export_dtype")
    ap.add_argument("--max-shard-size", help='largest shard, e.g. "500MB" (default: the run\'s checkpoint.max_shard_size)')
    ap.add_argument("--merge", action="store_true",
                    help="LoRA checkpoints: write the base weights with the adapter merged in (a plain model "
                         "transformers loads) instead of the PEFT adapter directory")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    a = ap.parse_args(argv)
    with user_errors(a.debug):
        t0 = time.perf_counter()
        ckpt = ckpt_files.resolve_checkpoint(a.checkpoint)
        if a.merge or "lora" in ckpt_files.read_json(ckpt / ckpt_files.META, "checkpoint metadata"):
            out = export_lora_checkpoint(ckpt, a.out_dir, a.merge, a.dtype, a.max_shard_size)
        else:
            out = export_checkpoint(ckpt, a.out_dir, a.dtype, a.max_shard_size)
        files = sorted(p.name for p in out.iterdir())
        print(f"zerotrain: exported {a.checkpoint} -> {out} ({', '.join(files)}) in {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The LM loss's memory: torch's cross-entropy on upcast logits vs models/losses.py.

    python bench/lm_loss.py old|new [THREADS]     # one process per variant (peak RSS is per process)

GPT-2-sized bf16 logits (B*T = 16*1024 tokens, vocabulary 50304) on CPU: bytes saved for
backward (counted with saved_tensors_hooks), peak RSS added by loss + backward, wall time.
"""

import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zerotrain.models.losses import cross_entropy  # noqa: E402

N, V = 16 * 1024, 50304


def main():
    mode = sys.argv[1]
    torch.manual_seed(0)
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    fn = (lambda x, t: F.cross_entropy(x.float(), t)) if mode == "old" else cross_entropy
    x = torch.randn(N, V, dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss in KiB)
    saved = {}

    def pack(tn):
        saved[(tn.data_ptr(), tn.dtype, tuple(tn.shape))] = tn.numel() * tn.element_size()
        return tn
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tn: tn):
        t0 = time.perf_counter()
        loss = fn(x, t)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{mode}: loss {loss.item():.6f}; saved for backward {sum(saved.values()) / 2**30:.3f} GiB; logits "
          f"{x.numel() * 2 / 2**30:.3f} GiB; peak RSS +{peak - base:.2f} GiB above the logits; "
          f"forward {t1 - t0:.2f} s, backward {t2 - t1:.2f} s")


if __name__ == "__main__":
    main()

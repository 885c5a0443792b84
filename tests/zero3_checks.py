"""Checks that need DeepSpeed on 2 real processes but no training run, in one launch
(tests/test_zero3.py starts it with torchrun and reads the REPORT line rank 0 prints):

  built       GPT / ResNet-18 / ViT / pretrained ResNet-18 built under zero.Init (fp32, every
              tensor partitioned): shards of ceil(n/2), gathered weights equal an ordinary build
  rope        the same (trained-like, sharp-attention) GPT weights built under bf16 zero.Init and
              ordinarily give the same logits at T=1024
  buffers     buffers of models built under bf16 zero.Init (ResNet-18 BatchNorm statistics, a
              local Llama's) equal an ordinary construction, dtype included
  accumulate  DeepSpeed engines with the shipped bf16 JSONs (ZeRO-1/2/3, as train/strategy/zero.py
              resolves them) keep every one of 64 micro-batch gradients; with bf16 accumulation
              they lose the small ones
"""

import copy
import json
import math
import os
import sys

sys.path.insert(0, os.environ["REPO"])

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402

from zerotrain.models import build_workload  # noqa: E402
from zerotrain.models import resolve as resolve_model  # noqa: E402
from zerotrain.models.gpt import GPT, preset  # noqa: E402
from zerotrain.models.vision import gathering_inits  # noqa: E402
from zerotrain.train.config import ModelConfig, load_config  # noqa: E402
from zerotrain.train.data import DataBundle  # noqa: E402
from zerotrain.train.strategy.ds_config import load_ds_setup  # noqa: E402
from zerotrain.train.strategy.zero import ZeroInit  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")
RANK, WORLD = torch.distributed.get_rank(), torch.distributed.get_world_size()
OUT = os.environ["OUT"]
FP32 = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": False},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
BF16 = {**FP32, "bf16": {"enabled": True}}
LM = DataBundle(train=None, val=None, task="lm", describe="", vocab_size=256, seq_len=64)
IMAGES = DataBundle(train=None, val=None, task="classify", describe="", num_classes=5, class_names=list("abcde"),
                    extra={"image_size": 32})
report = {}


def zero_init(ds):
    return ZeroInit(ds)  # what ZeroStrategy.init_context gives the model builders


def gathered_state(model) -> dict:
    out = {}
    for n, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[n] = p.data.clone()
    return out


# ----------------------------------------------------------------------------- built
def tiny_vit():
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                hidden_dim=32, mlp_dim=64, num_classes=3)


def vit_partitioned():
    # nn.MultiheadAttention initialises its out_proj bias after that Linear was partitioned
    init = zero_init(FP32)
    with init(), gathering_inits(init):
        return tiny_vit()


weights = os.path.join(OUT, "r18.pth")
torch.manual_seed(1)
file_sd = torchvision.models.resnet18(num_classes=1000).state_dict()
if RANK == 0:
    torch.save(file_sd, weights)
torch.distributed.barrier()
pre = resolve_model(ModelConfig(name="resnet18", pretrained=weights))
builders = {
    "gpt-tiny": (lambda: build_workload(resolve_model(ModelConfig(name="gpt-tiny")), LM).model,
                 lambda: build_workload(resolve_model(ModelConfig(name="gpt-tiny")), LM, zero_init(FP32)).model),
    "resnet18": (lambda: build_workload(resolve_model(ModelConfig(name="resnet18")), IMAGES).model,
                 lambda: build_workload(resolve_model(ModelConfig(name="resnet18")), IMAGES, zero_init(FP32)).model),
    "vit": (tiny_vit, vit_partitioned),
    # A local pretrained file loaded into the partitioned model (head replaced, backbone from the file).
    "resnet18-pretrained": (lambda: {**build_workload(pre, IMAGES).model.state_dict(), "file": file_sd},
                            lambda: build_workload(pre, IMAGES, zero_init(FP32)).model),
}
built = {}
for name, (whole_fn, parted_fn) in builders.items():
    torch.manual_seed(0)
    whole = whole_fn()
    whole = whole if isinstance(whole, dict) else whole.state_dict()
    torch.manual_seed(0)
    model = parted_fn()
    params = dict(model.named_parameters())
    full = gathered_state(model)
    r = {"params": len(params), "zero": sum(hasattr(p, "ds_id") for p in params.values()),
         "empty": sum(p.numel() == 0 for p in params.values()),
         "shards": all(p.ds_tensor.numel() == math.ceil(p.ds_numel / WORLD) for p in params.values()),
         "differ": [n for n, t in full.items() if not torch.equal(t, whole[n])]}
    if "file" in whole:  # backbone tensors (parameters and BN buffers) are the file's
        state = dict(model.state_dict())
        r["not_from_file"] = [n for n, t in whole["file"].items() if not n.startswith("fc.") and n not in params
                              and not torch.equal(state[n], t)]
        r["not_from_file"] += [n for n, t in full.items() if not n.startswith("fc.") and not torch.equal(t, whole["file"][n])]
    built[name] = r
report["built"] = built


# ----------------------------------------------------------------------------- rope
def sharpen(model: GPT, factor: float):
    """Scale the query and key projections: attention logits x factor^2, as peaked as a trained
    model's (at initialisation attention is nearly uniform and hides position errors)."""
    with torch.no_grad():
        for block in model.blocks:
            q_and_k = block.attn.qkv.weight[: model.config.d_model + block.attn.n_kv_head * block.attn.head_dim]
            q_and_k.mul_(factor)


cfg = preset("gpt-tiny", seq_len=1024)
torch.manual_seed(0)
reference = GPT(cfg)
sharpen(reference, 20.0)
ref_sd = {k: v.clone() for k, v in reference.state_dict().items()}
with deepspeed.zero.Init(config_dict_or_path=BF16):
    z3 = GPT(cfg)
for n, p in z3.named_parameters():
    with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
        if RANK == 0:
            p.data.copy_(ref_sd[n].to(p.dtype))
bf16_ref = copy.deepcopy(reference).to(torch.bfloat16).eval()  # what ZeRO-1/2 bf16 computes with
z3.eval()
idx = torch.randint(0, 256, (1, 1024), generator=torch.Generator().manual_seed(3))
with torch.no_grad(), deepspeed.zero.GatheredParameters(list(z3.parameters())):
    got = z3(idx).float()
with torch.no_grad():
    want = bf16_ref(idx).float()
tables = [t for t in z3.buffers()]  # none: the tables are not buffers that construction could round
report["rope"] = {"param_dtype": str(next(z3.parameters()).dtype), "max_abs_diff": (got - want).abs().max().item(),
                  "logit_scale": want.abs().max().item(), "buffers": [str(t.dtype) for t in tables]}


# ----------------------------------------------------------------------------- buffers
def buffer_report(ordinary: dict, built_model) -> dict:
    mine = dict(built_model.named_buffers())
    return {"names": sorted(ordinary), "dtypes": sorted({str(b.dtype) for b in mine.values()}),
            "differ": [n for n, b in ordinary.items() if b.dtype != mine[n].dtype or not torch.equal(b, mine[n])]}


torch.manual_seed(0)
resnet18 = resolve_model(ModelConfig(name="resnet18"))
ordinary = {n: b.clone() for n, b in build_workload(resnet18, IMAGES).model.named_buffers()}
torch.manual_seed(0)
resnet = build_workload(resnet18, IMAGES, zero_init(BF16)).model
buffers = {"resnet18": buffer_report(ordinary, resnet)}

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

llama_dir = os.path.join(OUT, "llama")
if RANK == 0:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(llama_dir)
torch.distributed.barrier()
hf = resolve_model(ModelConfig(name=f"hf:{llama_dir}"))
ordinary = {n: b.clone() for n, b in build_workload(hf, LM).model.named_buffers()}
keep = HfDeepSpeedConfig(BF16)  # what Accelerate's plugin keeps alive under ZeRO-3: from_pretrained builds partitioned
buffers["llama"] = buffer_report(ordinary, build_workload(hf, LM, zero_init(BF16)).model)
del keep
report["buffers"] = buffers


# ----------------------------------------------------------------------------- accumulate
def accumulated_norm(stage: int, accum_dtype=None, comm_dtype=None) -> float:
    """Norm of the gradient DeepSpeed steps with after 64 micro-batches: the first contributes
    256/64 = 4 per element, the other 63 contribute 1/64 each (half a bf16 ulp of 4)."""
    micro, accum = 1, 64
    run = load_config(None, [("train.micro_batch_size", str(micro)), ("train.grad_accum_steps", str(accum)),
                             ("train.grad_clip", "0")])
    ds = load_ds_setup(os.path.join(os.environ["REPO"], "ds_configs", f"zero{stage}.json"), run, run.train.batch(WORLD), 10,
                         cuda=False, hidden_size=8)
    config = copy.deepcopy(ds.resolved)
    if accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": accum_dtype}
    if comm_dtype is not None:
        config["communication_data_type"] = comm_dtype
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    x = torch.ones(1, 8, dtype=torch.bfloat16)
    for i in range(accum):
        loss = engine(x).float().sum() * (256.0 if i == 0 else 1.0)
        engine.backward(loss)
        engine.step()
    norm = float(engine.get_global_grad_norm())
    exact = math.sqrt(8) * (256 + 63) / 64
    return norm / exact


report["accumulate"] = {f"zero{s}": {"shipped": accumulated_norm(s), "bf16": accumulated_norm(s, accum_dtype="bf16"),
                                     "fp32_comm": accumulated_norm(s, comm_dtype="fp32")} for s in (1, 2, 3)}

if RANK == 0:
    print("REPORT " + json.dumps(report), flush=True)

"""Preference tuning (issue 40): data.kind preference, train.objective dpo (sigmoid, ipo, simpo).

What is promised: a record's two sequences carry loss on their response tokens only, with the
documented truncation (the prompt whole, responses cut at their end); bad records stop the run
with one line naming the file, the line and the field (chosen == rejected: a warning and a
count); the step-1 loss and gradients equal a naive implementation written here (unpadded
sequences one at a time, log_softmax, a plain forward of the initial model as the reference,
the papers' formulas), in-process and through real launches under DDP and ZeRO-1/2/3 with 2
processes and accumulation, full fine-tuning and LoRA; training raises held-out
rewards/accuracies well above 0.5.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import fp32, make_tokenizer, metrics, random_text, run_main, run_train, save_tiny
from zerotrain.models import build_workload, resolve
from zerotrain.models.losses import IGNORE_INDEX
from zerotrain.models.preference import Preference, frozen_copy
from zerotrain.train.config import DataConfig, LoraConfig, ModelConfig
from zerotrain.train.data import build_data
from zerotrain.train.data.make_preferences import records as synthetic_records

os.environ["HF_HUB_OFFLINE"] = "1"

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def pref(path: Path, seq_len: int, tokenizer: str | None = None, **kw):
    return build_data(DataConfig(kind="preference", path=str(path), seq_len=seq_len, **kw), seq_len, 0, tokenizer)


def trained(labels) -> list[int]:
    return [int(t) for t in labels if t != IGNORE_INDEX]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pref_tok")
    make_tokenizer(d / "tok", [random_text(3000, s) for s in range(3)] + ["user assistant system: hello"],
                   vocab_size=320)
    return d / "tok"


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer_dir) -> Path:
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True))
    return save_tiny("llama", tmp_path_factory.mktemp("pref_llama") / "llama", vocab, tokenizer_dir=tokenizer_dir)


def _records(n: int, seed: int) -> list[dict]:
    import random
    rng = random.Random(seed)
    words = random_text(2000, seed).split()
    pick = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
    return [{"prompt": pick(rng.randint(1, 4)), "chosen": " " + pick(rng.randint(1, 6)),
             "rejected": " " + pick(rng.randint(1, 6))} for _ in range(n)]


# ----------------------------------------------------------------------------- records -> samples

def test_only_response_tokens_are_labels_and_the_prompt_is_kept_whole_responses_cut_at_their_end(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " five"},
                                              {"prompt": "ab", "chosen": "cdefghijklmnop", "rejected": "x"}])
    data = pref(path, 8, val_fraction=0.0)
    assert (data.task, data.vocab_size, data.masked_labels, len(data.train), data.val) == ("lm", 256, False, 2, None)
    s = data.train[0]
    assert s["chosen_input_ids"].tolist() == list(b"Q: 2+2? 4")[:8]
    assert s["chosen_labels"].tolist() == [IGNORE_INDEX] * 6 + [ord(" "), ord("4")]  # cut: EOS beyond seq_len + 1
    assert s["rejected_input_ids"].tolist()[:7] == list(b"Q: 2+2?")                   # the same prompt, whole
    assert trained(s["rejected_labels"]) == [ord(" "), ord("f")]                     # " five" cut to " f"
    long = data.train[1]
    assert trained(long["chosen_labels"]) == list(b"cdefghi")
    assert trained(long["rejected_labels"]) == [ord("x"), 0]                         # + EOS (NUL), padded
    assert long["rejected_input_ids"].tolist() == list(b"abx") + [0] * 5


def test_chat_messages_go_through_the_template_and_only_the_assistant_turn_is_trained(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(str(tmp_path / "chat"))
    rec = {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha beta"}],
           "chosen": [{"role": "assistant", "content": "gamma"}], "rejected": "delta zeta"}
    data = pref(write_jsonl(tmp_path / "c.jsonl", [rec]), 64, str(tmp_path / "chat"), val_fraction=0.0)
    s = data.train[0]
    assert tok.decode(trained(s["chosen_labels"])) == "gamma<|im_end|>\n"
    assert tok.decode(trained(s["rejected_labels"])) == "delta zeta<|im_end|>\n"
    full = tok.apply_chat_template(rec["prompt"] + rec["chosen"], tokenize=False)
    assert tok.decode(s["chosen_input_ids"].tolist()).startswith(full[:-1])
    assert "chat template" in data.describe


BAD = {
    "missing field": ('{"prompt": "x", "chosen": "y"}', 'd.jsonl:2: missing "rejected"'),
    "empty response": ('{"prompt": "x", "chosen": "", "rejected": "y"}', 'd.jsonl:2: empty "chosen"'),
    "wrong type": ('{"prompt": "x", "chosen": 3, "rejected": "y"}', 'd.jsonl:2: "chosen" must be a string or a list'),
    "prompt longer than seq_len": (json.dumps({"prompt": "x" * 100, "chosen": "y", "rejected": "z"}),
                                   'd.jsonl:2: "prompt" is 100 tokens, data.seq_len 32 leaves no "chosen" token'),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_record_stops_the_run_with_one_line_naming_file_line_and_field(case, tmp_path, capsys):
    line, expected = BAD[case]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" + line + "\n")
    code, err = run_main(capsys, ["--model.name", "gpt-tiny", "--data.kind", "preference", "--data.path", str(path),
                                  "--data.seq_len", "32", "--train.objective", "dpo", "--train.run_dir",
                                  str(tmp_path / "run"), "--ds-config", "ds_configs/ddp.json"])
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and expected in lines[0], err


def test_chosen_identical_to_rejected_is_a_warning_and_a_count_and_the_record_is_skipped(tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                              {"prompt": "a", "chosen": "same", "rejected": "same"},
                                              {"prompt": "d", "chosen": "e", "rejected": "f"},
                                              {"prompt": "g", "chosen": "h", "rejected": "h"}])
    data = pref(path, 16, val_fraction=0.0)
    out = capsys.readouterr().out
    assert len(data.train) == 2 and data.extra["skipped_identical"] == 2
    assert "WARNING: 2 record(s)" in out and "d.jsonl:2" in out and len(out.strip().splitlines()) == 1
    assert "2 with chosen == rejected skipped" in data.describe


def test_objective_and_data_kind_go_together():
    from zerotrain.train.config import RunConfig, TrainConfig
    from zerotrain.train.errors import ConfigError
    with pytest.raises(ConfigError, match="train.objective dpo trains on data.kind preference"):
        RunConfig(train=TrainConfig(objective="dpo"))
    with pytest.raises(ConfigError, match="set train.objective dpo"):
        RunConfig(data=DataConfig(kind="preference", path="x.jsonl"))


# ----------------------------------------------------------------------------- the naive implementation

def naive_sequence(model, prompt: list[int], response: list[int], seq_len: int) -> tuple[torch.Tensor, int]:
    """log pi(response | prompt) of one unpadded sequence (cut to seq_len + 1 tokens) from a
    plain forward and log_softmax, and the number of response tokens."""
    ids = (prompt + response)[:seq_len + 1]
    x = torch.tensor([ids])
    logits = model(x[:, :-1])
    logits = (logits.logits if hasattr(logits, "logits") else logits)[0].float()
    logp = torch.log_softmax(logits, -1).gather(1, x[0, 1:, None])[:, 0]
    resp = logp[len(prompt) - 1:]
    return resp.sum(), resp.numel()


def naive_loss(kind: str, beta: float, gamma: float, policy, reference, pairs, seq_len: int) -> torch.Tensor:
    """The mean over `pairs` ((prompt ids, chosen ids, rejected ids)) of the papers' losses; "ipo"
    as TRL computes it (each log-ratio over its completion length), "ipo_sum" the summed form."""
    out = []
    for prompt, c, r in pairs:
        pc, nc = naive_sequence(policy, prompt, c, seq_len)
        pr, nr = naive_sequence(policy, prompt, r, seq_len)
        if kind == "simpo":  # Meng et al. 2024, eq. 6
            out.append(-F.logsigmoid(beta / nc * pc - beta / nr * pr - gamma))
            continue
        with torch.no_grad():
            rc, _ = naive_sequence(reference, prompt, c, seq_len)
            rr, _ = naive_sequence(reference, prompt, r, seq_len)
        h = (pc - rc) - (pr - rr)
        if kind == "ipo":      # TRL's DPOTrainer loss_type "ipo": per-token mean log-ratios
            h = (pc - rc) / nc - (pr - rr) / nr
        if kind == "sigmoid":  # Rafailov et al. 2023, eq. 7
            out.append(-F.logsigmoid(beta * h))
        else:                  # Azar et al. 2023, eq. 17: (h - 1/(2 tau))^2
            out.append((h - 1 / (2 * beta)) ** 2)
    return torch.stack(out).mean()


def byte_pairs(records) -> list[tuple[list[int], list[int], list[int]]]:
    """The plain byte format, written out here: prompt bytes, response bytes + NUL."""
    return [(list(r["prompt"].encode()), list(r["chosen"].encode()) + [0], list(r["rejected"].encode()) + [0])
            for r in records]


def token_pairs(tok, records):
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return [(enc(r["prompt"]), enc(r["chosen"]) + [tok.eos_token_id], enc(r["rejected"]) + [tok.eos_token_id])
            for r in records]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a tensor: ||a - b|| / ||b|| (0 when both are 0)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30)) if b.norm() > 0 else float(a.norm())


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "ipo_sum", "simpo"])
def test_loss_and_gradients_equal_the_naive_implementation_in_process(kind, tmp_path):
    """gpt-tiny, full fine-tuning, fp32: the padded pairs in one forward (chosen and rejected
    concatenated along the batch) against one unpadded sequence at a time; some responses are
    truncated. IPO is TRL's length-normalised form by default, the summed one with
    train.dpo.ipo_sum."""
    recs = _records(6, 1)
    recs[2]["chosen"] = " " + "z" * 60  # cut at seq_len + 1
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    seq_len, beta, gamma = 56, 0.3, 0.7
    data = pref(path, seq_len, val_fraction=0.0)
    torch.manual_seed(0)
    wl = build_workload(resolve(ModelConfig(name="gpt-tiny")), data)
    naive_ref = copy.deepcopy(wl.model)
    wl.preference = Preference(kind.removesuffix("_sum"), beta, gamma, reference=frozen_copy(wl.model),
                               ipo_sum=kind == "ipo_sum")
    batch = torch.utils.data.default_collate([data.train[i] for i in range(len(data.train))])
    loss = wl.loss(wl.model, batch)
    loss.backward()
    got = {n: p.grad.clone() for n, p in wl.model.named_parameters()}
    policy = copy.deepcopy(naive_ref)
    ref = naive_loss(kind, beta, gamma, policy, naive_ref, byte_pairs(recs), seq_len)
    ref.backward()
    assert abs(float(loss) - float(ref)) <= 1e-6 * abs(float(ref)), (float(loss), float(ref))
    for n, p in policy.named_parameters():
        assert _rel(got[n], p.grad) <= 1e-6, (n, _rel(got[n], p.grad))
    m = wl.preference.window(type("Acc", (), {"num_processes": 1})())
    assert set(m) == {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                      "logps/rejected"}
    assert m["rewards/margins"] == pytest.approx(m["rewards/chosen"] - m["rewards/rejected"])


@pytest.mark.parametrize("kind", ["sigmoid", "simpo"])
def test_packed_pairs_give_the_unpacked_loss_and_gradients_in_process(kind, tmp_path):
    """data.packing: the micro-batch's 2B sequences packed into fewer rows of seq_len with the
    document mask give packing off's loss and gradients, and the naive implementation's (gpt-tiny,
    fp32, a live frozen-copy reference for sigmoid; one response cut at seq_len + 1)."""
    from zerotrain.models.preference import pack_sequences
    recs = _records(8, 5)
    recs[3]["chosen"] = " " + "q" * 120  # cut at seq_len + 1: a full row of its own
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    seq_len, beta, gamma = 96, 0.3, 0.7
    got = {}
    for packing in (False, True):
        data = pref(path, seq_len, val_fraction=0.0, packing=packing)
        torch.manual_seed(0)
        wl = build_workload(resolve(ModelConfig(name="gpt-tiny", seq_len=seq_len)), data)
        naive_ref = copy.deepcopy(wl.model)
        wl.preference = Preference(kind, beta, gamma, reference=frozen_copy(wl.model))
        batch = torch.utils.data.default_collate([data.train[i] for i in range(len(data.train))])
        if packing:
            ids, labels = Preference.rows(batch)
            rows = pack_sequences(ids, labels, torch.cat([batch["chosen_length"], batch["rejected_length"]]))
            assert rows["input_ids"].shape[0] <= len(recs), rows["input_ids"].shape  # 16 sequences, <= 8 rows
            assert int(rows["doc_ids"].max()) >= 2                                  # 2+ sequences in a row
        loss = wl.loss(wl.model, batch)
        loss.backward()
        got[packing] = (float(loss), {n: p.grad.clone() for n, p in wl.model.named_parameters()})
    policy = copy.deepcopy(naive_ref)
    ref = naive_loss(kind, beta, gamma, policy, naive_ref, byte_pairs(recs), seq_len)
    ref.backward()
    print("relative |loss - naive|, max relative |grad - naive| per tensor, packing off / on:",
          [(abs(loss - float(ref)) / abs(float(ref)), max(_rel(grads[n], p.grad) for n, p in policy.named_parameters()))
           for loss, grads in got.values()])
    for packing, (loss, grads) in got.items():
        assert abs(loss - float(ref)) <= 1e-6 * abs(float(ref)), (packing, loss, float(ref))
        for n, p in policy.named_parameters():
            assert _rel(grads[n], p.grad) <= 1e-6, (packing, n, _rel(grads[n], p.grad))
    assert abs(got[True][0] - got[False][0]) <= 1e-6 * abs(got[False][0])
    for n, g in got[False][1].items():
        assert _rel(got[True][1][n], g) <= 1e-6, (n, _rel(got[True][1][n], g))


def test_lora_reference_is_the_base_with_adapters_off(tmp_path, llama, tokenizer_dir):
    """Under model.lora the reference forward switches every adapter off: after the adapters
    moved, the reference log-probs are still the base model's, and the loss and the adapter
    gradients equal the naive implementation with the base as the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    recs = _records(4, 2)
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    data = pref(path, 32, str(tokenizer_dir), val_fraction=0.0)
    wl = build_workload(resolve(ModelConfig(name=f"hf:{llama}", lora=LoraConfig(r=4, alpha=8.0,
                                                                       target_modules=["q_proj", "v_proj"]))), data)
    with torch.no_grad():  # adapters that already changed the model (B is zero at init)
        for n, p in wl.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    wl.preference = Preference("sigmoid", 0.5, 0.0, lora=True)
    batch = torch.utils.data.default_collate([data.train[i] for i in range(len(data.train))])
    loss = wl.loss(wl.model, batch)
    loss.backward()
    base = AutoModelForCausalLM.from_pretrained(str(llama), local_files_only=True).float().eval()
    # the policy, written out: base + (alpha / r) B A x on q_proj and v_proj, B and A the run's
    policy = copy.deepcopy(base)
    lora = {n: p.detach().clone().requires_grad_(True) for n, p in wl.model.named_parameters() if "lora_" in n}

    def adapter(name):
        a, b = lora[f"{name}.lora_A.default.weight"], lora[f"{name}.lora_B.default.weight"]
        return lambda mod, inp, out: out + (inp[0] @ a.T @ b.T) * (8.0 / 4)

    for name, mod in policy.named_modules():
        if name.endswith(("q_proj", "v_proj")):
            mod.register_forward_hook(adapter(name))
    ref = naive_loss("sigmoid", 0.5, 0.0, policy, base, token_pairs(tok, recs), 32)
    ref.backward()
    assert abs(float(loss) - float(ref)) <= 1e-6 * abs(float(ref))
    grads = {n: p.grad for n, p in wl.model.named_parameters() if p.grad is not None}
    assert set(grads) == set(lora)
    for n, t in lora.items():
        assert _rel(grads[n], t.grad) <= 1e-6, (n, _rel(grads[n], t.grad))


# ----------------------------------------------------------------------------- real launches

K = 1e4  # AdamW with betas (0, 0) and eps 1e6 >> |g|: the first update is exactly lr / eps x g


def _step_args(model: str, path: Path, run_dir: Path, ds: str, micro: int, accum: int, loss: str) -> list[str]:
    return ["--model.name", model, "--data.kind", "preference", "--data.path", str(path), "--data.seq_len", "32",
            "--train.objective", "dpo", "--train.dpo.loss", loss, "--train.dpo.beta", "0.5",
            "--train.max_steps", "1", "--train.eval_every", "0", "--train.micro_batch_size", str(micro),
            "--train.grad_accum_steps", str(accum), "--train.grad_clip", "0", "--train.run_dir", str(run_dir),
            "--optim.lr", str(K * 1e6), "--optim.min_lr", "0", "--optim.eps", "1e6", "--optim.betas", "[0.0, 0.0]",
            "--optim.schedule", "constant", "--optim.warmup_steps", "0", "--optim.weight_decay", "0",
            "--logging.progress", "false", "--logging.every_steps", "1", "--logging.trackers", "jsonl",
            "--checkpoint.save_at_end", "false", "--checkpoint.export", "true", "--checkpoint.export_dtype", "fp32",
            "--ds-config", ds]


def _exported(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for f in sorted((run_dir / "export").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.multiproc
def test_step_one_loss_and_gradients_equal_the_naive_implementation_under_every_strategy(tmp_path, llama,
                                                                                        tokenizer_dir):
    """8 pairs = the whole training set = step 1's global batch (the validation split is the
    sibling file). The step-1 gradient is read back from the exported weights (w0 - w1) / K.
    Full fine-tuning (frozen-copy reference): DDP 1 process, DDP / ZeRO-1 / ZeRO-2 on 2
    processes with accumulation; ZeRO-3 (2 processes): full fine-tuning with simpo and LoRA."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    recs = _records(8, 3)
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    write_jsonl(tmp_path / "d.val.jsonl", _records(2, 4))
    init = load_file(str(llama / "model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(str(llama), local_files_only=True).float()
    pairs = token_pairs(tok, recs)
    naive = {}
    for loss in ("sigmoid", "simpo"):
        policy = copy.deepcopy(base).train()
        ref_loss = naive_loss(loss, 0.5, 0.5, policy, base.eval(), pairs, 32)
        ref_loss.backward()
        naive[loss] = (float(ref_loss), {n: p.grad.clone() for n, p in policy.named_parameters()})
    runs = {"ddp 1x micro8": ("python", 1, "ddp", 8, 1, "sigmoid"),
            "ddp 2x micro2 accum2": ("torchrun", 2, "ddp", 2, 2, "sigmoid"),
            "zero1 2x micro1 accum4": ("torchrun", 2, "zero1", 1, 4, "sigmoid"),
            "zero2 2x micro4": ("torchrun", 2, "zero2", 4, 1, "sigmoid"),
            "zero3 2x micro2 accum2 simpo": ("torchrun", 2, "zero3", 2, 2, "simpo")}
    report = {}
    for name, (launcher, nproc, stage, micro, accum, loss) in runs.items():
        run_dir = tmp_path / name.replace(" ", "_")
        args = _step_args(f"hf:{llama}", path, run_dir, fp32(tmp_path, stage), micro, accum, loss)
        if loss == "simpo":
            args += ["--train.dpo.gamma", "0.5"]
        run_train(launcher, nproc, args, env={"HF_HUB_OFFLINE": "1"})
        step1 = [r for r in metrics(run_dir) if "loss" in r][0]
        w1 = _exported(run_dir)
        ref_loss, ref_grads = naive[loss]
        worst = max(_rel((init[n] - w1[n]) / K, g) for n, g in ref_grads.items())
        report[name] = (abs(step1["loss"] - ref_loss) / abs(ref_loss), worst)
        assert 0.0 <= step1["rewards/accuracies"] <= 1.0 and "logps/rejected" in step1
        if name == "ddp 1x micro8":  # the export is a transformers model that loads unchanged
            exported = AutoModelForCausalLM.from_pretrained(str(run_dir / "export"), local_files_only=True)
            assert torch.equal(exported.state_dict()["lm_head.weight"], w1["lm_head.weight"])
    print("relative |loss - naive|, max relative |grad - naive| per tensor:", report)
    for name, (d_loss, d_grad) in report.items():
        assert d_loss <= 1e-6 and d_grad <= 1e-6, (name, report)


@pytest.mark.multiproc
def test_packed_pairs_under_zero2_on_two_processes_equal_the_unpacked_naive_implementation(tmp_path, llama,
                                                                                          tokenizer_dir):
    """data.packing through a real 2-process ZeRO-2 launch (the Llama, position_ids restarting per
    sequence, a live frozen-copy reference): the step-1 loss and gradients equal the naive 1-process
    unpacked implementation's within 1e-6 relative."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from zerotrain.models.preference import pack_sequences
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    recs = _records(8, 3)
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    write_jsonl(tmp_path / "d.val.jsonl", _records(2, 4))
    # The records really pack: each rank's micro-batch (4 pairs, 8 sequences) takes fewer rows.
    data = pref(path, 32, str(tokenizer_dir), packing=True)
    for half in (range(0, 4), range(4, 8)):
        batch = torch.utils.data.default_collate([data.train[i] for i in half])
        ids, labels = Preference.rows(batch)
        rows = pack_sequences(ids, labels, torch.cat([batch["chosen_length"], batch["rejected_length"]]))
        assert rows["input_ids"].shape[0] < 8, rows["input_ids"].shape
    init = load_file(str(llama / "model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(str(llama), local_files_only=True).float()
    policy = copy.deepcopy(base).train()
    ref_loss = naive_loss("sigmoid", 0.5, 0.5, policy, base.eval(), token_pairs(tok, recs), 32)
    ref_loss.backward()
    run_dir = tmp_path / "zero2_packed"
    run_train("torchrun", 2, _step_args(f"hf:{llama}", path, run_dir, fp32(tmp_path, "zero2"), 4, 1, "sigmoid")
              + ["--data.packing", "true"], env={"HF_HUB_OFFLINE": "1"})
    step1 = [r for r in metrics(run_dir) if "loss" in r][0]
    w1 = _exported(run_dir)
    worst = max(_rel((init[n] - w1[n]) / K, p.grad) for n, p in policy.named_parameters())
    d_loss = abs(step1["loss"] - float(ref_loss)) / abs(float(ref_loss))
    print("packed zero2 2x micro4: relative |loss - naive|", d_loss, "max relative |grad - naive|", worst)
    assert d_loss <= 1e-6 and worst <= 1e-6, (d_loss, worst)


@pytest.mark.multiproc
def test_lora_step_one_under_zero3_equals_ddp(tmp_path, llama, tokenizer_dir):
    """LoRA (reference: the base with adapters off): ZeRO-3 on 2 processes with accumulation
    gives DDP's 1-process step-1 loss and adapter update, which is the naive gradient (B starts
    at 0, so A's gradient is 0 and B's is what the test computes from the exported A)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    recs = _records(8, 5)
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    write_jsonl(tmp_path / "d.val.jsonl", _records(2, 6))
    lora = ["--model.lora.r", "4", "--model.lora.alpha", "8", "--model.lora.target_modules", "q_proj,v_proj"]
    out = {}
    for name, (launcher, nproc, stage, micro, accum) in {"ddp 1x micro8": ("python", 1, "ddp", 8, 1),
                                                        "zero3 2x micro2 accum2": ("torchrun", 2, "zero3", 2, 2)}.items():
        run_dir = tmp_path / name.replace(" ", "_")
        run_train(launcher, nproc, _step_args(f"hf:{llama}", path, run_dir, fp32(tmp_path, stage), micro, accum,
                                              "sigmoid") + lora, env={"HF_HUB_OFFLINE": "1"})
        out[name] = ([r for r in metrics(run_dir) if "loss" in r][0]["loss"],
                     load_file(str(run_dir / "export" / "adapter_model.safetensors")))
    base = AutoModelForCausalLM.from_pretrained(str(llama), local_files_only=True).float().eval()
    policy = copy.deepcopy(base)
    _, ad = out["ddp 1x micro8"]
    bs = {}

    def adapter(key):
        a = ad[f"base_model.model.{key}.lora_A.weight"]
        bs[key] = torch.zeros(a.shape[1] * 0 + ad[f"base_model.model.{key}.lora_B.weight"].shape[0], a.shape[0],
                              requires_grad=True)
        return lambda mod, inp, o: o + (inp[0] @ a.T @ bs[key].T) * 2.0

    for name, mod in policy.named_modules():
        if name.endswith(("q_proj", "v_proj")):
            mod.register_forward_hook(adapter(name))
    ref = naive_loss("sigmoid", 0.5, 0.0, policy, base, token_pairs(tok, recs), 32)
    ref.backward()
    from peft import PeftModel  # the export is a PEFT adapter directory that loads unchanged
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "zero3_2x_micro2_accum2" / "export"))
    assert sum(1 for n, _ in peft_model.named_parameters() if "lora_B" in n) == len(bs) == 4
    for name, (loss, adapters) in out.items():
        assert abs(loss - float(ref)) <= 1e-6 * float(ref), (name, loss, float(ref))
        for key, b in bs.items():
            got = -adapters[f"base_model.model.{key}.lora_B.weight"] / K
            print(name, key, "relative |grad - naive|", _rel(got, b.grad))
            assert _rel(got, b.grad) <= 1e-6, (name, key, _rel(got, b.grad))


@pytest.mark.multiproc
def test_a_few_hundred_steps_raise_held_out_accuracy_well_above_chance(tmp_path):
    """examples/dpo.yaml's task (letters preferred over digits), gpt-tiny on bytes, 200 steps: the
    held-out val/rewards/accuracies (64 pairs of another seed) is >= 0.9; the export is written."""
    from zerotrain.train.data.make_preferences import write
    train, _ = write(tmp_path / "d" / "train.jsonl", 512, 64, 0)
    run_dir = tmp_path / "run"
    run_train("python", 1, ["--config", "examples/dpo.yaml", "--data.path", str(train), "--train.max_steps", "200",
                            "--train.eval_every", "100", "--train.run_dir", str(run_dir),
                            "--ds-config", "ds_configs/ddp.json"])
    rows = [r for r in metrics(run_dir) if "val/rewards/accuracies" in r]
    assert rows[-1]["val/rewards/accuracies"] >= 0.9, rows
    assert any("rewards/margins" in r for r in metrics(run_dir))
    assert list((run_dir / "export").glob("*.safetensors"))
    assert synthetic_records(3, 0) == synthetic_records(3, 0)  # the set is a pure function of its seed
    assert math.isfinite(rows[-1]["val/loss"])


# ----------------------------------------------------------------------------- precomputed reference

FP32_DDP = str(Path(__file__).resolve().parent.parent / "ds_configs" / "ddp_fp32.json")


def _prepare_reference(args: list[str]) -> None:
    from zerotrain.train.commands.prepare import main as prepare_main
    assert prepare_main(["--reference"] + args) == 0


def _strategy(path: str, cfg):
    """The Strategy of a strategy file, as prepare makes it (no batch, no process group)."""
    from zerotrain.train.strategy import for_setup
    from zerotrain.train.strategy.ds_config import load_ds_setup
    return for_setup(load_ds_setup(path, cfg, None, cfg.train.max_steps, cuda=False, sizes_later=True))


def test_precomputed_reference_gives_the_live_frozen_copy_loss_and_gradients_in_process(tmp_path):
    """`prepare --reference` with the run's model (gpt-tiny, train.seed) writes d.reference.safetensors
    beside the data, keyed by JSONL line; the run's pairs then carry it, and the step-1 loss and
    gradients equal the live frozen-copy reference's. Preparing again is a no-op."""
    from zerotrain.train.config import DpoConfig, RunConfig, TrainConfig
    from zerotrain.train.training.preference_setup import attach_reference
    recs = _records(6, 7)
    recs.insert(2, {"prompt": "a", "chosen": "same", "rejected": "same"})  # skipped: the keys are line numbers
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    seq_len, seed = 48, 11
    args = ["--model.name", "gpt-tiny", "--data.kind", "preference", "--data.path", str(path), "--data.seq_len",
            str(seq_len), "--data.val_fraction", "0.34", "--train.objective", "dpo", "--train.seed", str(seed),
            "--train.dpo.reference", "precomputed", "--strategy", FP32_DDP]
    _prepare_reference(args)
    assert (tmp_path / "d.reference.safetensors").is_file()
    _prepare_reference(args)  # up to date: nothing to do
    data = pref(path, seq_len, val_fraction=0.34)
    cfg = RunConfig(model=ModelConfig(name="gpt-tiny"), data=DataConfig(kind="preference", path=str(path),
                                                                          seq_len=seq_len, val_fraction=0.34),
                    train=TrainConfig(objective="dpo", seed=seed, dpo=DpoConfig(reference="precomputed")))
    attach_reference(cfg, resolve(cfg.model), seq_len, data)
    assert data.val is not None and data.val.reference is not None  # the validation split too
    from accelerate.utils import set_seed
    grads, losses = {}, {}
    for mode in ("live", "precomputed"):
        set_seed(seed)
        wl = build_workload(resolve(ModelConfig(name="gpt-tiny")), data)
        wl.preference = (Preference("sigmoid", 0.4, 0.0, precomputed=True) if mode == "precomputed"
                         else Preference("sigmoid", 0.4, 0.0, reference=frozen_copy(wl.model)))
        batch = torch.utils.data.default_collate([data.train[i] for i in range(len(data.train))])
        assert ("reference_chosen_logps" in batch) == True  # noqa: E712 (attached to the dataset)
        loss = wl.loss(wl.model, batch)
        loss.backward()
        losses[mode], grads[mode] = float(loss), {n: p.grad.clone() for n, p in wl.model.named_parameters()}
    assert abs(losses["precomputed"] - losses["live"]) <= 1e-6 * abs(losses["live"]), losses
    for n, g in grads["live"].items():
        assert _rel(grads["precomputed"][n], g) <= 1e-6, (n, _rel(grads["precomputed"][n], g))


def test_an_interrupted_prepare_reference_resumes_to_the_file_of_one_pass(tmp_path, monkeypatch):
    """`prepare --reference` commits its records to <name>.reference.partial.safetensors every
    REFERENCE_CHUNK records; killed in the third chunk, a new `prepare --reference` starts at the
    first record not committed and writes a file equal to that of one uninterrupted pass."""
    from safetensors.numpy import load_file

    import zerotrain.models.preference as preference
    import zerotrain.train.commands.prepare as prepare
    path = write_jsonl(tmp_path / "d.jsonl", _records(40, 9))
    args = ["--model.name", "gpt-tiny", "--data.kind", "preference", "--data.path", str(path), "--data.seq_len", "48",
            "--data.val_fraction", "0", "--train.objective", "dpo", "--train.dpo.reference", "precomputed"]
    final, partial = tmp_path / "d.reference.safetensors", tmp_path / "d.reference.partial.safetensors"
    _prepare_reference(args)
    whole = load_file(final)
    final.unlink()

    monkeypatch.setattr(prepare, "REFERENCE_CHUNK", 16)
    real, firsts = preference.dataset_reference_logps, []

    def killed_in_the_third_chunk(*a, **kw):
        firsts.append(kw["first"])
        if len(firsts) == 3:
            raise KeyboardInterrupt  # as a Ctrl-C or a kill between commits
        return real(*a, **kw)

    monkeypatch.setattr(preference, "dataset_reference_logps", killed_in_the_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        _prepare_reference(args)
    assert firsts == [0, 16, 32] and not final.exists() and len(load_file(partial)["lines"]) == 32

    firsts.clear()
    monkeypatch.setattr(preference, "dataset_reference_logps", lambda *a, **kw: firsts.append(kw["first"]) or real(*a, **kw))
    _prepare_reference(args)
    assert firsts == [32] and not partial.exists()  # only the records not committed were computed
    resumed = load_file(final)
    assert set(resumed) == set(whole) and all(np.array_equal(resumed[k], whole[k]) for k in whole)


def test_a_stale_reference_file_is_refused_in_one_line(tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", _records(4, 8))
    args = ["--model.name", "gpt-tiny", "--data.kind", "preference", "--data.path", str(path), "--data.seq_len", "32",
            "--data.val_fraction", "0", "--train.objective", "dpo", "--train.dpo.reference", "precomputed"]
    run = args + ["--train.max_steps", "1", "--train.run_dir", str(tmp_path / "run"), "--ds-config",
                  "ds_configs/ddp.json", "--checkpoint.save_at_end", "false"]
    code, err = run_main(capsys, run)  # no file yet
    assert code == 2 and len(err.strip().splitlines()) == 1 and "prepare --reference" in err, err
    assert "--strategy <its strategy file>" in err, err  # made with the run's strategy file
    _prepare_reference(args + ["--strategy", "ds_configs/ddp.json"])
    capsys.readouterr()
    for change, expected in ((["--data.seq_len", "24"], "data.seq_len differs"),
                             (["--train.seed", "5"], "train.seed differs")):
        code, err = run_main(capsys, run + change)
        assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err
    path.write_text(path.read_text() + json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"}) + "\n")
    code, err = run_main(capsys, run)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "d.reference.safetensors is stale" in err, err


@pytest.mark.multiproc
def test_full_fine_tuning_with_a_precomputed_reference_under_zero3_equals_ddp_with_the_live_copy(tmp_path, llama):
    """Full fine-tuning has a reference under ZeRO-3 once it is precomputed: 2 processes with
    accumulation give the step-1 loss and update of 1-process DDP with the live frozen copy."""
    from safetensors.torch import load_file
    recs = _records(8, 9)
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    write_jsonl(tmp_path / "d.val.jsonl", _records(2, 10))
    _prepare_reference(["--model.name", f"hf:{llama}", "--data.kind", "preference", "--data.path", str(path),
                        "--data.seq_len", "32", "--train.objective", "dpo", "--train.dpo.reference", "precomputed"])
    assert (tmp_path / "d.val.reference.safetensors").is_file()
    init = load_file(str(llama / "model.safetensors"))
    out = {}
    for name, (launcher, nproc, stage, micro, accum, ref) in {
            "ddp 1x micro8 live": ("python", 1, "ddp", 8, 1, "live"),
            "zero3 2x micro2 accum2 precomputed": ("torchrun", 2, "zero3", 2, 2, "precomputed")}.items():
        run_dir = tmp_path / name.replace(" ", "_")
        run_train(launcher, nproc, _step_args(f"hf:{llama}", path, run_dir, fp32(tmp_path, stage), micro, accum,
                                              "sigmoid") + ["--train.dpo.reference", ref],
                  env={"HF_HUB_OFFLINE": "1"})
        w1 = _exported(run_dir)
        out[name] = ([r for r in metrics(run_dir) if "loss" in r][0]["loss"],
                     {n: (init[n] - w1[n]) / K for n in init})
    (l0, g0), (l1, g1) = out.values()
    assert abs(l1 - l0) <= 1e-6 * abs(l0), (l0, l1)
    worst = max(_rel(g1[n], g0[n]) for n in g0)
    print("zero3 precomputed vs ddp live: relative |loss|", abs(l1 - l0) / abs(l0), "max relative |grad|", worst)
    assert worst <= 1e-6


def test_the_planner_counts_a_reference_copy_only_for_a_live_reference_of_full_fine_tuning():
    from types import SimpleNamespace
    from zerotrain.train.config import DpoConfig, RunConfig, TrainConfig
    from zerotrain.train.plan.memory_check import plan_batch
    batch = SimpleNamespace(micro=2, accum=1)
    copies = {}
    for ref in ("live", "precomputed"):
        cfg = RunConfig(data=DataConfig(kind="preference", path="d.jsonl"),
                        train=TrainConfig(objective="dpo", dpo=DpoConfig(reference=ref)))
        shape = plan_batch(cfg, batch, 32)
        copies[ref] = (shape.reference_copy,)
    assert copies["live"][0] is True and copies["precomputed"][0] is False


# ----------------------------------------------------------------------------- precision of the reference

def _assert_bf16_step_one_is_log_2(run_dir: Path):
    """A bf16 run's step 1 where policy and reference give the same log-probs: every reward 0,
    the accuracy 0 (no margin > 0), the loss -log sigmoid(0) = log 2."""
    step1 = next(r for r in metrics(run_dir) if "loss" in r)
    assert json.loads((run_dir / "config.json").read_text())["resolved"]["precision"] == "bf16"
    assert (step1["rewards/chosen"], step1["rewards/rejected"], step1["rewards/margins"]) == (0.0, 0.0, 0.0), step1
    assert step1["rewards/accuracies"] == 0.0 and abs(step1["loss"] - math.log(2)) <= 1e-7, step1


@pytest.mark.multiproc
@pytest.mark.parametrize("ds", ["ddp", "zero2", "fsdp2"])
def test_bf16_step_one_rewards_are_exactly_zero_with_the_frozen_copy(tmp_path, ds):
    """The shipped bf16 JSONs (1 process, gpt-tiny, dropout 0): before any update the policy and
    its frozen copy are the same model, so they must give the same log-probs bit for bit: every
    reward 0, the accuracy 0 (no margin > 0), the loss -log sigmoid(0) = log 2, as TRL's
    DPOTrainer with bf16=True gives. The copy is built in fp32 before prepare; it runs as the
    policy does (DDP: Accelerate's autocast; ZeRO: the engine's 16-bit parameters; FSDP2: a bf16 copy).
    FSDP2 runs on 2 processes: rank 1 builds the model and its copy on the meta device, and both
    get rank 0's values (a copy left unfilled would give other log-probs, not rewards of 0)."""
    from zerotrain.train.data.make_preferences import write
    train, _ = write(tmp_path / "d" / "train.jsonl", 64, 16, 0)
    run_dir = tmp_path / "run"
    launcher, nproc = ("torchrun", 2) if ds == "fsdp2" else ("python", 1)
    run_train(launcher, nproc, ["--config", "examples/dpo.yaml", "--data.path", str(train), "--train.max_steps", "1",
                                "--train.eval_every", "0", "--logging.every_steps", "1", "--model.dropout", "0",
                                "--checkpoint.export", "false", "--train.run_dir", str(run_dir),
                                "--ds-config", f"ds_configs/{ds}.json"])
    _assert_bf16_step_one_is_log_2(run_dir)


def test_a_reference_made_in_another_precision_is_refused_in_one_line(tmp_path, capsys):
    """The file records how its log-probs were computed (the strategy file's precision and backend
    form); a bf16 run refuses one made in fp32, in one line naming the file, both forms and the
    command with its own strategy file (exit 2), before anything is built. A file from before the
    form was recorded counts as fp32: an fp32 run still reads it, a bf16 run refuses it."""
    from safetensors.numpy import load_file

    from zerotrain.train.data import reference
    path = write_jsonl(tmp_path / "d.jsonl", _records(4, 8))
    args = ["--model.name", "gpt-tiny", "--data.kind", "preference", "--data.path", str(path), "--data.seq_len", "32",
            "--data.val_fraction", "0", "--train.objective", "dpo", "--train.dpo.reference", "precomputed"]
    run = args + ["--train.max_steps", "1", "--train.micro_batch_size", "2", "--train.run_dir", str(tmp_path / "run"),
                  "--checkpoint.save_at_end", "false", "--checkpoint.export", "false"]
    _prepare_reference(args + ["--strategy", FP32_DDP])
    made = tmp_path / "d.reference.safetensors"
    assert reference.read_meta(made)["compute"] == "fp32"
    capsys.readouterr()
    for strategy in ("ds_configs/ddp.json", "ds_configs/zero2.json"):
        code, err = run_main(capsys, run + ["--ds-config", strategy])
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"{made} was computed in fp32, but this run computes in bf16" in err, err
        assert f"zerotrain prepare --reference --config <this run's file> --strategy {strategy}" in err, err
    assert "bf16 autocast with fp32 outputs (ddp) on cpu" in run_main(capsys, run + ["--ds-config", "ds_configs/ddp.json"])[1]

    # A file without "compute" (written before it was recorded, in fp32): fp32 runs read it.
    meta = {k: v for k, v in reference.read_meta(made).items() if k != "compute"}
    t = load_file(made)
    reference.write(made, t["lines"], t["chosen_logps"], t["rejected_logps"], meta)
    code, err = run_main(capsys, run + ["--ds-config", "ds_configs/ddp.json"])
    assert code == 2 and "was computed in fp32, but this run computes in bf16" in err, err
    from zerotrain.train.config import DpoConfig, RunConfig, TrainConfig
    from zerotrain.train.training.preference_setup import attach_reference, check_reference_compute
    cfg = RunConfig(model=ModelConfig(name="gpt-tiny"), data=DataConfig(kind="preference", path=str(path), seq_len=32,
                                                                          val_fraction=0.0),
                    train=TrainConfig(objective="dpo", dpo=DpoConfig(reference="precomputed")))
    data = pref(path, 32, val_fraction=0.0)
    attach_reference(cfg, resolve(cfg.model), 32, data)
    for fp32_file in (FP32_DDP, FP32_DDP.replace("ddp_fp32", "zero2_fp32")):  # one form under every backend
        check_reference_compute(data, _strategy(fp32_file, cfg), "cpu")
    assert np.array_equal(np.sort(data.train.reference[0]), np.sort(t["chosen_logps"]))  # the file's values


@pytest.mark.multiproc
@pytest.mark.parametrize("ds", ["ddp", "zero2", "zero3"])
def test_bf16_step_one_rewards_are_exactly_zero_with_a_precomputed_reference(tmp_path, ds, capsys):
    """`prepare --reference --strategy <the run's bf16 JSON>` computes the log-probs as the run's
    policy computes its own at step 1 (Strategy.frozen_like_policy: DDP's autocast with fp32
    outputs, ZeRO's bf16 module), and a ZeRO run reads them in fp32 (not cast to its bf16 input
    dtype), so a bf16 run starts as TRL's DPOTrainer with bf16=True and the live copy do: every
    reward 0, accuracy 0, the loss exactly log 2. ZeRO-3: full fine-tuning's only reference there.
    (Before, prepare computed in fp32: step-1 loss 0.693132 under ddp.json, 0.694225 under zero2.json.)"""
    from zerotrain.train.data.make_preferences import write
    train, _ = write(tmp_path / "d" / "train.jsonl", 64, 16, 0)
    common = ["--config", "examples/dpo.yaml", "--data.path", str(train), "--model.dropout", "0",
              "--train.dpo.reference", "precomputed"]
    _prepare_reference([*common, "--strategy", f"ds_configs/{ds}.json"])
    assert "computed in bf16" in capsys.readouterr().out
    run_dir = tmp_path / "run"
    run_train("python", 1, [*common, "--train.max_steps", "1", "--train.eval_every", "0", "--logging.every_steps", "1",
                            "--checkpoint.export", "false", "--train.run_dir", str(run_dir),
                            "--ds-config", f"ds_configs/{ds}.json"])
    _assert_bf16_step_one_is_log_2(run_dir)

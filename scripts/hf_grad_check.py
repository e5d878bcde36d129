#!/usr/bin/env python3
"""Checks ctxtrain's gradients against PyTorch autograd through Hugging Face transformers.

    hf_grad_check.py MODEL_DIR TOKENS.bin GRADS.safetensors N

MODEL_DIR is what `ctxtrain --export-weights` wrote, GRADS what `ctxtrain --dump-grads` wrote for
the first step on TOKENS.bin (uint32 ids; positions 0..N-1 predict 1..N). Prints the two losses
and, per parameter, the norm-wise relative error of ctxtrain's gradient against autograd's.
"""
import sys

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main():
    folder, tokens_path, grads_path, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    model = AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    tokens = np.fromfile(tokens_path, dtype=np.uint32).astype(np.int64)
    ids = torch.tensor(tokens[:n], device="cuda")[None]
    targets = torch.tensor(tokens[1:n + 1], device="cuda")
    logits = model(ids).logits[0].float()
    loss = torch.nn.functional.cross_entropy(logits, targets)
    loss.backward()
    ours = load_file(grads_path)
    print(f"loss: transformers {loss.item():.6f}")
    worst = 0.0
    for name, p in model.named_parameters():
        if name not in ours:
            print(f"  {name}: missing from {grads_path}")
            worst = float("inf")
            continue
        ref = p.grad.float()
        got = ours[name].to("cuda").float().reshape(ref.shape)
        rel = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        worst = max(worst, rel)
        print(f"  {name:55s} rel. error {rel:.3e}")
    print(f"worst relative gradient error {worst:.3e} over {len(list(model.parameters()))} tensors")


if __name__ == "__main__":
    main()

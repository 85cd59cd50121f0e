"""The error ``import-hf --expert-format fp8`` and ``--expert-format mxfp4`` introduce, on a
trained model.

    tierstore train --store run --model small --steps 40
    python scripts/quant_error_study.py run WORKDIR [--tokens 96] [--json out.json]

Exports the run (fp32, its masters), imports it as it is and once per format, generates
greedily from the exact store after each of several prompts, then runs those sequences
through every store and compares each generated position's logits (max and mean absolute
error, and the largest logit for scale) and greedy choices; and generates freely from each
quantized store to count the tokens equal to the exact store's. The same numbers are the
round trip's of a fine-tuned quantized checkpoint, whose export packs fp32 masters the same
way (docs/inference.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import tierstore.hf as th
import torch
from tierstore.hf import export_hf, import_hf

PROMPTS = [
    "The store keeps the experts on fast disks and the cache keeps ",
    "Once upon a time, ",
    "def main():\n    ",
    "In the beginning the model was small, and ",
]
FORMATS = ("fp8", "mxfp4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("workdir")
    ap.add_argument("--tokens", type=int, default=96, help="generated per prompt")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    hf_dir = os.path.join(a.workdir, "hf")
    exact = os.path.join(a.workdir, "exact")
    if not os.path.isdir(hf_dir):
        export_hf(a.run, hf_dir, dtype="fp32", progress=False)
    if not os.path.isdir(exact):
        import_hf(hf_dir, exact, progress=False)
    for fmt in FORMATS:
        if not os.path.isdir(os.path.join(a.workdir, fmt)):
            import_hf(hf_dir, os.path.join(a.workdir, fmt), progress=False, expert_format=fmt)
    kw = dict(max_new_tokens=a.tokens, do_sample=False, min_new_tokens=a.tokens)
    base = th.load(exact, mode="resident", device="cpu", dtype=torch.float32)
    runs = []  # per prompt: (prompt length, greedy sequence, its logits)
    try:
        with torch.no_grad():
            for p in PROMPTS:
                ids = torch.tensor([list(p.encode())])
                seq = base.generate(ids, **kw)
                runs.append((ids, seq, base(seq).logits[0]))
    finally:
        base.tierstore.close()
    out = {"prompts": len(PROMPTS), "tokens": len(PROMPTS) * a.tokens,
           "expert_bytes_exact": _expert_bytes(exact)}
    for fmt in FORMATS:
        out[fmt] = _compare(os.path.join(a.workdir, fmt), runs, kw)
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


def _compare(store: str, runs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
             kw: dict[str, int | bool]) -> dict[str, float | int]:
    model = th.load(store, mode="resident", device="cpu", dtype=torch.float32)
    errs, same, top = [], [], 0.0
    equal = first_total = 0
    try:
        with torch.no_grad():
            for ids, seq, la in runs:
                lb = model(seq).logits[0]
                gen = slice(ids.shape[1] - 1, seq.shape[1] - 1)  # positions that chose a token
                errs.append((la - lb).abs()[gen].reshape(-1))
                same.append((la.argmax(-1) == lb.argmax(-1))[gen])
                top = max(top, float(la[gen].abs().max()))
                free = model.generate(ids, **kw)
                new_a, new_b = seq[0, ids.shape[1]:], free[0, ids.shape[1]:]
                equal += int((new_a == new_b).sum())
                first_total += next((i for i, (x, y) in enumerate(
                    zip(new_a.tolist(), new_b.tolist())) if x != y), len(new_a))
    finally:
        model.tierstore.close()
    err, agree = torch.cat(errs), torch.cat(same)
    return {"max_abs_logit_error": float(err.max()), "mean_abs_logit_error": float(err.mean()),
            "max_abs_logit": top, "greedy_agreement_teacher_forced": float(agree.float().mean()),
            "free_generation_equal_tokens": equal,
            "free_generation_tokens_before_first_difference": first_total,
            "expert_bytes": _expert_bytes(store)}


def _expert_bytes(path: str) -> int:
    import tierstore

    with tierstore.open(path) as st:
        return sum(st.info(n).nbytes for n in st.names("model.layers."))


if __name__ == "__main__":
    sys.exit(main())

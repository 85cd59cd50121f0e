"""The error ``import-hf --expert-format fp8`` introduces, on a trained model.

    tierstore train --store run --model small --steps 100
    python scripts/quant_error_study.py run WORKDIR [--tokens 256] [--json out.json]

Exports the run (fp32, its masters), imports it twice (as it is, and with
``--expert-format fp8``), generates greedily from the exact store, then runs that sequence
through both and compares every position's logits (max and mean absolute error, and the
largest logit for scale) and greedy choices; and generates freely from the fp8 store to
count the tokens equal to the exact store's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import tierstore.hf as th
import torch
from tierstore.hf import export_hf, import_hf

PROMPT = "The store keeps the experts on fast disks and the cache keeps "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("workdir")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    hf_dir = os.path.join(a.workdir, "hf")
    exact, fp8 = os.path.join(a.workdir, "exact"), os.path.join(a.workdir, "fp8")
    if not os.path.isdir(hf_dir):
        export_hf(a.run, hf_dir, dtype="fp32", progress=False)
    if not os.path.isdir(exact):
        import_hf(hf_dir, exact, progress=False)
    if not os.path.isdir(fp8):
        import_hf(hf_dir, fp8, progress=False, expert_format="fp8")
    ids = torch.tensor([list(PROMPT.encode())])
    kw = dict(max_new_tokens=a.tokens, do_sample=False, min_new_tokens=a.tokens)
    a_model = th.load(exact, mode="resident", device="cpu", dtype=torch.float32)
    b_model = th.load(fp8, mode="resident", device="cpu", dtype=torch.float32)
    try:
        with torch.no_grad():
            seq = a_model.generate(ids, **kw)
            la, lb = a_model(seq).logits[0], b_model(seq).logits[0]
            free = b_model.generate(ids, **kw)
    finally:
        a_model.tierstore.close()
        b_model.tierstore.close()
    gen = slice(ids.shape[1] - 1, seq.shape[1] - 1)  # the positions that chose a token
    err = (la - lb).abs()[gen]
    same = (la.argmax(-1) == lb.argmax(-1))[gen]
    new_a, new_b = seq[0, ids.shape[1]:], free[0, ids.shape[1]:]
    first = next((i for i, (x, y) in enumerate(zip(new_a.tolist(), new_b.tolist())) if x != y),
                 len(new_a))
    out = {
        "tokens": int(err.shape[0]),
        "max_abs_logit_error": float(err.max()),
        "mean_abs_logit_error": float(err.mean()),
        "max_abs_logit": float(la[gen].abs().max()),
        "greedy_agreement_teacher_forced": float(same.float().mean()),
        "free_generation_equal_tokens": int((new_a == new_b).sum()),
        "free_generation_first_difference": first,
        "expert_bytes_exact": _expert_bytes(exact),
        "expert_bytes_fp8": _expert_bytes(fp8),
    }
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


def _expert_bytes(path: str) -> int:
    import tierstore

    with tierstore.open(path) as st:
        return sum(st.info(n).nbytes for n in st.names("model.layers."))


if __name__ == "__main__":
    sys.exit(main())

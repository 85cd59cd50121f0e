"""Child process of tests/test_hf_quant_train.py: a trainable load of a quantized store (its
packed weights becoming fp32 masters) and two steps, SIGKILLed at the Nth write
(``put_many`` or ``delete``).

:func:`run` runs in a process forked from a server that has imported torch, transformers and
tierstore once. ``kill_at`` 0 runs through and writes to ``count`` how many writes there
were and which was the first ``delete`` (the first after the model's commit)."""

from __future__ import annotations

import os
import signal
from typing import Any

import tierstore.hf
import torch

import tierstore


def run(store: str, kill_at: int, count: str) -> None:
    torch.set_num_threads(1)
    calls = [0]
    first_delete = [0]
    st = tierstore.open(store, host_cache="64KiB")

    def arm(name: str) -> None:
        inner = getattr(st, name)

        def write(*a: Any, **kw: Any) -> Any:
            calls[0] += 1
            if name == "delete" and not first_delete[0]:
                first_delete[0] = calls[0]
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return inner(*a, **kw)

        setattr(st, name, write)

    arm("put_many")
    arm("delete")
    model = tierstore.hf.load(st, trainable=True, device="cpu")
    opt = tierstore.hf.ExpertAdamW(model, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randint(3, 100, (1, 4), generator=g)
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    tierstore.hf.save(model)
    model.tierstore.close()
    st.close()
    with open(count, "w") as f:
        f.write(f"{calls[0]} {first_delete[0]}")

"""accelerate's disk offload as the peer of ``tierstore bench infer --peer accelerate``:
one greedy generation in this process (what ``python -m tierstore.bench.peers accelerate``
runs), the experts of every MoE layer offloaded to ``"disk"`` and the rest on the CPU."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import tierstore

from .llamacpp_run import _read_bytes as read_bytes
from .memlimit import drop_page_cache


def offload_device_map(model: Any) -> dict[str, str]:
    """A ``device_map`` for ``model`` (built on the meta device) with every module under an
    ``experts`` module (Mixtral, Qwen-MoE, OLMoE: ``...mlp.experts`` or
    ``...block_sparse_moe.experts``) on ``"disk"`` and everything else on ``"cpu"``."""
    device_map = {}
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None and \
                next(module.buffers(recurse=False), None) is None:
            continue
        device_map[name] = "disk" if "experts" in name.split(".") else "cpu"
    if "disk" not in device_map.values():
        raise tierstore.StoreError("the checkpoint's model has no `experts` modules to offload")
    return device_map


def run_accelerate(model_dir: str, offload_dir: str, prompt: Sequence[int],
                   max_new_tokens: int, *, drop_after_load: bool = False,
                   threads: int | None = None) -> dict[str, Any]:
    """Greedy generation through accelerate's disk offload; what the runner prints."""
    import resource

    import accelerate
    import torch
    import transformers

    if threads:
        torch.set_num_threads(threads)
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    with accelerate.init_empty_weights():
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    device_map = offload_device_map(meta)
    del meta
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, device_map=device_map, offload_folder=offload_dir, dtype="auto")
    model.eval()
    load_s = time.perf_counter() - t0
    # transformers re-saves fused experts into the offload folder while loading, which
    # leaves them in the page cache: a cold run drops it again, so that generation reads
    # the experts from the disk as a cold tierstore run does.
    cache = drop_page_cache() if drop_after_load else None
    marks: list[float] = []

    class FirstLogits(transformers.LogitsProcessor):
        """Notes when each step's logits are ready: the first after the prefill."""

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            marks.append(time.perf_counter())
            return scores

    ids = torch.tensor([list(prompt)], dtype=torch.long)
    io0 = read_bytes()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             logits_processor=transformers.LogitsProcessorList([FirstLogits()]))
        end = time.perf_counter()
    io1 = read_bytes()
    tokens = out[0, ids.shape[1]:].tolist()
    prefill_s = marks[0] - start if marks else end - start
    return {"tokens": [tokens], "prefill_s": prefill_s, "decode_s": end - start - prefill_s,
            "load_s": load_s,
            # what the offload's hooks read from storage while generating (/proc/self/io)
            "bytes_read_generating": io1 - io0 if io0 is not None and io1 is not None else None,
            "cache_after_load": (cache or "dropped") if drop_after_load else "as loaded",
            "self_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "accelerate": accelerate.__version__, "transformers": transformers.__version__,
            "offloaded_modules": sum(v == "disk" for v in device_map.values()),
            "threads": torch.get_num_threads()}



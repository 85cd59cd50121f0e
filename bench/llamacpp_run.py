"""The processes of the llama.cpp peer (:mod:`tierstore.bench.llamacpp`), run by path::

    python .../tierstore/bench/llamacpp_run.py run --gguf F --prompt-ids 1,2,3 \\
        --max-new-tokens 16 [--threads 1] [--eos-ids 2]
    python .../tierstore/bench/llamacpp_run.py convert --source LLAMA_CPP --model-dir D \\
        --outfile F [--outtype f32|bf16|q8_0] [--made-up-tokenizer]

``run`` prints one line of JSON. This file imports nothing of tierstore: ``python -m
tierstore.bench...`` would import the ``tierstore`` package, and with it torch (6-11 s
here), into a process whose start-up is llama.cpp's cold start as a user would see it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any


def _read_bytes() -> int | None:
    """Bytes this process has had read from storage (page faults on mapped files too)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def run_llamacpp(gguf_path: str, prompt: Sequence[int], max_new_tokens: int, *,
                 threads: int = 1, eos: Sequence[int] = ()) -> dict[str, Any]:
    """Greedy generation of ``prompt`` through llama.cpp: the argmax of each step's logits,
    the file memory-mapped, ``threads`` compute threads for the prompt and the decode;
    generation stops at ``max_new_tokens`` or after an ``eos`` token, as ``generate`` does.
    """
    import resource

    t0 = time.perf_counter()
    io0 = _read_bytes()
    import llama_cpp
    import numpy as np

    import_s = time.perf_counter() - t0
    # No extra buffer types (weights repacked for AMX and other kernels): with them
    # llama.cpp 0.3.36 dies of SIGILL (gpt-oss) or fails an assertion in its scheduler
    # (deepseek2) on Q8_0 weights on the project's machine, whose CPU reports AMX inside a
    # VM; F32 and BF16 tensors are never repacked, so their runs are the same either way.
    default_params = llama_cpp.llama_model_default_params

    def model_params() -> Any:
        params = default_params()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama.llama_cpp.llama_model_default_params = model_params
    n = len(prompt)
    t1 = time.perf_counter()
    # One batch for the whole prompt, as the other systems' prefill is one pass.
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=n + max_new_tokens + 1,
                          n_batch=max(512, n), n_ubatch=max(512, n), n_threads=threads,
                          n_threads_batch=threads, n_gpu_layers=0, use_mmap=True,
                          use_mlock=False, logits_all=False, verbose=False)
    load_s = time.perf_counter() - t1
    io_loaded = _read_bytes()

    n_vocab = llm.n_vocab()

    def step(ids: Sequence[int]) -> int:
        # Only the last position's logits are computed (logits_all=False), as generate's.
        llm.eval(list(ids))
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(n_vocab,))))

    tokens: list[int] = []
    start = time.perf_counter()
    tok = step(prompt)
    first = time.perf_counter()
    tokens.append(tok)
    while len(tokens) < max_new_tokens and tok not in eos:
        tok = step([tok])
        tokens.append(tok)
    end = time.perf_counter()
    io_end = _read_bytes()
    known = io0 is not None and io_end is not None and io_loaded is not None
    return {"tokens": [tokens], "prefill_s": first - start, "decode_s": end - first,
            "import_s": import_s, "load_s": load_s,
            # over the whole process (loading advises the kernel to read the mapped file
            # ahead), and while generating (pages read again once evicted)
            "bytes_read": io_end - io0 if known else None,
            "bytes_read_generating": io_end - io_loaded if known else None,
            "self_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "llama_cpp": llama_cpp.__version__, "threads": threads, "use_mmap": True}


def convert(source: str, model_dir: str, outfile: str, made_up: bool, outtype: str = "f32"
            ) -> int:
    """llama.cpp's converter, in this process: ``outtype`` (its ``--outtype``) into
    ``outfile``. With ``made_up`` the
    checkpoint's tokenizer is one the study made: its byte-level pre-tokenizer cannot be
    named by llama.cpp's table of known tokenizers' hashes, so it is called ``default``."""
    import runpy

    script = os.path.join(source, "convert_hf_to_gguf.py")
    sys.path[:0] = [source, os.path.join(source, "gguf-py")]
    # Loaded without running it, so that its tokenizer hook can be set first: the class is
    # the script's own (older llama.cpp) or its ``conversion`` package's.
    found = runpy.run_path(script, run_name="llamacpp_convert")
    if made_up:
        text_model = found.get("TextModel") or getattr(sys.modules.get("conversion.base"),
                                                        "TextModel", None)
        if text_model is None or not hasattr(text_model, "get_vocab_base_pre"):
            print(f"llamacpp_run.py: {script} has no TextModel.get_vocab_base_pre to name a "
                  "made-up tokenizer's pre-tokenizer", file=sys.stderr)
            return 2

        def default_pre(self: Any, tokenizer: Any) -> str:
            return "default"

        text_model.get_vocab_base_pre = default_pre
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", outtype, "--outfile", outfile]
    try:
        found["main"]()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="llamacpp_run.py",
                                description="One process of the llama.cpp peer of `tierstore "
                                            "bench infer --peer llamacpp`.")
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="Greedy generation through llama.cpp; one JSON line.")
    r.add_argument("--gguf", required=True, help="The model, GGUF.")
    r.add_argument("--prompt-ids", required=True, metavar="1,2,3", help="The prompt.")
    r.add_argument("--max-new-tokens", type=int, required=True)
    r.add_argument("--threads", type=int, default=1, help="Compute threads [1].")
    r.add_argument("--eos-ids", default="", metavar="2", help="End-of-sequence token ids.")
    c = sub.add_parser("convert", help="A Hugging Face checkpoint to GGUF.")
    c.add_argument("--source", required=True, help="llama.cpp's source: its converter.")
    c.add_argument("--model-dir", required=True)
    c.add_argument("--outfile", required=True)
    c.add_argument("--outtype", choices=("f32", "bf16", "q8_0"), default="f32",
                   help="The converter's --outtype [f32]; shipped MXFP4 experts stay MXFP4.")
    c.add_argument("--made-up-tokenizer", action="store_true")
    args = p.parse_args(argv)
    if args.what == "convert":
        return convert(args.source, args.model_dir, args.outfile, args.made_up_tokenizer,
                       args.outtype)
    try:
        prompt = [int(x) for x in args.prompt_ids.split(",") if x]
        eos = [int(x) for x in args.eos_ids.split(",") if x]
    except ValueError:
        p.error("--prompt-ids and --eos-ids take comma-separated integers")
    if not prompt or args.max_new_tokens < 1 or args.threads < 1:
        p.error("give a prompt, --max-new-tokens and --threads of at least 1")
    if not os.path.isfile(args.gguf):
        print(f"llamacpp_run.py: no such file: {args.gguf}", file=sys.stderr)
        return 2
    try:
        out = run_llamacpp(args.gguf, prompt, args.max_new_tokens, threads=args.threads,
                           eos=eos)
    except (ValueError, OSError) as e:  # llama.cpp refuses the file
        print(f"llamacpp_run.py: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

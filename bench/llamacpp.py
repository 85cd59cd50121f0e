"""llama.cpp as a peer of ``tierstore bench infer``: the tool a user would pick instead for a
model larger than RAM.

Setup, the ``llamacpp`` extra: llama-cpp-python, which PyPI carries as source only, so pip
builds llama.cpp for the CPU (:data:`BUILD_TIME`), ``gguf`` and ``sentencepiece`` (which
llama.cpp's converter imports before it looks for a SentencePiece model).

Conversion: the checkpoint becomes one GGUF file of F32 tensors through llama.cpp's own
``convert_hf_to_gguf.py`` (with its ``conversion`` package and its own ``gguf-py``), taken
from the source distribution of the installed llama-cpp-python, so converter and library
are one revision. pip fetches that source distribution once into the user's cache
(``~/.cache/tierstore/llama.cpp-VERSION``); ``TIERSTORE_LLAMACPP_SOURCE`` names a llama.cpp
source tree to use instead. The file is made once, outside the timed runs, and kept beside
the checkpoint (``MODEL_DIR/gguf/``) with a stamp of the files it came from. A checkpoint
without a tokenizer (the benchmark's synthetic ones) is given a made-up one for the
converter, which needs a vocabulary; every run is given token ids, so its text never
matters. llama.cpp names a byte-level pre-tokenizer by a hash of a known tokenizer's output,
which a made-up one cannot match: for it alone the converter is told ``default``.

The run (:func:`run_llamacpp`, in a fresh process): greedy, argmax of the logits on the
given prompt ids, ``n_threads`` compute threads for the prompt and the decode alike, the
file memory-mapped (llama.cpp's default: under a memory limit its pages compete with
everything else in the page cache), the prefill (prompt to the first token's logits) and
decode timed apart, and the bytes the process read from storage (``/proc/self/io``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tierstore

EXTRA = "pip install 'tierstore[llamacpp]'"
# Measured: `pip install --no-cache-dir 'llama-cpp-python>=0.3'` (0.3.36, 193 compile and
# link steps) took 585 CPU-seconds, 36.6 minutes of wall clock on the project's 2-core
# machine while other work kept its load average at 10-13.
BUILD_TIME = "10 CPU-minutes, 37 minutes on a shared 2-core machine"
SOURCE_ENV = "TIERSTORE_LLAMACPP_SOURCE"
# The processes' own file, run by path (it says why).
RUNNER = Path(__file__).with_name("llamacpp_run.py")
CONVERTER = "convert_hf_to_gguf.py"
_NEEDED = (("llama_cpp", "llama-cpp-python"), ("gguf", "gguf"), ("sentencepiece", "sentencepiece"))
# The made-up vocabulary: llama's special tokens, its 256 byte tokens, then words.
_MIN_VOCAB = 3 + 256 + 27


def missing() -> str | None:
    """One line naming what ``--peer llamacpp`` lacks, or None."""
    absent = [dist for mod, dist in _NEEDED if importlib.util.find_spec(mod) is None]
    if not absent:
        return None
    return (f"--peer llamacpp needs {', '.join(absent)}: {EXTRA} (it builds llama.cpp from "
            f"source for the CPU, {BUILD_TIME})")


def run_command(gguf_path: str, prompt: Sequence[int], new_tokens: int, threads: int,
                eos: Sequence[int]) -> list[str]:
    """The command of one llama.cpp run (it prints one line of JSON)."""
    return [sys.executable, str(RUNNER), "run", "--gguf", gguf_path, "--prompt-ids",
            ",".join(map(str, prompt)), "--max-new-tokens", str(new_tokens), "--threads",
            str(threads), "--eos-ids", ",".join(map(str, eos))]


def check_vocab(vocab: int) -> None:
    """A synthetic checkpoint's vocabulary must hold the made-up tokenizer."""
    if vocab < _MIN_VOCAB:
        raise tierstore.StoreError(f"--peer llamacpp needs --vocab of at least {_MIN_VOCAB} "
                                   f"(llama's special and byte tokens), got {vocab}")


# --- the converter ----------------------------------------------------------------------

def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tierstore"


def llamacpp_version() -> str:
    return importlib.metadata.version("llama_cpp_python")


def converter_label() -> str:
    """Which converter converts: the source tree named, or the installed version's."""
    named = os.environ.get(SOURCE_ENV)
    return f"{SOURCE_ENV}={named}" if named else f"llama-cpp-python {llamacpp_version()}"


def converter_source(echo: Callable[[str], Any] = print) -> Path:
    """A directory holding llama.cpp's converter, its ``conversion`` package and ``gguf-py``,
    of the installed llama-cpp-python's revision (fetched once; see the module docstring)."""
    named = os.environ.get(SOURCE_ENV)
    if named:
        if not (Path(named) / CONVERTER).is_file():
            raise tierstore.StoreError(f"{SOURCE_ENV}={named} holds no {CONVERTER}")
        return Path(named)
    version = llamacpp_version()
    home = _cache_root() / f"llama.cpp-{version}"
    if (home / CONVERTER).is_file():
        return home
    echo(f"fetching llama.cpp's converter: the source distribution of llama-cpp-python "
         f"{version} (pip download, once, into {home})")
    home.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home.parent) as tmp:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--quiet", "-d", tmp, f"llama-cpp-python=={version}"],
            capture_output=True, text=True, timeout=1800)
        tarballs = list(Path(tmp).glob("*.tar.gz"))
        if got.returncode or not tarballs:
            last = (got.stderr.strip().splitlines() or ["no source distribution"])[-1]
            raise tierstore.StoreError(f"cannot fetch llama.cpp's converter with pip ({last}); "
                                       f"set {SOURCE_ENV} to a llama.cpp source tree")
        staged = Path(tmp) / "src"
        with tarfile.open(tarballs[0]) as tar:
            members = []
            for m in tar.getmembers():
                parts = m.name.split("/")
                if parts[1:3] != ["vendor", "llama.cpp"] or len(parts) < 4:
                    continue
                if parts[3] == CONVERTER or parts[3] in ("conversion", "gguf-py"):
                    m.name = "/".join(parts[3:])
                    members.append(m)
            tar.extractall(staged, members=members, filter="data")
        if not (staged / CONVERTER).is_file():
            raise tierstore.StoreError(f"llama-cpp-python {version}'s source distribution "
                                       f"holds no {CONVERTER}; set {SOURCE_ENV}")
        try:
            os.replace(staged, home)
        except OSError:  # another study got there first
            if not (home / CONVERTER).is_file():
                raise
    return home


def write_made_up_tokenizer(model_dir: str | Path, vocab: int, bos: int = 1, eos: int = 2
                            ) -> None:
    """A llama-style BPE tokenizer (byte fallback) of exactly ``vocab`` tokens: the special
    tokens at ``bos``/``eos`` (and 0), the 256 byte tokens, a few merges, then fillers."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    check_vocab(vocab)
    specials = {0: "<unk>", bos: "<s>", eos: "</s>"}
    if len(specials) != 3 or max(specials) > 2:
        raise tierstore.StoreError(f"a made-up tokenizer needs bos and eos among ids 1 and 2 "
                                   f"(the checkpoint has {bos} and {eos})")
    words = ["▁", *"abcdefghijklmnopqrstuvwxyz"]
    table = [specials[i] for i in range(3)] + [f"<0x{b:02X}>" for b in range(256)] + words
    merges = [("▁", c) for c in words[1:]]
    table += [a + b for a, b in merges]
    table += [f"▁w{i}" for i in range(vocab - len(table))]
    table = table[:vocab]
    ids = {t: i for i, t in enumerate(table)}
    merges = [(a, b) for a, b in merges if a + b in ids]
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(list(specials.values()))
    tok.save(str(Path(model_dir) / "tokenizer.json"))
    with open(Path(model_dir) / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                   "model_max_length": 1 << 20}, f)


def _has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                                     "tekken.json"))


def _fingerprint(model_dir: Path, outtype: str) -> str:
    h = hashlib.sha256(f"{converter_label()} {outtype.upper()}".encode())
    for p in sorted(model_dir.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _config(model_dir: Path) -> dict[str, Any]:
    with open(model_dir / "config.json") as f:
        cfg = json.load(f)
    return {**cfg, **(cfg.get("text_config") or {})}


def eos_ids(model_dir: str | Path) -> list[int]:
    """The checkpoint's end-of-sequence ids (generation config first, as ``generate``)."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def converted(model_dir: str, scratch: str, *, timeout_s: float = 3600.0, outtype: str = "f32",
              echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """The checkpoint as GGUF of ``outtype`` (the converter's: ``f32``, ``bf16``, ``q8_0``;
    gpt-oss's shipped MXFP4 experts stay MXFP4 under any), converted now or found from an
    earlier study; what the study reports of it (``path`` among it)."""
    kind = outtype.upper()
    src_dir = Path(model_dir)
    where = src_dir / "gguf"
    try:
        where.mkdir(exist_ok=True)
        writable = os.access(where, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        where = Path(scratch) / "gguf"
        where.mkdir(exist_ok=True)
        echo(f"{model_dir} is not writable: the GGUF file goes to the study's scratch folder")
    out, stamp = where / f"model-{kind}.gguf", where / f"model-{kind}.json"
    key = _fingerprint(src_dir, outtype)
    if out.is_file() and stamp.is_file():
        with open(stamp) as f:
            info = json.load(f)
        if info.get("fingerprint") == key:
            echo(f"GGUF {kind} from an earlier conversion: {out}")
            return {**info, "path": str(out), "cached": True}
    source = converter_source(echo)
    made_up = not _has_tokenizer(src_dir)
    stage = src_dir
    tmp = tempfile.mkdtemp(prefix="tierstore-gguf-", dir=scratch)
    try:
        if made_up:
            # The converter reads the checkpoint's folder: a folder of links to its files
            # and the made-up tokenizer leaves the checkpoint as it is.
            stage = Path(tmp) / "hf"
            stage.mkdir()
            for p in src_dir.iterdir():
                if p.is_file():
                    (stage / p.name).symlink_to(p.resolve())
            cfg = _config(src_dir)
            write_made_up_tokenizer(stage, int(cfg["vocab_size"]),
                                    int(cfg.get("bos_token_id") or 1),
                                    int((eos_ids(src_dir) or [2])[0]))
        part = where / f".model-{kind}.gguf.{os.getpid()}"
        echo(f"converting {model_dir} to GGUF {kind} with llama.cpp's {CONVERTER} ({source})"
             + (" and a made-up tokenizer" if made_up else ""))
        t0 = time.perf_counter()
        cmd = [sys.executable, str(RUNNER), "convert", "--source", str(source),
               "--model-dir", str(stage), "--outfile", str(part), "--outtype", outtype]
        got = subprocess.run(cmd + (["--made-up-tokenizer"] if made_up else []),
                             capture_output=True, text=True, timeout=timeout_s)
        seconds = time.perf_counter() - t0
        if got.returncode:
            part.unlink(missing_ok=True)
            lines = [ln for ln in got.stderr.strip().splitlines() if ln.strip()]
            raise tierstore.StoreError(
                f"llama.cpp's converter ({converter_label()}) cannot convert "
                f"{_config(src_dir).get('model_type', 'this')} checkpoint {model_dir}: "
                f"{lines[-1] if lines else f'exit status {got.returncode}'}")
        os.replace(part, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info = {"fingerprint": key, "converter": converter_label(),
            "convert_s": seconds, "made_up_tokenizer": made_up, **describe(out)}
    with open(stamp, "w") as f:
        json.dump(info, f, indent=2)
    echo(f"converted in {seconds:.1f} s: {out} ({info['bytes'] / 1e9:.2f} GB, "
         f"{info['architecture']}, tensor types {info['tensor_types']})")
    return {**info, "path": str(out), "cached": False}


def describe(path: str | Path) -> dict[str, Any]:
    """A GGUF file's architecture, size and count of tensors of each type (``gguf``)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"architecture": arch, "bytes": os.path.getsize(path), "tensor_types": types}

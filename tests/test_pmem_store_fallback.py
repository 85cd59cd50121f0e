"""The PMem store without libpmem: the mmap + msync fallback behind the same Store API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, sys, warnings, torch, tierstore
    root = sys.argv[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st = tierstore.open(root + "/s", create=True, backing="pmem",
                            pmem_path=root + "/pool", pmem_size="8MiB", host_cache="1MiB")
    x = torch.arange(300_000, dtype=torch.float32)  # larger than the pool and the cache
    st.put("big", x)
    st.put("w", torch.ones(10, 10, dtype=torch.bfloat16))
    st.snapshot("s1")
    st.put("w", torch.zeros(10, 10, dtype=torch.bfloat16))
    st.restore("s1")
    out = {"describe": st.describe(),
           "warned": [w.category.__name__ for w in caught].count("PmemFallbackWarning")}
    st.close()
    st = tierstore.open(root + "/s")
    out["big"] = bool(torch.equal(st.get("big"), x))
    out["view"] = bool(torch.equal(st.view("w"), torch.ones(10, 10, dtype=torch.bfloat16)))
    out["fsck"] = st.fsck().ok
    st.close()
    print(json.dumps(out))
''')


def test_store_on_the_mmap_fallback(tmp_path) -> None:
    env = {**os.environ, "TIERSTORE_NO_LIBPMEM": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "mmap fallback" in out["describe"], out
    assert out["warned"] == 1, "the fallback must say so, once"
    assert out["big"] and out["view"] and out["fsck"], out

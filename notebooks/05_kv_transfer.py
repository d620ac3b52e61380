# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # KV blocks between processes, while the cache grows
#
# Disaggregated serving moves KV caches between processes: a prefill worker writes K/V blocks,
# a decode worker pulls them and attends over them. A growing `ExtensibleTensor` is what such
# a cache wants; `jaxbuf.transfer` moves its blocks and follows its growth, over one of two
# transports, chosen per peer when it connects:
#
# * **the same-host transport**, for a peer on this host running as this user (the usual
#   case: one process per GPU). The peer serves its chunks as POSIX descriptors over a Unix
#   socket, this side maps them (`jaxbuf.sharing`), and a transfer is one driver copy of the
#   whole block list: a `memcpy` loop in C here, one stream-ordered batch on a GPU. NIXL's UCX
#   cannot do this for VMM memory without fabric handles: between two processes of one H200
#   it moved a jaxbuf cache at 0.40 GB/s through TCP, against the device copy's 1.9 TB/s.
# * **NIXL** (UCX), between hosts, or when asked for with `transport="nixl"`. A `Registration`
#   keeps NIXL's registrations in step with the buffer: a grow registers only the chunks it
#   mapped; `release_physical()`, `defragment()` and `free()` deregister before they unmap.
#
# Here this notebook is the **prefill** side: a cache of two segments (K and V) of 32 KiB
# blocks. A second Python process is the **decode** side: it learns this cache's layout from
# a metadata message, READs blocks into its own cache, and reads what arrived as a JAX array,
# zero-copy. Between two reads the prefill cache grows, and the decode side learns the growth
# from a newer metadata message. On a GPU the same code moves VRAM.

# %%
import base64
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

import jaxbuf
from jaxbuf.transfer import Agent, KVEndpoint, KVLayout

TOKENS, HEADS, HEAD_DIM = 16, 8, 64  # one block: 16 tokens of 8 heads x 64 float32
BLOCK_BYTES = TOKENS * HEADS * HEAD_DIM * 4
print(f"block: {BLOCK_BYTES // 1024} KiB per segment (K, V)")

# %% [markdown]
# ## The prefill cache, its endpoint
#
# The `KVEndpoint` describes the buffer as blocks of `BLOCK_BYTES` from the start of each
# segment, and registers it with the NIXL agent for peers on other hosts (a `Registration`
# that follows it). Its metadata message also offers the same-host transport.

# %%
cache = jaxbuf.ExtensibleTensor(64 << 20, device="cpu", num_segments=2)  # K, V
cache.resize_per_segment_(6 * BLOCK_BYTES)
prefill = KVEndpoint(Agent("prefill"), cache, KVLayout(BLOCK_BYTES))
print(prefill.registration)


def write_blocks(first, count, seed):
    """Prefill: fill blocks [first, first + count) of K and V with known values."""
    rng = np.random.default_rng(seed)
    for segment in (0, 1):
        view = prefill.block_view(segment, first, count).view("float32")
        values = rng.standard_normal(view.shape[0], dtype=np.float32)
        view.to_numpy()[:] = values


write_blocks(0, 6, seed=1)

# %% [markdown]
# ## The decode process
#
# It makes its own agent and cache, then answers commands on stdin: `connect` (a metadata
# message, the first or a newer one; the reply says which transport the peer got), `read`
# (block ids to pull into the same ids of its cache, then the sum of the blocks through JAX).
# Messages travel as base64 lines; in a real deployment they go over whatever control
# channel the workers share.

# %%
DECODE = textwrap.dedent(
    """
    import base64, json, sys
    import jax.numpy as jnp
    import jaxbuf
    from jaxbuf.transfer import Agent, KVEndpoint, KVLayout

    block_bytes = int(sys.argv[1])
    cache = jaxbuf.ExtensibleTensor(64 << 20, device="cpu", num_segments=2)
    decode = KVEndpoint(Agent("decode"), cache, KVLayout(block_bytes))
    peer = None
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "connect":
            try:
                peer = decode.connect(base64.b64decode(command["metadata"]))
            except ValueError as error:  # stale or hostile: refused, nothing changed
                reply = {"refused": str(error)}
            else:
                layout = peer.layout
                reply = {
                    "transport": peer.transport,
                    "epoch": layout.epoch,
                    "blocks": list(layout.committed_blocks),
                }
        elif command["do"] == "read":
            blocks = command["blocks"]
            need = (max(blocks) + 1) * block_bytes
            if cache.bytes_per_segment < need:  # the decode cache grows too
                cache.resize_per_segment_(need)
            decode.read(peer, blocks, blocks).wait(timeout=30)
            # What arrived, as JAX arrays over the cache's memory (no copy).
            k = decode.block_view(0, 0, max(blocks) + 1).view("float32").to_jax()
            v = decode.block_view(1, 0, max(blocks) + 1).view("float32").to_jax()
            sums = [float(jnp.sum(k)), float(jnp.sum(v))]
            reply = {"sums": sums, "chunks": cache.num_physical_chunks}
        else:
            break
        print("REPLY", json.dumps(reply), flush=True)  # NIXL logs on stdout too
    decode.close()
    cache.free()
    """
)
with tempfile.NamedTemporaryFile("w", suffix="_decode.py", delete=False) as script:
    script.write(DECODE)
decode = subprocess.Popen(
    [sys.executable, script.name, str(BLOCK_BYTES)],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
)


def ask(**command):
    decode.stdin.write(json.dumps(command) + "\n")
    decode.stdin.flush()
    for line in decode.stdout:
        if line.startswith("REPLY "):
            return json.loads(line[len("REPLY ") :])
    raise RuntimeError(f"the decode process exited ({decode.wait()})")


def metadata():
    return base64.b64encode(prefill.metadata()).decode()


print("decode learned:", ask(do="connect", metadata=metadata()))

# %% [markdown]
# ## Decode pulls the first six blocks and reads them through JAX

# %%
reply = ask(do="read", blocks=list(range(6)))
expected = [float(np.sum(cache.segment_view(s).view("float32").to_numpy())) for s in (0, 1)]
print("decode's sums through JAX:", reply["sums"])
print("prefill's sums in numpy:  ", expected)
assert np.allclose(reply["sums"], expected, rtol=1e-5)

# %% [markdown]
# ## The prefill cache grows, the decode side learns it, blocks span the growth
#
# The grow maps new chunks (and the registration registers those, and only those). The next
# metadata message is newer; the decode side asks the prefill side's socket for the new
# chunks and maps them (only those: the old ones stay mapped), and one READ takes blocks from
# old and new chunks alike: in this process's address space the imported cache is one range.

# %%
grown_blocks = 100
cache.resize_per_segment_(grown_blocks * BLOCK_BYTES)
write_blocks(6, grown_blocks - 6, seed=2)
print(prefill.registration, "->", cache.num_physical_chunks, "chunks")
print("decode learned:", ask(do="connect", metadata=metadata()))
reply = ask(do="read", blocks=list(range(grown_blocks)))
expected = [float(np.sum(cache.segment_view(s).view("float32").to_numpy())) for s in (0, 1)]
print("decode's sums through JAX:", reply["sums"], f"({reply['chunks']} chunks there)")
print("prefill's sums in numpy:  ", expected)
assert np.allclose(reply["sums"], expected, rtol=1e-4)

# %% [markdown]
# ## What registrations follow
#
# After `defragment()` each segment is one chunk (and one registration): the decode side
# unmaps the old chunks and maps the new ones at the next message. A stale or hostile
# metadata message (an old epoch, a segment outside the reservation, another endpoint's
# socket) is refused with a `ValueError`, and changes nothing.

# %%
old_message = prefill.metadata()
cache.defragment()
print("after defragment:", prefill.registration)
print("decode learned:", ask(do="connect", metadata=metadata()))
reply = ask(do="read", blocks=list(range(grown_blocks)))
print("decode's sums after the defragment:", reply["sums"])
assert np.allclose(reply["sums"], expected, rtol=1e-4)
print("an old message:", ask(do="connect", metadata=base64.b64encode(old_message).decode()))
decode.stdin.write(json.dumps({"do": "quit"}) + "\n")
decode.stdin.close()
print("decode exited with", decode.wait(timeout=60))
prefill.close()
cache.free()
print("registrations left:", prefill.agent.live_registrations)
os.unlink(script.name)
